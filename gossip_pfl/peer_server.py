"""The process server of ``gossip-pfl peers-local`` (Linux): peer processes forked from one
interpreter that imported torch and loaded the compiled CPU loops once, instead of each its
own interpreter spending about 3 s of CPU on them (docs/p2p.md).

The launcher starts the server as it started a peer process (a ``subprocess`` with a clean
set of descriptors and the peers' environment), so a peer forked from it has what a peer
started on its own had: the environment, no descriptor of the launcher's caller, the
interpreter's own ``sys.stdout`` and ``sys.stderr`` (now over its log), Python's SIGINT.
Requests come as JSON lines on the server's stdin, replies go on a pipe of their own (nothing
the server or a library prints can garble them):

    launcher -> server   {"start": ["peer", ...], "log": "RUN_DIR/logs/K.txt"}
                         {"kill": PID}                  (SIGKILL, if PID is its running child)
    server -> launcher   {"pid": PID}                   (one a start, in order)
                         {"exited": PID, "code": CODE}  (Popen's returncode: -N for signal N)

The server ends when its stdin does (the launcher has finished): the peers it forked run on,
as processes started by a launcher run on when it ends. After Ctrl-C it forks no more (a start
still queued is refused), and a launcher stopped by an error or Ctrl-C kills it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import sys
import time

from gossip_pfl.errors import GossipError

#: the longest the launcher waits for a process to start (the server's imports: about 3 s;
#: numba's compile on a machine without its cache: about 15 s)
START_TIMEOUT_S = 300


def preload() -> None:
    """Import torch and load the compiled loops every linear run calls, computing nothing
    (torch's thread pool starts in each process, after the fork). The tests' fork server
    loads this too (tests/_forkserver.py)."""
    import torch  # noqa: F401

    from gossip_pfl.runtime import data

    data.warm_up()  # the plan's shuffles (and numba's start)
    try:
        from gossip_pfl.runtime import kernels
    except (ImportError, RuntimeError, OSError):  # no loadable numba: the runs use torch ops
        return
    kernels.warm_up(kernels.COMMON)  # (a run of pFedMe, APFL or FedLi-LS loads its own)


#: a SIGINT reached the server (Ctrl-C): it forks no more peers, and a peer forked as it came
#: stops at once, as one started a moment earlier would have
_interrupted = False


def _on_sigint(signum: int, frame) -> None:
    global _interrupted
    _interrupted = True


def serve(replies: int) -> None:
    """The server's loop (``python -m gossip_pfl.peer_server FD``: replies on descriptor FD).
    Ctrl-C while it imports ends it; later it only stops it forking (the peers and the
    launcher get the same Ctrl-C; a SIGINT to the server alone leaves the run as it is)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (an ignored one would hide exit codes)
    preload()
    import gossip_pfl.cli  # noqa: F401  (the peers' command, imported once too)

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (not an ignored one)
        signal.signal(signal.SIGINT, _on_sigint)
    gc.freeze()  # (the forked peers share these pages and never collect them)
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return  # the launcher has finished; the peers run on
            requests, pending = _messages(pending, chunk)
            for request in requests:
                if "kill" in request:
                    if request["kill"] in children:  # (not a pid reaped and reused)
                        os.kill(request["kill"], signal.SIGKILL)
                    continue
                if _interrupted:
                    _reply(replies, {"pid": None})
                    continue
                sys.stdout.flush()  # (a forked peer would write the server's text again)
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    os.close(replies)
                    _peer(request["start"], request["log"])  # never returns
                children.add(pid)
                _reply(replies, {"pid": pid})
        while children:  # (its children are the peers: no call a peer)
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            children.discard(pid)
            _reply(replies, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _messages(pending: bytes, chunk: bytes) -> tuple[list[dict], bytes]:
    """The whole JSON lines of ``pending + chunk``, and what is left of a line cut short."""
    *lines, rest = (pending + chunk).split(b"\n")
    return [json.loads(line) for line in lines], rest


def _reply(fd: int, message: dict) -> None:
    try:
        os.write(fd, (json.dumps(message) + "\n").encode())
    except BrokenPipeError:  # the launcher is gone
        sys.exit(0)


def _peer(argv: list[str], log: str) -> None:
    """A forked peer: ``gossip-pfl ARGV`` with its output appended to ``log``; it leaves with
    the command's exit code (120 where its output cannot be flushed, as an interpreter does)
    and never returns into the server."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        for fd, to in ((null, 0), (out, 1), (out, 2)):
            os.dup2(fd, to)
        os.close(null)
        os.close(out)
        try:
            if signal.getsignal(signal.SIGINT) is _on_sigint:
                signal.signal(signal.SIGINT, signal.default_int_handler)
            if _interrupted:  # (a SIGINT between the fork and the line above)
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            print("gossip-pfl: interrupted", file=sys.stderr)
            code = 130
        else:
            from gossip_pfl.cli import main

            raise SystemExit(main(argv))
    except SystemExit as stop:  # (its result, argparse's exit, sys.exit)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            code = 120
        os._exit(code)


class PeerServer:
    """The launcher's side: ``start`` forks a peer and returns a handle with the part of
    ``subprocess.Popen`` the launcher uses (``pid``, ``poll``, ``wait``, ``kill``,
    ``returncode``); ``close`` ends the server."""

    def __init__(self, env: dict[str, str], log: str) -> None:
        import subprocess

        replies, write = os.pipe()
        try:
            with open(log, "a") as out:  # (the server holds its own copy)
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "gossip_pfl.peer_server", str(write)],
                    stdin=subprocess.PIPE, stdout=out, stderr=out, env=env,
                    pass_fds=(write,),
                )  # fmt: skip
        except BaseException:
            os.close(replies)
            raise
        finally:
            os.close(write)
        self._replies = os.fdopen(replies, "rb", buffering=0)
        self.log, self.codes, self._pids, self._pending = log, {}, [], b""
        self.started: list[int] = []

    def start(self, argv: list[str], log: str) -> _Served:
        self._send({"start": argv, "log": log})
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._pids:  # (the first waits for the server's imports)
            if time.monotonic() > deadline:
                raise self._fail(f"started no process in {START_TIMEOUT_S} s (its log: "
                                 f"{self.log})")  # fmt: skip
            self._read(timeout=1.0)
        pid = self._pids.pop(0)
        if pid is None:
            raise self._fail("was interrupted (SIGINT) and starts no more processes")
        self.started.append(pid)
        return _Served(self, pid)

    def kill(self, pid: int) -> None:
        self._send({"kill": pid})

    def poll(self) -> None:
        """Take in the exits reported so far."""
        self._read(timeout=0.0)

    def _send(self, request: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None

    def _read(self, timeout: float) -> None:
        if select.select([self._replies], [], [], timeout)[0]:
            chunk = self._replies.read(1 << 16)
            if not chunk:
                raise self._died()
        else:
            chunk = b""
        # (every whole reply, those left from an earlier read too)
        messages, self._pending = _messages(self._pending, chunk)
        for message in messages:
            if "exited" in message:
                self.codes[message["exited"]] = message["code"]
            else:
                self._pids.append(message["pid"])

    def _died(self) -> GossipError:
        code = self.proc.wait()
        with open(self.log) as log:
            lines = log.read().strip().splitlines()
        return self._fail(f"exited with code {code}" + (f": {lines[-1]}" if lines else ""))

    def _fail(self, what: str) -> GossipError:
        """The error of a server that can serve no more; the peers it started and that have
        not ended stop (SIGTERM: each saves its checkpoint) rather than run on unwatched."""
        for pid in self.started:
            if pid not in self.codes:  # (not an ended, reaped pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        return GossipError(f"peers-local: its process server {what}")

    def close(self, abort: bool = False) -> None:
        """End the server: at once when ``abort`` (a start still queued forks no peer), else
        once it has read every request."""
        try:
            if not abort:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
                with contextlib.suppress(Exception):
                    self.proc.wait(timeout=10)
        finally:  # (Ctrl-C while it waits too)
            if self.proc.poll() is None:  # (aborted, or a server that does not end)
                self.proc.kill()
                self.proc.wait()
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            self._replies.close()


class _Served:
    """A peer process forked by the server."""

    def __init__(self, server: PeerServer, pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.poll()
            self.returncode = self.server.codes.get(self.pid)
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            self.server.kill(self.pid)


if __name__ == "__main__":
    try:
        serve(int(sys.argv[1]))
    except KeyboardInterrupt:  # (while it imported: it had forked nothing)
        sys.exit(130)
