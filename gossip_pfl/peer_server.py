"""The process server of ``gossip-pfl peers-local`` (Linux): peer processes forked from one
interpreter that imported torch and loaded the compiled CPU loops once, instead of each its
own interpreter spending about 3 s of CPU on them (docs/p2p.md).

The launcher starts the server as it started a peer process (a ``subprocess`` with a clean
set of descriptors and the peers' environment), so a peer forked from it has what a peer
started on its own had: the environment, no descriptor of the launcher's caller, its own
``sys.stdout`` over its log, SIGINT as Python's default. Requests and replies are JSON lines
on the server's stdin and on a copy of its first stdout (the real one goes to its stderr, so
nothing printed while importing can garble a reply):

    launcher -> server   {"argv": ["peer", ...], "log": "RUN_DIR/logs/K.txt"}
    server -> launcher   {"pid": PID}                   (one a request, in order)
                         {"exited": PID, "code": CODE}  (Popen's returncode: -N for signal N)

The server ends when its stdin does (the launcher has finished or died); the peers it forked
then run on, as processes started by a launcher that dies do.
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


def serve() -> None:
    """The server's loop (``python -m gossip_pfl.peer_server``)."""
    replies = os.dup(1)
    os.dup2(2, 1)  # (what anything prints goes to the server's log, not into a reply)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the peers and the launcher
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (an ignored one would hide exit codes)
    preload()
    import gossip_pfl.cli  # noqa: F401  (the peers' command, imported once too)

    gc.freeze()  # (the forked peers share these pages and never collect them)
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return  # the launcher is gone; the peers run on
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    os.close(replies)
                    _peer(request["argv"], request["log"])  # never returns
                children.add(pid)
                _reply(replies, {"pid": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _reply(replies, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _reply(fd: int, message: dict) -> None:
    try:
        os.write(fd, (json.dumps(message) + "\n").encode())
    except BrokenPipeError:  # the launcher is gone
        sys.exit(0)


def _peer(argv: list[str], log: str) -> None:
    """A forked peer: ``gossip-pfl ARGV`` with its output appended to ``log``; it leaves with
    the command's exit code and never returns into the server."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        for fd, to in ((null, 0), (out, 1), (out, 2)):
            os.dup2(fd, to)
        os.close(null)
        os.close(out)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own, as at a start)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        from gossip_pfl.cli import main

        result = main(argv)
        code = result if isinstance(result, int) else int(result is not None)
    except SystemExit as stop:  # (argparse's exit; sys.exit)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class PeerServer:
    """The launcher's side: ``start`` forks a peer and returns a handle with the part of
    ``subprocess.Popen`` the launcher uses (``pid``, ``poll``, ``wait``, ``kill``,
    ``returncode``); ``close`` ends the server (the peers run on)."""

    def __init__(self, env: dict[str, str], log: str) -> None:
        import subprocess

        with open(log, "a") as err:  # (the server holds its own copy)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gossip_pfl.peer_server"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
            )  # fmt: skip
        self.log, self.codes, self._pending = log, {}, b""

    def start(self, argv: list[str], log: str) -> _Served:
        try:
            self.proc.stdin.write((json.dumps({"argv": argv, "log": log}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:  # (the first waits for the server's imports)
            for message in self._read(timeout=1.0):
                if "pid" in message:
                    return _Served(self, message["pid"])
        raise GossipError(f"peers-local: its process server started no process in "
                          f"{START_TIMEOUT_S} s (its log: {self.log})")  # fmt: skip

    def poll(self) -> None:
        """Take in the exits reported so far."""
        list(self._read(timeout=0.0))

    def _read(self, timeout: float):
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not readable:
            return
        chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not chunk:
            raise self._died()
        self._pending += chunk
        while b"\n" in self._pending:
            line, self._pending = self._pending.split(b"\n", 1)
            message = json.loads(line)
            if "exited" in message:
                self.codes[message["exited"]] = message["code"]
            yield message

    def _died(self) -> GossipError:
        code = self.proc.wait()
        with open(self.log) as log:
            lines = log.read().strip().splitlines()
        return GossipError(f"peers-local: its process server exited with code {code}"
                           + (f": {lines[-1]}" if lines else ""))  # fmt: skip

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except Exception:  # (a server that does not end: it is of no use now)
            self.proc.kill()
            self.proc.wait()


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
            select.select([], [], [], 0.05)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


if __name__ == "__main__":
    serve()
