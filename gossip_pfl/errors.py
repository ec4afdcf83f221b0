"""The one exception type users see from gossip_pfl (the CLI prints its message on one line and
exits 2), and the exit status of a process the kill schedule crashes."""

from __future__ import annotations


class GossipError(ValueError):
    """Bad input or a failed run. The message is one line that names the problem."""


#: the exit status of a peer process that the kill schedule (runtime.faults.kill) crashed
KILLED_EXIT = 75
