"""The Trainer of one peer-to-peer process (``gossip-pfl peer``; docs/p2p.md): the same rounds
as a rank's; only what needs every process (the run's metrics, the start, a restart) differs."""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import torch

from gossip_pfl import checkpoint, rundir
from gossip_pfl.config import RunConfig
from gossip_pfl.errors import KILLED_EXIT
from gossip_pfl.metrics import score_entries
from gossip_pfl.train import Trainer, config_digest

#: coordinates of the mixed rows sampled to measure the drift of the average (all if fewer)
PROBES = 64
#: the fewest and the most checkpoints at multiples of ``checkpoint_every`` a process keeps
#: (RUN_DIR/kept/): enough to span as many rounds as there are processes (PeerTrainer.keep);
#: the most is also the most rounds a hello names (its header holds at most 255)
KEEP, KEEP_MOST = 2, 16


class PeerTrainer(Trainer):
    """The Trainer in a peer-to-peer world: the same rounds; only what needs every process
    (the run's metrics, the start, a restart) is done differently."""

    def __init__(self, cfg: RunConfig, dataset, comm, log=print):
        super().__init__(cfg, dataset, comm, log)
        self.resumed = False
        self.wait_round = 0  # a restart waits for the running peers to reach this round
        width = self.nodes[0].numel() if self.bundle.plain else self.bundle.width
        g = torch.Generator().manual_seed(cfg.seed)  # the same coordinates in every process
        probe = torch.randperm(width, generator=g)[:PROBES].sort().values
        self.probe = probe.to(self.device)
        self.links = None  # opened by run
        self.exchanger.on_mix = self._log_mix
        if hasattr(comm, "config_digest"):  # checked in the hellos: the same config everywhere
            comm.config_digest = config_digest(cfg, checkpoint.PEER_PROCESS)[0]

    def run(self, resume: bool = False) -> dict:
        # a fresh run starts the file anew (appended to, an --overwrite kept the old run's
        # exchanges: merge counted both); only now, once the run is built
        try:
            if not resume:  # a fresh start needs every process
                self.check_fresh()  # (before it waits for them)
                self.hold_folder()  # (before its files are opened)
                self.links = open(Path(self.cfg.out) / "links.jsonl", "w", buffering=1)  # noqa: SIM115
                self.comm.join(0, need_all=True)
            return super().run(resume)  # (a resume opens the file in restore)
        finally:
            if self.links is not None:
                self.links.close()
            self.release_folder()

    def checkpoint(self, out: Path, rounds_done: int, rows: list) -> None:
        """RUN_DIR/checkpoint.pt, and at multiples of ``checkpoint_every`` a link to it in
        RUN_DIR/kept/ (the last :meth:`keep` of them; a hard link costs no space while it is
        the latest): what lets processes stopped at different rounds resume at a common one."""
        super().checkpoint(out, rounds_done, rows)
        every = self.cfg.checkpoint_every
        if not every or rounds_done % every:
            return
        kept = Path(out) / rundir.KEPT
        rundir.write(kept, lambda p: p.mkdir(exist_ok=True))
        rundir.write(kept / f"{rounds_done}.pt", partial(_link, Path(out) / checkpoint.FILE))
        for r in rundir.kept_rounds(out)[: -self.keep()]:
            rundir.write(kept / f"{r}.pt", lambda p: p.unlink(missing_ok=True))

    def keep(self) -> int:
        """How many checkpoints at multiples of ``checkpoint_every`` this process keeps: at
        least KEEP (at most KEEP_MOST: each older one is a full copy), and enough to span as
        many rounds as there are processes. Where every link
        lands, no process gets more rounds ahead of another than the process graph's
        diameter (under the process count), so processes stopped at any moment hold a
        round in common; a time-varying graph that leaves a process without neighbours may
        let them drift further (4 processes stopped 0.2 s apart at rounds 404 to 408)."""
        every = self.cfg.checkpoint_every
        return min(KEEP_MOST, max(KEEP, -(-self.comm.world_size // every) + 1))

    def restore(self, out: Path) -> tuple[int, list]:
        """The process's own latest checkpoint (none: its initial state), then the round to
        go on at: the latest that every process resuming with it holds (an older checkpoint
        of its own, if they stopped at different rounds), or the round the running peers are
        at (a restart into a running run; the rounds between are skipped)."""
        first, rows = 0, []
        name = self._own_checkpoint(Path(out))
        if name is not None:
            first, rows = super().restore(out, name)
        self.resumed = True
        # appended: the exchanges a killed run made past its checkpoint happened for its
        # neighbours (merge keeps a process's last row of an exchange logged twice)
        self.links = open(Path(out) / "links.jsonl", "a", buffering=1)  # noqa: SIM115
        if first == self.cfg.rounds:  # finished, stopped before its summary: nobody to join
            return first, rows
        kept = [r for r in rundir.kept_rounds(out) if r < first][-(KEEP_MOST - 1) :]  # (the latest)
        holds = [r for r in kept if self._intact(Path(out), r)] + [first]
        start = self.comm.join(first, need_all=False, wait_round=self.wait_round, holds=holds)
        if start < first:  # the others stopped earlier: go back to where they all can go on
            # said under --quiet too (peers-local's processes): the launcher passes it on
            print(f"process {self.comm.rank}: resumes at round {start}, where every process "
                  f"can go on (its own checkpoint: {first})", flush=True)  # fmt: skip
            return self._roll_back(Path(out), start)
        if start > first:  # its peers skip the rounds between: merge says so
            print(
                f"process {self.comm.rank}: rejoins at round {start} (checkpoint: {first})",
                flush=True,
            )
            entry = {"checkpoint": first, "start": start}
            rundir.write(Path(out) / rundir.REJOINS, partial(rundir.append_row, row=entry))
        return start, rows

    def _own_checkpoint(self, out: Path) -> str | None:
        """The checkpoint to resume from: checkpoint.pt, or where it is damaged or gone, the
        latest whole kept one, put in its place (a lost one restarted the process from round 0,
        its peers skipping the rounds between; a damaged one failed that process alone, the
        others running on without it); None: none at all."""
        there = (out / checkpoint.FILE).is_file()
        if not rundir.kept_rounds(out):  # nothing to fall back on: read once, by the restore
            return checkpoint.FILE if there else None  # (which names the damage)
        why = checkpoint.verify(out) if there else "none there"
        if why is None:
            return checkpoint.FILE
        kept = [r for r in rundir.kept_rounds(out) if self._intact(out, r)]
        if not kept:
            return checkpoint.FILE if there else None  # (its own message, as before)
        warnings.warn(f"{out / checkpoint.FILE}: {why if why == 'none there' else 'damaged'}; "
                      f"resuming from kept/{kept[-1]}.pt", stacklevel=2)  # fmt: skip
        rundir.write(out / checkpoint.FILE, partial(_link, out / rundir.KEPT / f"{kept[-1]}.pt"))
        return checkpoint.FILE

    def _intact(self, out: Path, r: int) -> bool:
        """Whether kept/R.pt is whole (read once); a damaged one is left out of the rounds
        this process names (it was agreed on, then replaced the process's good checkpoint),
        with a warning."""
        seen = self.__dict__.setdefault("_kept_intact", {})
        if r not in seen:
            why = checkpoint.verify(out, f"{rundir.KEPT}/{r}.pt")
            if why is not None:
                warnings.warn(f"{why}; left out of the rounds this process can resume from",
                              stacklevel=2)  # fmt: skip
            seen[r] = why is None
        return seen[r]

    def _roll_back(self, out: Path, start: int) -> tuple[int, list]:
        """Load the kept checkpoint of round ``start``, then make it the process's checkpoint
        and forget the later ones (a later resume must not name rounds this run no longer
        went through): nothing is replaced before it has loaded."""
        kept = out / rundir.KEPT
        first, rows = super().restore(out, f"{rundir.KEPT}/{start}.pt")
        rundir.write(out / checkpoint.FILE, partial(_link, kept / f"{start}.pt"))
        for r in rundir.kept_rounds(out):
            if r > start:
                rundir.write(kept / f"{r}.pt", lambda p: p.unlink(missing_ok=True))
        rejoins = rundir.read_rows(out / rundir.REJOINS)  # (of rounds now trained again)
        if any(e.get("start", 0) > start for e in rejoins):
            kept_rows = [e for e in rejoins if e.get("start", 0) <= start]
            rundir.rewrite_rows(out / rundir.REJOINS, kept_rows)
        return first, rows

    def sample(self, t: int) -> np.ndarray:
        for kill in self.cfg.runtime.faults.kill:
            # (a resumed run that went back before its kill crashes there as the uninterrupted
            # run did, its restart on standby; the restart itself never: it rejoins past it)
            if kill["id"] == self.comm.rank and kill["round"] == t and not self.wait_round:
                print(f"gossip-pfl: process {self.comm.rank} killed at round {t} "
                      "(runtime.faults.kill)", file=sys.stderr, flush=True)  # fmt: skip
                self.links.flush()
                os._exit(KILLED_EXIT)  # a crash: no checkpoint, no goodbye
        return super().sample(t)

    def _log_mix(self, state: torch.Tensor, out: torch.Tensor, lost: set) -> None:
        # the peers' rows only: an aggregating hub (rows past them) is no peer, and its
        # model appearing in the up phase is no drift of the peers' average
        L = len(self.peers)
        before = state[:L, self.probe].double().sum(0)
        change = out[:L, self.probe].double().sum(0) - before
        entry = {**self.comm.last_links, "before": before.tolist(), "change": change.tolist()}
        self.links.write(json.dumps(entry) + "\n")

    def metrics_row(self, t: int) -> dict:
        """This process's peers' values, one list entry per peer (``merge`` combines them);
        the local means keep the progress line readable. No consensus distance: it needs
        every peer's parameters (``merge`` works it out from the checkpoints)."""
        mine = self.peers
        tr_loss, tr_acc, tr_n = (v[mine] for v in self.evaluate(self.train))
        te_loss, te_acc, te_n = (v[mine] for v in self.evaluate(self.test))
        local = score_entries((tr_loss, tr_acc, tr_n), (te_loss, te_acc, te_n))
        row = {
            "round": t + 1,
            "peers": mine.tolist(),
            "train_loss": local["train_loss"],
            "test_accuracy": local["test_accuracy"],  # peers without test samples left out
            "peer_train_loss": tr_loss.tolist(),
            "peer_train_accuracy": tr_acc.tolist(),
            "peer_train_count": tr_n.tolist(),
            "peer_test_loss": te_loss.tolist(),
            "peer_test_accuracy": te_acc.tolist(),
            "peer_test_count": te_n.tolist(),
            **self.traffic(),
            "seconds_local": self.times["local"],
            "seconds_exchange": self.times["exchange"],
            "links": dict(self.comm.stats),
        }
        if self.M > 1 and "pi" in self.personal:
            row["peer_pi"] = self.personal["pi"].double().cpu().tolist()
        return row

    def summary(self, last: dict, wall: float) -> dict:
        return {"algorithm": self.cfg.algorithm.name, "process": self.comm.rank,
                "peers": last["peers"], "rounds": self.cfg.rounds, "round": last["round"],
                "test_accuracy": last["test_accuracy"], "wall_seconds": wall,
                "links": dict(self.comm.stats)}  # fmt: skip


def _link(source: Path, path: Path) -> None:
    """``path`` made, at once, the same file as ``source`` (a hard link; a copy where the file
    system has none)."""

    def link(tmp: Path) -> None:
        tmp.unlink(missing_ok=True)  # (one a kill left: os.link would fall back to a copy)
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)

    rundir.replace_with(path, link)
