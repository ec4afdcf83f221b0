"""A run's folder and its process: checks before a run, writes that fail as one-line errors,
the progress display, and stopping on SIGTERM / SIGINT after a round."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import uuid
from pathlib import Path

from gossip_pfl.errors import GossipError

#: the checkpoint's name in a run folder (gossip_pfl.checkpoint writes it; named here, where
#: the folder is checked, so the check needs no torch)
CHECKPOINT_FILE = "checkpoint.pt"
#: a peer process's resumes at a later round than its checkpoint's, a row each (merge reports)
REJOINS = "rejoins.jsonl"
#: a peer process's older checkpoints, ROUND.pt: its last ones at multiples of
#: ``checkpoint_every``, so that processes stopped at different rounds can resume at a common one
KEPT = "kept"


class Progress:
    """A tqdm bar on rank 0 when stdout is a terminal; plain log lines at each evaluation
    otherwise (CI, files); nothing with --quiet (a no-op ``log``)."""

    def __init__(self, total: int, start: int, enabled: bool, log):
        import sys

        self.log, self.enabled = log, enabled
        self.bar = None
        if enabled and sys.stdout.isatty() and log is print:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="round", dynamic_ncols=True)

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def report(self, t: int, fields: dict[str, str]) -> None:
        """Show round ``t``'s headline figures (the workload's ``progress_fields``)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
        else:
            self.log(f"round {t + 1}  " + "  ".join(f"{k} {v}" for k, v in fields.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RunStopped(Exception):
    """A run stopped by SIGTERM or SIGINT after finishing a round and writing its checkpoint."""

    def __init__(self, signum: int, rounds_done: int, out: Path):
        super().__init__(signum, rounds_done, out)
        self.signal = signal.Signals(signum).name if signum in iter(signal.Signals) else signum
        self.rounds_done = rounds_done
        #: how to continue (a peer process of a peer-to-peer run says its own command)
        self.resume = f"gossip-pfl run --resume {out}"
        self.code = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM

    def __str__(self) -> str:
        return (f"stopped by {self.signal} after round {self.rounds_done}; checkpoint saved; "
                f"continue with: {self.resume}")  # fmt: skip


class StopSignals:
    """While a run is in its loop, SIGTERM (what SLURM and Kubernetes send) and SIGINT
    (Ctrl-C) ask it to stop after the current round, with a checkpoint; a second SIGINT stops
    it at once. Only in the main thread (signal handlers live there); elsewhere a no-op."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received = 0
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


class SigtermAsInterrupt:
    """While in the block, SIGTERM raises KeyboardInterrupt as a Ctrl-C would, and
    ``received`` says it came (outside a run's loop, where its default action ended the
    process without a word). Only in the main thread; elsewhere a no-op."""

    def __enter__(self) -> SigtermAsInterrupt:
        self.received, self._old = False, None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = True
        raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def kept_rounds(folder: Path) -> list[int]:
    """The rounds of a peer process's FOLDER/kept/ROUND.pt, ascending."""
    kept = Path(folder) / KEPT
    names = (p.stem for p in kept.glob("*.pt")) if kept.is_dir() else ()
    return sorted(int(n) for n in names if n.isdigit())


def write(path: Path, action) -> None:
    """Run a write of the run's output, turning file-system failures (a full disk, no
    permission, a file where a folder should be) into a one-line error."""
    try:
        action(path)
    except OSError as err:
        raise GossipError(f"out: could not write {path} ({err.strerror or err})") from None


def replace_with(path: Path, save) -> None:
    """``save(tmp)`` writes the new file beside ``path``, then it replaces ``path`` at once: a
    run killed while writing leaves the old file or the new one, never a cut one (a cut
    summary.json blocked the run's resume, merge and plot; a cut config.yaml its resume)."""
    replace_all({path: save})


def replace_all(saves: dict) -> None:
    """:func:`replace_with` for files that go together (``{path: save}``): every new file is
    written beside its old one first, and only then are they all put in place, so a failure
    (a full disk) leaves the old set whole. The temporary name keeps the suffix (numpy and
    matplotlib choose a format by it) and is the writer's own (two writers of one file, a
    plot beside a finishing run, moved each other's away). An OSError names the file it was
    writing."""
    own = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tmps = {Path(path): Path(path).with_name(f".{Path(path).stem}.{own}.tmp{Path(path).suffix}")
            for path in saves}  # fmt: skip
    try:
        for (path, save), tmp in zip(saves.items(), tmps.values()):
            try:
                save(tmp)
            except OSError as err:
                err.filename = err.filename or str(path)
                raise
        for path, tmp in tmps.items():
            os.replace(tmp, path)
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    """``path`` replaced by ``text`` (:func:`replace_with`), failures in one line."""
    write(path, lambda p: replace_with(p, lambda tmp: tmp.write_text(text)))


def rewrite_rows(path: Path, rows: list[dict]) -> None:
    """``path`` replaced by ``rows`` (:func:`replace_with`), failures in one line."""
    write(path, lambda p: replace_with(p, lambda tmp: write_rows(tmp, rows)))


def is_peer_run(folder: Path) -> bool:
    """A ``peers-local`` run's folder: its peers file and each process's own folder."""
    return (folder / "peers.yaml").is_file() and (folder / "peers").is_dir()


def check_out_dir(out: Path, resume: bool, overwrite: bool) -> None:
    """Before any data is built: the output folder is not a file, can be created or written,
    and holds no other run unless resuming it or told to overwrite it."""
    if out.exists() and not out.is_dir():
        raise GossipError(f"out: {out} is a file, not a folder; choose another --out")
    ancestor = out
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise GossipError(f"out: {ancestor} is a file, so {out} cannot be a folder; "
                          "choose another --out")  # fmt: skip
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise GossipError(
            f"out: cannot write into {ancestor} (permission denied); choose another --out"
        )
    if out.is_dir() and not resume:
        # (a run stopped before its first row left an empty metrics.jsonl and nothing to
        # resume: "holds another run, continue it with --resume" then "no checkpoint there")
        found = [
            f
            for f in ("metrics.jsonl", "summary.json", CHECKPOINT_FILE)
            if (out / f).exists() and (f != "metrics.jsonl" or (out / f).stat().st_size)
        ]
        if found and not overwrite:
            go_on = f", continue it with --resume {out}," if CHECKPOINT_FILE in found else ""
            if is_peer_run(out):
                go_on = f", continue it with gossip-pfl peers-local --resume {out},"
            raise GossipError(
                f"out: {out} holds another run ({', '.join(found)}); choose another --out"
                f"{go_on} or replace it with --overwrite"
            )


#: the file a running run holds locked in its folder (RunLock; removed when it ends)
LOCK_FILE = ".lock"


class RunLock:
    """This process's hold on a run folder while it runs: a second run in the same folder (a
    resume while the run still goes, a SLURM requeue) is refused with one line, where both
    wrote the same files (rows twice and out of order, exit 0). An advisory ``flock`` on
    RUN_DIR/.lock opened for writing (so that NFS makes it a lock on the server, seen from
    every node; a lock on the folder itself stays on one node), released when the run ends or
    its process dies (never stale); the file goes at the end (one a killed run leaves is
    taken over). Where the OS or file system has no such locks, nothing is held."""

    def __init__(self, out: Path):
        self.out, self.file = Path(out), None

    def acquire(self) -> RunLock:
        if self.file is not None:
            return self
        try:
            import fcntl
        except ImportError:  # (Windows: no flock)
            return self
        path = self.out / LOCK_FILE
        for _ in range(8):  # (the file a run just removed: open the one there now)
            try:
                fh = open(path, "a+")  # noqa: SIM115 - held while the run goes
            except OSError:
                return self  # (the run's own writes say what is wrong with the folder)
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.seek(0)
                pid = fh.read().strip()
                fh.close()
                who = f" (process {pid})" if pid.isdigit() else ""
                raise GossipError(
                    f"out: {self.out} is in use by another run{who}; wait for it to end or stop "
                    "it, or choose another --out"
                ) from None
            except OSError:  # no locks on this file system
                fh.close()
                return self
            if _same_file(fh, path):
                break
            fh.close()  # opened before its run removed it, locked after: not the folder's
        else:
            return self
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        self.file = fh
        return self

    def release(self) -> None:
        if self.file is not None:
            # removed while still held: one that opens it after this makes a new file, and
            # this run is over by then
            try:
                (self.out / LOCK_FILE).unlink(missing_ok=True)
            except OSError:
                pass
            self.file.close()  # (closing releases the lock)
            self.file = None


def check_processes_stopped(run_dir: Path) -> None:
    """No process of the peer-to-peer run in ``run_dir`` still holds its folder (one whose
    launcher was stopped alone goes on): deleting RUN_DIR/peers/ would go under it."""
    peers = run_dir / "peers"
    for folder in sorted(peers.iterdir()) if peers.is_dir() else ():
        if folder.is_dir():
            RunLock(folder).acquire().release()  # (raises while one holds it)


def _same_file(fh, path: Path) -> bool:
    """Whether the open file ``fh`` is the one at ``path`` now."""
    try:
        mine, there = os.fstat(fh.fileno()), os.stat(path)
    except OSError:
        return False
    return (mine.st_ino, mine.st_dev) == (there.st_ino, there.st_dev)


#: every figure a run writes into RUN_DIR/plots (plots.py, expfam/run.py)
FIGURES = ("accuracy_vs_round", "loss_vs_round", "consensus_vs_round", "accuracy_vs_bytes",
           "client_accuracy_hist", "mixture_weights_vs_round", "expfam")  # fmt: skip


def clear_outputs(out: Path, keep_checkpoint: bool = False) -> None:
    """A fresh run's start in a folder that may hold another run (``--overwrite``): the files
    that run wrote and this one may not write again go (its summary, its checkpoint, which a
    stop must not leave to be resumed, and its figures: an EM run kept a FedAvg run's five; a
    peer process starts its links.jsonl anew itself).
    Only now, once the run is built: an --overwrite refused for a bad schedule kept the old
    run whole. The metrics and config are rewritten at once; nothing else is touched. A
    resume that goes on keeps the checkpoint (``keep_checkpoint``): the summary and figures
    of a finished run taken further are of fewer rounds."""
    checkpoint = () if keep_checkpoint else (out / CHECKPOINT_FILE, out / REJOINS)
    kept = () if keep_checkpoint else (out / KEPT / f"{r}.pt" for r in kept_rounds(out))
    for path in (out / "summary.json", *checkpoint, *kept,
                 *(out / "plots" / f"{name}.png" for name in FIGURES)):  # fmt: skip
        write(path, lambda p: p.unlink(missing_ok=True))
    if not keep_checkpoint and is_peer_run(out):  # a run written over a peers-local run: its
        # processes' folders go (merge put their old results over the new run's, and the new
        # run's --resume was refused as a peer-to-peer run's), unless one still runs
        check_processes_stopped(out)
        for folder in (out / "peers", out / "logs"):
            write(folder, lambda p: shutil.rmtree(p, ignore_errors=True))
        write(out / "peers.yaml", lambda p: p.unlink(missing_ok=True))


def append_row(path: Path, row: dict) -> None:
    write_rows(path, [row], append=True)


def write_rows(path: Path, rows: list[dict], append: bool = False) -> None:
    with open(path, "a" if append else "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def is_number(value: object) -> bool:
    """A JSON number of a run's files: an int or a float, not a bool (JSON's true is an int
    to Python)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_rows(path: Path) -> list[dict]:
    """The JSON objects of a ``.jsonl`` file, one per line ([] when there is no file). A last
    line cut short (no newline: a row being written, or a process killed while writing it)
    is left out; any other line that is not a JSON object is a one-line error naming it."""
    if path.exists() and not path.is_file():  # a folder read as no rows hid a process
        raise GossipError(f"cannot read {path}: not a file")
    try:
        text = path.read_text() if path.is_file() else ""
    except (OSError, UnicodeDecodeError) as err:
        raise GossipError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    lines = text.split("\n")  # the last piece is "" when the file ends with a newline
    rows = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if lineno == len(lines):  # cut short
                break
            raise GossipError(f"{path}, line {lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise GossipError(f"{path}, line {lineno}: expected a JSON object")
        rows.append(row)
    return rows
