"""Imported once by the tests' fork server, before any rank forks from it (tests/_helpers.py):
numba's start and the compiled CPU loops, loaded here (as peers-local's process server loads
them), are then every rank's without its own half second (about 60 ranks a run of the suite).
No torch computation, whose thread pool must start in each rank, after the fork."""

from gossip_pfl.peer_server import preload

preload()
