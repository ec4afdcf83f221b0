"""Imported once by the tests' fork server, before any rank forks from it (tests/_helpers.py):
numba's start and the compiled CPU loops, loaded here, are then every rank's without its own
half second (about 60 ranks a run of the suite). NumPy and numba only: no torch computation,
whose thread pool must start in each rank, after the fork."""

from gossip_pfl.runtime import data

data.warm_up()  # the plan's shuffles (and numba's start)
try:
    from gossip_pfl.runtime import kernels
except (ImportError, RuntimeError, OSError):  # no loadable numba: the runs use torch ops
    pass
else:
    kernels.warm_up(kernels.COMMON)  # (a rank of pFedMe or FedLi-LS loads its own)
