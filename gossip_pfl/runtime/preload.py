"""Imported once by a process that others fork from (``peers-local``'s launcher, before it
forks its peer processes; the tests' fork server, before their Gloo ranks): torch, and numba's
start with the compiled CPU loops that every linear run calls. Each process then starts with
them instead of spending about 3 s of CPU importing and loading them itself (torch about 2 s,
numba's start and its loops' loads about 0.6 s).

Imports and loads only: no torch computation, whose thread pool must start in each process,
after the fork (each sets its own thread count then). Importing this module does the loading:
import it only where that is the point.
"""

import torch  # noqa: F401

from gossip_pfl.runtime import data

data.warm_up()  # the plan's shuffles (and numba's start)
try:
    from gossip_pfl.runtime import kernels
except (ImportError, RuntimeError, OSError):  # no loadable numba: the runs use torch ops
    pass
else:
    kernels.warm_up(kernels.COMMON)  # (a run of pFedMe, APFL or FedLi-LS loads its own)
