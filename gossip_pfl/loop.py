"""The round loop every workload shares, as a screen of named steps:

    for t in rounds:  sample(t) -> local_work(t) -> communicate(t) -> log -> checkpoint

A workload (the model trainer in gossip_pfl.train, EM in statistics space in
gossip_pfl.expfam, ...) subclasses :class:`RoundLoop` and provides the steps; the loop owns
what every run needs the same way: the run folder, metrics rows, progress, signals (finish the
round, checkpoint, stop), checkpoints every ``checkpoint_every`` rounds, and resuming.

A workload has ``cfg``, ``comm``, ``device``, ``log``, ``times`` (seconds by phase, which the
loop adds to; a workload keeps it in its checkpoints) and ``round``, and
implements ``sample``, ``local_work``, ``communicate``, ``metrics_row``, ``checkpoint``,
``restore``, ``summary`` and ``describe`` (and ``settle`` where a round leaves work queued).
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from gossip_pfl import rundir
from gossip_pfl.config import to_dict
from gossip_pfl.errors import GossipError
from topologies.spec import dump_yaml


def _readable_summary(path: Path) -> bool:
    """``path`` holds a run's summary (a JSON object): a run stopped while writing it left
    a cut file or none."""
    try:
        return isinstance(json.loads(path.read_text()), dict)
    except (OSError, ValueError):
        return False


class RoundLoop:
    """The loop; subclasses provide the named steps (see the module docstring)."""

    #: the summary keys ``gossip-pfl run`` prints (those present)
    summary_keys: tuple[str, ...] = ("rounds", "wall_seconds")
    #: a format for a printed key whose floats ``.4f`` would round away (default ``.4f``)
    summary_formats: dict[str, str] = {}

    @staticmethod
    def comm_device(rt) -> str:
        """The ``runtime.device`` this workload's transport is made for (``RuntimeConfig``
        ``rt``): the config's own."""
        return rt.device

    @staticmethod
    def write_plots(run_dir: Path) -> list[Path]:
        """Figures of a finished run in ``run_dir/plots`` (the CLI calls it on rank 0): the
        model runs' (accuracy, loss, consensus, bytes, clients; PeFLL's rows hold them too)."""
        from gossip_pfl.plots import load_run, write_plots

        return write_plots([load_run(run_dir)], Path(run_dir) / "plots")

    def sample(self, t: int) -> np.ndarray:
        """This round's participants (n,) bool, the same on every rank."""
        raise NotImplementedError

    def local_work(self, t: int, active: np.ndarray | None = None) -> None:
        raise NotImplementedError

    def communicate(self, t: int, active: np.ndarray | None = None) -> None:
        raise NotImplementedError

    def metrics_row(self, t: int) -> dict:
        raise NotImplementedError

    def checkpoint(self, out: Path, rounds_done: int, rows: list) -> None:
        raise NotImplementedError

    def restore(self, out: Path) -> tuple[int, list]:
        raise NotImplementedError

    def summary(self, last: dict, wall: float) -> dict:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def settle(self) -> None:
        """Before a log or a checkpoint: read back what a round left queued on the device (the
        trainer's finite check), so that a bad round is neither logged nor saved."""

    def keys_before(self) -> dict:
        """For config keys added after a checkpoint was made, the value it ran under (dotted
        key -> value); a key this workload does not read ran under any value."""
        return {"algorithm.loss_divisor": self.cfg.algorithm.loss_divisor}

    def check_resumable(self, state: dict, where: str) -> None:
        """A loaded checkpoint has rounds left under this config (after :meth:`check_config`
        and the structure check), and the timings every run keeps."""
        from gossip_pfl import checkpoint

        checkpoint.check_like(state.get("times"), {"local": 0.0, "exchange": 0.0}, "times", where)
        done = state["rounds_done"]
        if done > self.cfg.rounds:
            raise GossipError(f"{where}: the checkpoint is of round {done}, past rounds = "
                              f"{self.cfg.rounds} (set rounds above {done} to go on)")  # fmt: skip
        if done == self.cfg.rounds:
            if not _readable_summary(Path(self.cfg.out) / "summary.json"):
                # stopped between its last checkpoint and its summary: the resume writes it
                # (and the command line the figures) from the checkpoint, training nothing
                self.log(f"{where}: the run finished its {done} rounds; writing its summary")
                return
            out = self.cfg.out
            raise GossipError(
                f"{where}: the run already finished its {self.cfg.rounds} rounds "
                "(raise 'rounds' with --set rounds=N to go on; its figures again: "
                f"gossip-pfl plot {out} --out {Path(out) / 'plots'})"
            )

    def check_config(self, state: object, where: str) -> None:
        """The checkpoint was made under this config (how it runs aside, but for the runtime
        keys that change what is computed: checkpoint.RUNTIME_SHARED): the keys that differ
        are named, before the shapes they change (a changed data.n_clients) are checked (a
        state of another form is left to the structure check)."""
        from gossip_pfl.checkpoint import config_differences, saved_value

        if not (isinstance(state, dict) and isinstance(state.get("config", {}), dict)):
            return
        saved, before = state.get("config", {}), {**_shared_runtime_before(), **self.keys_before()}
        current = to_dict(self.cfg)
        diffs = config_differences(saved, current, before)  # (runtime skipped)
        diffs += config_differences(_shared_runtime(saved), _shared_runtime(current), before,
                                    skip=())  # fmt: skip
        if diffs:
            was = ", ".join(f"{k}={saved_value(saved, k, before)}" for k in diffs)
            raise GossipError(
                f"{where}: the checkpoint was made with a different config "
                f"(keys differ: {', '.join(diffs)}; the checkpoint's: {was})"
            )
        decay, rounds = list(self.cfg.algorithm.lr_decay), saved.get("rounds")
        if decay and isinstance(rounds, int) and rounds != self.cfg.rounds:
            # fractions of the run: a longer run moves its decay points, rounds done included
            # (4 rounds resumed to 6 took the step back up 10x at round 5, silently)
            at = lambda r: ", ".join(f"{f * r:g}" for f in decay)  # noqa: E731
            raise GossipError(
                f"{where}: algorithm.lr_decay {decay} is in fractions of the run, so resuming "
                f"its {rounds} rounds as rounds={self.cfg.rounds} would move the decay from "
                f"rounds {at(rounds)} to {at(self.cfg.rounds)}: resume with rounds={rounds}, "
                f"or start a run of {self.cfg.rounds} rounds"
            )

    def load_checkpoint(self, out: Path, name: str = rundir.CHECKPOINT_FILE) -> dict:
        """RUN_DIR/checkpoint.pt (digest checked), the same on every rank: compared before
        any rank's own checks of it (a rank that cannot read its own tells the others)."""
        from gossip_pfl import checkpoint

        where = f"--resume {out}"
        try:
            state = checkpoint.load(out, name)
        except GossipError:
            check_same_checkpoint(self.comm, None, where)
            raise
        check_same_checkpoint(self.comm, state, where)
        return state

    def data_state(self) -> dict | None:
        """What a checkpoint keeps of the workload's ``dataset`` (a FederatedDataset; None
        without one): its name and digest, for :meth:`check_data`."""
        data = getattr(self, "dataset", None)
        if data is None:
            return None
        if "_data_digest" not in self.__dict__:
            self._data_digest = data.digest()
        return {"name": data.name, "digest": self._data_digest}

    def check_data(self, state: object, where: str) -> None:
        """The checkpoint was trained on this run's data (the same config over other data: a
        dataset of one's own changed, a run of one resumed from the command line, data files
        replaced). Checkpoints from before the check carry no digest and pass."""
        saved = state.get("data") if isinstance(state, dict) else None
        mine = self.data_state()
        if isinstance(saved, dict) and mine and saved.get("digest") != mine["digest"]:
            raise GossipError(
                f"{where}: the checkpoint was trained on other data than this run's "
                f"'{mine['name']}' (the checkpoint's: '{saved.get('name')}'; client sizes, "
                "labels or samples differ): resume with the data it was made with"
            )

    def progress_fields(self, row: dict) -> dict[str, str]:
        """The progress line's figures from a metrics row (a workload may show others)."""
        # named as in metrics.jsonl ("loss" and "acc" left a reader to guess which split)
        shown = {"train_loss": "train_loss", "test_acc": "test_accuracy"}  # those the row has
        fields = {k: f"{row[key]:.4f}" for k, key in shown.items() if key in row}
        if row.get("consensus_distance"):  # a peer process has none (merge works it out)
            fields["consensus_max"] = f"{max(row['consensus_distance']):.3g}"  # (over M)
        return fields

    # ---- the loop -------------------------------------------------------------------------
    def hold_folder(self, create: bool = True) -> None:
        """Hold the run folder (:class:`rundir.RunLock`) where this process writes it (rank 0,
        or every peer process its own): a second run there is refused until this one ends.
        ``create``: make the folder first (a fresh run; a resume's is there, or it fails on its
        own)."""
        if self.comm.rank == 0 or not self.comm.collectives:
            out = Path(self.cfg.out)
            if create:
                rundir.write(out, lambda p: p.mkdir(parents=True, exist_ok=True))
            elif not out.is_dir():
                return
            if "folder_lock" not in self.__dict__:
                self.folder_lock = rundir.RunLock(out)
            self.folder_lock.acquire()

    def release_folder(self) -> None:
        lock = self.__dict__.get("folder_lock")
        if lock is not None:
            lock.release()

    def run(self, resume: bool = False) -> dict:
        self.hold_folder(create=not resume)
        try:
            return self._run(resume)
        finally:
            self.release_folder()

    def _run(self, resume: bool) -> dict:
        cfg = self.cfg
        out = Path(cfg.out)
        # peer to peer (no collectives): every process writes its own run folder
        is_main = self.comm.rank == 0 or not self.comm.collectives
        first, rows = 0, []
        self.times = {"local": 0.0, "exchange": 0.0, **getattr(self, "times", {})}
        if resume:
            first, rows = self.restore(out)
        if is_main:
            rundir.write(out, lambda p: p.mkdir(parents=True, exist_ok=True))
            if not resume:
                rundir.clear_outputs(out)
            elif first < cfg.rounds:  # a finished run taken further: its summary and figures
                rundir.clear_outputs(out, keep_checkpoint=True)  # are of fewer rounds
            config_text = dump_yaml(to_dict(cfg))
            rundir.write_text(out / "config.yaml", config_text)
            # rows past the checkpoint are recomputed: keep the file consistent with the state
            rundir.rewrite_rows(out / "metrics.jsonl", rows)
            self.log(self.describe() + (f"; resumed after round {first}" if resume else ""))
        start = time.perf_counter() - self.times.get("wall", 0.0)
        clock = PhaseClock(self.device)
        progress = rundir.Progress(cfg.rounds, first, enabled=is_main, log=self.log)
        write_error = None
        with rundir.StopSignals() as signals:
            for t in range(first, cfg.rounds):
                self.round = t
                t0 = clock.mark()
                active = self.sample(t)  # who takes part
                self.local_work(t, active)  # client update: E-step, local steps, outbox
                t1 = clock.mark()
                self.communicate(t, active)  # deliver; the hub's or each peer's rule
                clock.add(self.times, t0, t1, clock.mark())
                last = t == cfg.rounds - 1
                if (t + 1) % cfg.eval.every == 0 or last:  # log
                    self.settle()
                    clock.settle(self.times)
                    row = self.metrics_row(t)
                    rows.append(row)
                    if is_main:
                        try:  # a failed write stops every rank after this round (_agreed)
                            rundir.write(out / "metrics.jsonl", partial(rundir.append_row, row=row))
                        except GossipError as err:
                            write_error = err
                    progress.report(t, self.progress_fields(row))
                progress.tick()
                # SIGTERM / SIGINT on any rank, or rank 0 could not write
                stop = self._agreed(signals.received, write_error)
                every = cfg.checkpoint_every
                if (every and (t + 1) % every == 0) or last or stop:  # checkpoint
                    self.settle()
                    clock.settle(self.times)
                    self.times["wall"] = time.perf_counter() - start
                    try:
                        self.checkpoint(out, t + 1, rows)
                    except GossipError as err:  # (rank 0's write: the others hear of it)
                        self._agreed(0, err)
                        raise
                    self._agreed(0)  # (every rank saves at the same rounds: one all-reduce)
                if stop and not last:
                    progress.close()
                    raise rundir.RunStopped(stop, t + 1, out)
        progress.close()
        summary = self.summary(rows[-1], time.perf_counter() - start)
        if is_main:
            rundir.write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary

    def _agreed(self, signum: int, write_error: GossipError | None = None) -> int:
        """The signal any rank received this round (0: none), the same on every rank, so that
        all of them write the checkpoint and stop after the same round; a write that failed on
        rank 0 ends every rank with a one-line error (not a lost peer on the others)."""
        if self.comm.world_size == 1 or not self.comm.collectives:
            if write_error is not None:
                raise write_error
            return signum
        got = [signum == s for s in rundir.StopSignals.SIGNALS] + [write_error is not None]
        flags = torch.tensor(got, dtype=torch.float64, device=self.device)
        got = self.comm.all_reduce_sum(flags).cpu().tolist()
        if got[-1]:
            raise write_error or GossipError(
                f"rank {self.comm.rank}: stopping: rank 0 could not write the run's output "
                "(its own message names the file)"
            )
        signals = rundir.StopSignals.SIGNALS  # SIGTERM wins over SIGINT
        return next((int(s) for s, n in zip(signals[::-1], got[:-1][::-1]) if n), 0)


def _shared_runtime(config: dict) -> dict:
    """The runtime keys of a resolved config that a resume may not change
    (checkpoint.RUNTIME_SHARED), those it has: {"runtime": {...}}."""
    from gossip_pfl.checkpoint import RUNTIME_SHARED

    runtime = config.get("runtime") if isinstance(config.get("runtime"), dict) else {}
    return {"runtime": {k: runtime[k] for k in RUNTIME_SHARED if k in runtime}}


def _shared_runtime_before() -> dict:
    """Those keys' defaults (dotted): what a checkpoint without one ran under."""
    from gossip_pfl.checkpoint import RUNTIME_SHARED
    from gossip_pfl.config import RuntimeConfig

    runtime = to_dict(RuntimeConfig())
    flat = {f"runtime.{key}": runtime[key] for key in RUNTIME_SHARED}
    for key in RUNTIME_SHARED:  # (and each sub-key: faults without a newer one)
        if isinstance(runtime[key], dict):
            flat |= {f"runtime.{key}.{k}": v for k, v in runtime[key].items()}
    return flat


def digest31(obj) -> int:
    """A positive 31-bit digest of a JSON-able object (keys sorted, anything else by str):
    it fits an int64 all-reduce and a zmq header."""
    import hashlib

    text = json.dumps(obj, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:4], "big") >> 1 | 1


def rows_unlike_rank0(comm, row: list[int]) -> tuple[torch.Tensor, int | None]:
    """Every rank's ``row`` of ints, (world, len(row)) on every rank (one all-reduce), and the
    first rank whose row differs from rank 0's (None: all alike)."""
    table = torch.zeros(comm.world_size, len(row), dtype=torch.int64, device=comm.device)
    table[comm.rank] = torch.tensor(row)
    table = comm.all_reduce_sum(table).cpu()
    other = next((k for k in range(comm.world_size) if not torch.equal(table[k], table[0])), None)
    return table, other


def check_same_checkpoint(comm, state: dict | None, where: str) -> None:
    """Every rank resumed from rank 0's checkpoint (``state``; None: this rank could not read
    its own, and raises its own error after this). Each reads its own RUN_DIR (a node's stale
    copy of the folder): ranks at rounds 20 and 10 trained together, one aborted inside Gloo,
    the other saved a mix that a later resume finished with exit 0. One all-reduce of each
    rank's (round, digest of its config and metrics rows: another run's differ); processes
    of a peer-to-peer run each resume their own."""
    if comm.world_size == 1 or not comm.collectives:
        return
    mine = [-2, 0]  # (could not read it)
    if state is not None:
        done = state.get("rounds_done") if isinstance(state, dict) else None
        kept = {k: state.get(k) for k in ("config", "rows")} if isinstance(state, dict) else {}
        mine = [done if isinstance(done, int) and done >= 0 else -1, digest31(kept)]
    table, other = rows_unlike_rank0(comm, mine)
    if state is None:
        return
    unread = [k for k in range(comm.world_size) if table[k, 0] == -2]
    if unread:
        raise GossipError(f"{where}: rank {unread[0]} could not read its checkpoint (its own "
                          "message says why)")  # fmt: skip
    if other is None:
        return
    (theirs, _), (first, _) = table[other].tolist(), table[0].tolist()
    what = (f"a checkpoint of round {theirs}, rank 0 one of round {first}" if theirs != first
            else f"another run's checkpoint of round {theirs} than rank 0")  # fmt: skip
    raise GossipError(f"{where}: rank {other} read {what}; every rank reads RUN_DIR/"
                      f"{rundir.CHECKPOINT_FILE}: give them all the same folder (a shared file "
                      "system, or copies of rank 0's)")  # fmt: skip


class PhaseClock:
    """The seconds of each round's local work and exchange, added to a workload's ``times``.

    On a CPU, ``time.perf_counter`` at each phase's end. A GPU runs its work after the host has
    queued it, so a host clock would charge it to whichever later phase waits for the device;
    synchronising at each phase's end instead kept the host from queueing the next round while
    the device worked. There each mark is an event recorded on the device's stream, and the
    times between them are added once the device has passed them: at once when it has, and
    when the loop logs or checkpoints (``settle``), where it waits for the device anyway."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.pending: list[tuple] = []  # (start, local done, exchange done) events

    def mark(self):
        if self.stream is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def add(self, times: dict, start, local, done) -> None:
        """One round's three marks."""
        if self.stream is None:
            times["local"] += local - start
            times["exchange"] += done - local
            return
        self.pending.append((start, local, done))
        while self.pending and self.pending[0][2].query():  # passed: no waiting
            self._add(times, *self.pending.pop(0))

    def settle(self, times: dict) -> None:
        """Add every round's times, waiting for the device to pass the last mark."""
        for marks in self.pending:
            marks[2].synchronize()
            self._add(times, *marks)
        self.pending.clear()

    @staticmethod
    def _add(times: dict, start, local, done) -> None:
        times["local"] += start.elapsed_time(local) / 1e3  # milliseconds
        times["exchange"] += local.elapsed_time(done) / 1e3
