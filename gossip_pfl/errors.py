"""The one exception type users see from gossip_pfl (the CLI prints its message on one line and
exits 2), and the exit status of a process the kill schedule crashes."""

from __future__ import annotations


class GossipError(ValueError):
    """Bad input or a failed run. The message is one line that names the problem."""


def one_line(err: BaseException) -> str:
    """An exception's message on one line (its type's name where it has none)."""
    return " ".join(str(err).split()) or type(err).__name__


#: the exit status of a peer process that the kill schedule (runtime.faults.kill) crashed
KILLED_EXIT = 75
