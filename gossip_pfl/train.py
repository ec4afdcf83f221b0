"""One run: build the pieces from the config, then a thin round loop.

    for t in rounds:  local_work(t)  ->  mix(t)  ->  metrics(t)  ->  evaluate / checkpoint

The same code runs with every peer in one process or spread over torchrun ranks; every random
draw is seeded per peer (data order, initialization) or per round (schedule), never per rank.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from gossip_pfl import checkpoint
from gossip_pfl.algorithms import build_surrogate, get_algorithm
from gossip_pfl.algorithms.clustered import ClusteredRule
from gossip_pfl.algorithms.losses import num_outputs, sample_loss
from gossip_pfl.config import RunConfig, read_yaml, to_dict
from gossip_pfl.errors import GossipError
from gossip_pfl.models import build_model
from gossip_pfl.runtime.comm import init_comm, set_cuda_numerics
from gossip_pfl.runtime.data import PaddedSplit, round_batches
from gossip_pfl.runtime.exchange import Exchanger, weight_by_size
from gossip_pfl.runtime.placement import Placement
from gossip_pfl.runtime.solver import LocalSGD
from gossip_pfl.runtime.stack import BatchedForward, ParamLayout, init_components
from topologies import MixingSchedule


def build_schedule(cfg: RunConfig, n: int, sizes: np.ndarray, topology: str):
    """The run's mixing schedule over its ``n`` training peers (None for W = I)."""
    if topology in ("none", "clusters"):  # W = I, or Clustered FL's own server rule
        return None
    from topologies.spec import schedule_from_spec

    spec = cfg.schedule
    if topology == "server" and spec is None:
        spec = {"graph": "server"}
    if spec is None:
        raise GossipError(
            f"algorithm '{cfg.algorithm.name}' needs a schedule: set 'schedule' to a topology "
            "spec or a schedule YAML path (e.g. schedule: {graph: ring, weights: metropolis})"
        )
    base_dir = None
    if isinstance(spec, str):
        base_dir = Path(spec).parent
        if not Path(spec).is_file():
            raise GossipError(f"config key 'schedule': schedule file not found: {spec}")
        spec = read_yaml(spec)
    if not isinstance(spec, dict):
        raise GossipError(f"config key 'schedule' must be a mapping or a file path, got {spec!r}")
    spec = dict(spec)
    if spec.get("n", n) != n:
        raise GossipError(
            f"schedule has n = {spec['n']} but the run has {n} training peers; "
            "set schedule.n to match or drop it"
        )
    spec["n"] = n
    spec.setdefault("seed", cfg.seed)
    if spec.get("graph") == "server":  # the hub averages with weights n_t / n
        args = dict(spec.get("graph_args") or {})
        args.setdefault("sizes", [int(s) for s in sizes])
        spec["graph_args"] = args
    return schedule_from_spec(spec, base_dir=base_dir)


class Trainer:
    """Everything one rank holds for a run, and the round loop."""

    def __init__(self, cfg: RunConfig, dataset=None, comm=None, log=print):
        self.cfg, self.log = cfg, log
        self.spec = get_algorithm(cfg.algorithm.name)
        rt = cfg.runtime
        self.comm = comm or init_comm(rt.device, rt.backend, rt.timeout_s)
        self.device = self.comm.device
        if self.device.type == "cuda":
            set_cuda_numerics(rt.tf32, rt.deterministic)
        if dataset is None:
            from gossip_pfl.data import load_dataset

            dataset = load_dataset(cfg.data.name, **cfg.data.options)
        self.dataset = dataset
        unseen = set(getattr(dataset, "unseen", []) or [])
        self.train_ids = np.array([i for i in range(len(dataset.clients)) if i not in unseen])
        self.unseen_ids = np.array(sorted(unseen), dtype=np.int64)
        n = len(self.train_ids)
        sizes = np.array([len(dataset.clients[i].y_train) for i in self.train_ids])
        self.n_peers = n
        self.M = 1 if self.spec.single_model else cfg.algorithm.components
        self.schedule: MixingSchedule | None = build_schedule(cfg, n, sizes, self.spec.topology)
        self.placement = Placement(n, self.comm.world_size, self.comm.rank)
        self.peers = self.placement.peers  # positions in train_ids
        L = len(self.peers)

        # Model, batched over (peer, component).
        task, n_out = dataset.task, num_outputs(dataset.task, dataset.num_classes)
        shape = tuple(dataset.input_shape)
        x0 = dataset.clients[self.train_ids[0]].x_train
        if tuple(x0.shape[1:]) != shape:
            raise GossipError(
                f"dataset '{dataset.name}': samples have shape {tuple(x0.shape[1:])} but "
                f"input_shape says {shape}"
            )

        def model_fn():
            return build_model(cfg.model.name, shape, n_out, **cfg.model.options)

        model = model_fn().to(self.device)
        self.layout = ParamLayout(model)
        self.forward = BatchedForward(model, self.layout, rt.batching)
        self.task = task
        # Samples per batched call (0 in the config: the model's CPU hint, else no limit for
        # steps and 16384 for evaluation). On a GPU bigger calls are better, so no hint there.
        hint = getattr(model, "samples_per_call", None)
        hint = hint(self.M) if hint is not None and self.device.type == "cpu" else 0
        self.step_chunk = rt.step_chunk or hint
        self.eval_chunk = cfg.eval.chunk or hint or 16384

        # Shared state: (local nodes, M, P); rows past L are auxiliary nodes (an aggregating hub).
        n_nodes = n
        if self.schedule is not None:
            n_nodes = max(p.size for p in self.schedule.phases(0))
        self.n_local_nodes = len(self.placement.nodes(n_nodes))
        theta0 = init_components(model_fn, self.layout, self.M, cfg.seed).to(self.device)
        self.nodes = theta0.expand(self.n_local_nodes, *theta0.shape).clone()

        # Private state and data of this rank's peers.
        clients = [dataset.clients[self.train_ids[i]] for i in self.peers]
        self.train = PaddedSplit.of(clients, "train", self.device)
        self.test = PaddedSplit.of(clients, "test", self.device)
        self.counts = np.array([len(c.y_train) for c in clients])
        # Unseen clients are spread over ranks too; they only evaluate.
        self.unseen_pos = np.array_split(np.arange(len(self.unseen_ids)), self.comm.world_size)[
            self.comm.rank
        ]
        held = [dataset.clients[self.unseen_ids[i]] for i in self.unseen_pos]
        self.unseen_train = self.unseen_test = None
        if held:
            self.unseen_train = PaddedSplit.of(held, "train", self.device)
            self.unseen_test = PaddedSplit.of(held, "test", self.device)
        a = cfg.algorithm
        self.surrogate = build_surrogate(cfg, self.spec, self.M, task)
        self.personal = self.surrogate.init_personal(self.train_ids[self.peers], theta0)
        self.solver = LocalSGD(a.lr, a.momentum, a.weight_decay, a.mu if self.spec.prox else 0.0)
        self.opt_state = self.solver.init(self.nodes[:L])
        # D-FedEM (Alg. 4) moves the client weight n_t/n into the step; scaled by T so the mean
        # multiplier is 1 and FedEM and D-FedEM share one learning rate (fedem.md, scale note).
        decentral = self.spec.topology == "given"
        step_weights = decentral and a.client_weighting == "step"
        scale = self.counts * n / sizes.sum() if step_weights else np.ones(L)
        self.lr_scale = torch.as_tensor(scale, dtype=torch.float32, device=self.device)
        # ... or the gossip weights neighbours by sample count (see mix): the server's n_t / n
        # average on a complete graph, without the large steps that destabilize momentum SGD.
        self.gossip_by_size = decentral and a.client_weighting == "gossip"
        self.forward.check(self.nodes[:L], self.train.x)
        self.exchanger = Exchanger(self.placement, self.comm)
        self.sizes = sizes
        self.cluster_rule = None
        if self.spec.topology == "clusters":
            self.cluster_rule = ClusteredRule(n, a.tol1, a.tol2)
        self.times = {"local": 0.0, "exchange": 0.0}
        self.round = 0
        self.model_bytes = 0  # peer-to-peer traffic of the schedule (see mix)
        self._spare = None  # mixing output buffer (see mix)

    # ---- one round, in named steps -------------------------------------------------------
    def local_work(self, t: int) -> None:
        """E-step + personal update, then the local solver's steps on every peer at once."""
        theta = self.nodes[: len(self.peers)]
        if self.cluster_rule is not None:
            self.round_start = theta.clone()
        self.personal, q = self.surrogate.begin_round(self, theta, self.personal, self.train.mask)
        a = self.cfg.algorithm
        factor = 0.1 ** sum(t >= f * self.cfg.rounds for f in a.lr_decay)
        self.local_steps(theta, q, self.opt_state, t, a.local_epochs, a.local_steps, factor)
        self._check_finite(t, theta)

    def local_steps(
        self, theta, q, opt_state, t, epochs, steps=None, factor=1.0, personal=None, stream=0
    ) -> None:
        """The local solver on the surrogate, in place on ``theta`` (L, M, P)."""
        personal = self.personal if personal is None else personal
        L, a = len(self.peers), self.cfg.algorithm
        idx, weight = round_batches(
            self.counts, self.train_ids[self.peers], self.cfg.seed, t, a.batch_size, epochs, steps,
            stream,
        )  # fmt: skip
        # Only the peers still in their epoch take part in a step (small peers finish early),
        # and its batch is cut to the longest real one: padding is front-to-back, and costs.
        # Worked out on the host and uploaded once per round: on a GPU a per-step nonzero()
        # would stop the host at every step.
        filled = weight.sum(-1)  # (S, L) real samples of each peer's batch at step s
        widths = filled.max(-1).astype(np.int64).tolist()
        active = [np.flatnonzero(f > 0) for f in filled]
        all_rows = np.concatenate(active or [np.empty(0, dtype=np.int64)])
        step_rows = torch.as_tensor(all_rows, device=self.device).split([len(a) for a in active])
        idx = torch.as_tensor(idx, device=self.device)
        weight = torch.as_tensor(weight, device=self.device)
        anchor = theta.clone() if self.solver.prox_mu else None
        q = q.expand(L, self.M, -1) if q is not None else None
        for s in range(idx.shape[0]):
            rows = step_rows[s]
            # every peer in the step (the big early ones): a slice makes theta, q and the
            # optimizer state views instead of copies
            sel = slice(None) if len(rows) == L else rows
            b_idx, b_w = idx[s, sel, : widths[s]], weight[s, sel, : widths[s]]  # (A, B')
            x, y = self.train.take(rows, b_idx)
            # the samples' weights: responsibilities (none: 1) times the padding mask, (A, M, B)
            sw = b_w[:, None, :].expand(-1, self.M, -1)
            if q is not None:
                sw = torch.gather(q[sel], 2, b_idx[:, None, :].expand(-1, self.M, -1)) * sw
            grad = self.surrogate.shared_grad(self, theta[sel], personal, rows, x, y, sw)
            self.solver.step(theta, grad, opt_state, sel, self.lr_scale, factor, anchor)

    def mix(self, t: int) -> None:
        """Exchange with neighbours and mix the shared state through W_t's phases."""
        flat = self.nodes.view(self.n_local_nodes, -1)
        if self.cluster_rule is not None:
            phases, period = [self.cluster_phase()], None
        elif self.schedule is not None:
            phases, period = self.schedule.phases(t), self.schedule.period
        else:
            return
        for k, phase in enumerate(phases):
            key = (t % period, k) if period else None
            # double buffering: the previous state becomes the next output (no fresh pages);
            # the first one is zeros, not garbage, in case a kernel reads it despite beta = 0
            spare = self._spare if self._spare is not None else torch.zeros_like(flat)
            if self.gossip_by_size:
                phase = weight_by_size(phase, self.sizes)
            new = self.exchanger.mix(flat, self.exchanger.plan(phase, key), out=spare)
            self._spare, flat = flat, new
            # what the peers would send with one peer per machine, whatever the placement
            self.model_bytes += phase.messages * flat.shape[1] * flat.element_size()
        self.nodes = flat.view_as(self.nodes)

    def cluster_phase(self):
        """Clustered FL: gather every peer's update of this round, let the (replicated) server
        rule split clusters, and average within clusters."""
        delta = (self.nodes[: len(self.peers)] - self.round_start).flatten(1).double()
        self.cluster_rule.update(self.rows_of(delta).cpu().numpy())
        return self.cluster_rule.phase(self.sizes.astype(np.float64))

    def peer_pieces(self, n_peers: int, batch: int) -> list[slice]:
        """Slices of the peer axis with at most ``step_chunk`` samples each (0: one piece); a
        piece holds at least one peer."""
        chunk = self.step_chunk
        per = max(1, n_peers if chunk <= 0 else chunk // max(1, batch))  # >= 1: a range step
        return [slice(k, min(k + per, n_peers)) for k in range(0, n_peers, per)]

    # ---- measurements ---------------------------------------------------------------------
    @torch.no_grad()
    def train_losses(self, theta: torch.Tensor, split: PaddedSplit | None = None) -> torch.Tensor:
        """Every sample's loss under every component: (L, M, N_max), 0 on padding (training
        data by default)."""
        split = split or self.train
        losses = torch.zeros(*theta.shape[:2], split.y.shape[1], device=self.device)
        for rows, sl, x, y, _ in split.chunks(self.eval_chunk):
            losses[rows, :, sl] = sample_loss(self.forward(theta[rows], x), y, self.task)
        return losses

    @torch.no_grad()
    def evaluate_unseen(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Clients held out of training: download the peers' average components, keep them
        fixed, fit pi by EM on the client's own training data (to convergence, or one step
        from uniform as in the paper), then evaluate. No data: uniform pi."""
        n_unseen = len(self.unseen_ids)
        theta = self.nodes[: len(self.peers)].double().sum(0)
        theta_bar = (self.comm.all_reduce_sum(theta) / self.n_peers).to(self.nodes.dtype)
        if self.unseen_train is None:
            zero = torch.zeros(0, device=self.device)
            return tuple(self.gather([zero, zero, zero], [], n_unseen))
        u = len(self.unseen_pos)
        theta_u = theta_bar.expand(u, *theta_bar.shape)
        personal = self.surrogate.init_personal(self.unseen_ids[self.unseen_pos], theta_bar)
        if self.M > 1:
            losses = self.train_losses(theta_u, self.unseen_train)
            iters = 1 if self.cfg.eval.unseen_em == "one_step" else 300
            personal["pi"] = fit_mixture_weights(losses, self.unseen_train.mask, iters)
        nll, acc = self.scores(self.unseen_test, theta_u, personal)
        return tuple(self.gather([nll, acc, self.unseen_test.counts], self.unseen_pos, n_unseen))

    @torch.no_grad()
    def consensus_distance(self) -> list[float]:
        """(1/n) sum_i ||theta_{m,i} - theta_bar_m||^2 per component, over all ranks."""
        theta = self.nodes[: len(self.peers)].double()
        mean = self.comm.all_reduce_sum(theta.sum(0)) / self.n_peers
        dist2 = ((theta - mean) ** 2).sum(dim=(0, 2))
        return (self.comm.all_reduce_sum(dist2) / self.n_peers).tolist()

    @torch.no_grad()
    def scores(self, split: PaddedSplit, theta, personal) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row (mean log-loss, accuracy) of the personalized prediction on ``split``."""
        correct = torch.zeros(theta.shape[0], device=self.device, dtype=torch.float64)
        nll = torch.zeros_like(correct)
        for rows, _, x, y, m in split.chunks(self.eval_chunk):
            mine = {k: v[rows] for k, v in personal.items()}
            probs = self.surrogate.predict(self.forward(theta[rows], x), mine)
            p_true = probs.gather(-1, y[..., None])[..., 0].clamp_min(1e-12)
            nll.index_add_(0, rows, (-torch.log(p_true) * m).sum(-1).double())
            correct.index_add_(0, rows, ((probs.argmax(-1) == y).float() * m).sum(-1).double())
        counts = split.counts.double().clamp_min(1)
        return nll / counts, correct / counts

    def gather(self, values: list[torch.Tensor], positions, total: int) -> np.ndarray:
        """Rows computed on each rank -> (len(values), total) array on every rank."""
        full = torch.zeros(len(values), total, dtype=torch.float64, device=self.device)
        for k, v in enumerate(values):
            # long even when empty: a rank holding no unseen client passes []
            full[k, torch.as_tensor(positions, dtype=torch.long, device=self.device)] = v.double()
        return self.comm.all_reduce_sum(full).cpu().numpy()

    def evaluate(self, split: PaddedSplit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-peer (loss, accuracy, count) gathered as length-n arrays (training-peer order).
        FedAvg+ first fine-tunes a copy of each peer's model for its local epochs."""
        theta = self.nodes[: len(self.peers)]
        personal = self.personal
        if self.spec.finetune_epochs:
            theta = theta.clone()
            personal = {k: v.clone() for k, v in personal.items()}
            steps_state = LocalSGD(self.cfg.algorithm.lr).init(theta)
            self.local_steps(
                theta, None, steps_state, self.round, self.spec.finetune_epochs,
                personal=personal, stream=1,
            )  # fmt: skip
        theta = self.surrogate.eval_state(theta, personal)
        nll, acc = self.scores(split, theta, personal)
        return tuple(self.gather([nll, acc, split.counts], self.peers, self.n_peers))

    def _clock(self) -> float:
        """perf_counter once the device has finished its queued work: CUDA kernels and NCCL
        transfers run asynchronously, and would otherwise be charged to the next phase."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _check_finite(self, t: int, theta: torch.Tensor) -> None:
        bad = (~torch.isfinite(theta.view(theta.shape[0], -1))).any(-1)
        first = int(self.peers[bad.nonzero()[0, 0].item()]) + 1 if bad.any() else 0
        flag = torch.tensor([first], dtype=torch.float64, device=self.device)
        worst = int(self.comm.all_reduce_sum(flag).item()) if self.comm.world_size > 1 else first
        if worst:
            raise GossipError(
                f"round {t}: the parameters of a peer (first: peer "
                f"{first - 1 if first else '?'} on rank {self.comm.rank}) became NaN/inf; "
                f"lower algorithm.lr (now {self.cfg.algorithm.lr})"
            )

    # ---- the loop -------------------------------------------------------------------------
    def run(self, resume: bool = False) -> dict:
        cfg = self.cfg
        out = Path(cfg.out)
        is_main = self.comm.rank == 0
        first, rows = 0, []
        if resume:
            first, rows = self.restore(out)
        if is_main:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.yaml").write_text(_dump_yaml(to_dict(cfg)))
            # rows past the checkpoint are recomputed: keep the file consistent with the state
            _write_rows(out / "metrics.jsonl", rows)
            self.log(self.describe() + (f"; resumed after round {first}" if resume else ""))
        start = time.perf_counter() - self.times.get("wall", 0.0)
        progress = Progress(cfg.rounds, first, enabled=is_main, log=self.log)
        for t in range(first, cfg.rounds):
            self.round = t
            t0 = time.perf_counter()
            self.local_work(t)
            t1 = self._clock()
            self.mix(t)
            t2 = self._clock()
            self.times["local"] += t1 - t0
            self.times["exchange"] += t2 - t1
            last = t == cfg.rounds - 1
            if (t + 1) % cfg.eval.every == 0 or last:
                row = self.metrics_row(t)
                rows.append(row)
                if is_main:
                    _write_rows(out / "metrics.jsonl", [row], append=True)
                progress.report(t, row)
            progress.tick()
            every = cfg.checkpoint_every
            if (every and (t + 1) % every == 0) or last:
                self.times["wall"] = time.perf_counter() - start
                self.checkpoint(out, t + 1, rows)
        progress.close()
        summary = self.summary(rows[-1], time.perf_counter() - start)
        if is_main:
            (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    # ---- checkpoints ----------------------------------------------------------------------
    def rows_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """A per-peer tensor (L, ...) of this rank -> (n, ...) in peer order on every rank."""
        full = torch.zeros((self.n_peers, *tensor.shape[1:]), dtype=tensor.dtype,
                           device=self.device)  # fmt: skip
        full[torch.as_tensor(self.peers, device=self.device)] = tensor
        return self.comm.all_reduce_sum(full)

    def checkpoint(self, out: Path, rounds_done: int, rows: list) -> None:
        """Every peer's shared and private state, optimizer state and counters, saved by
        rank 0 (all ranks take part in the gather)."""
        L = len(self.peers)
        state = {
            "rounds_done": rounds_done,
            "config": to_dict(self.cfg),
            "shared": self.rows_of(self.nodes[:L]).cpu(),
            "aux": self.nodes[L:].cpu() if self.comm.rank == 0 else None,
            "personal": {k: self.rows_of(v).cpu() for k, v in self.personal.items()},
            "momentum": self.rows_of(self.opt_state.momentum).cpu(),
            "clusters": self.cluster_rule.clusters if self.cluster_rule else None,
            "times": dict(self.times),
            "model_bytes": self.model_bytes,
            "traffic": self.traffic(),
            "rows": rows,
        }
        if self.comm.rank == 0:
            checkpoint.save(state, out)

    def restore(self, out: Path) -> tuple[int, list]:
        """Load RUN_DIR/checkpoint.pt into this rank's peers; returns (first round, rows)."""
        state = checkpoint.load(out)
        diffs = checkpoint.config_differences(state["config"], to_dict(self.cfg))
        if diffs:
            raise GossipError(
                f"--resume {out}: the checkpoint was made with a different config "
                f"(keys differ: {', '.join(diffs)})"
            )
        if state["rounds_done"] >= self.cfg.rounds:
            raise GossipError(
                f"--resume {out}: the run already finished its {self.cfg.rounds} rounds "
                "(raise 'rounds' with --set rounds=N to go on)"
            )
        idx = torch.as_tensor(self.peers)
        L = len(self.peers)
        self.nodes[:L] = state["shared"][idx].to(self.device)
        if self.comm.rank == 0 and state["aux"] is not None:
            self.nodes[L:] = state["aux"].to(self.device)
        self.personal = {k: v[idx].to(self.device) for k, v in state["personal"].items()}
        self.opt_state.momentum.copy_(state["momentum"][idx])
        if self.cluster_rule is not None:
            self.cluster_rule.clusters = state["clusters"]
        self.times = dict(state["times"])
        self.model_bytes = state["model_bytes"]
        per_rank = state["traffic"]["bytes_sent_per_rank"]
        if len(per_rank) == self.comm.world_size:  # same layout: each rank its own counters
            self.exchanger.bytes_sent = per_rank[self.comm.rank]
            self.exchanger.messages_sent = state["traffic"]["messages_sent_per_rank"][
                self.comm.rank
            ]
        elif self.comm.rank == 0:
            self.exchanger.bytes_sent = state["traffic"]["bytes_sent"]
            self.exchanger.messages_sent = state["traffic"]["messages_sent"]
        return state["rounds_done"], list(state["rows"])

    def metrics_row(self, t: int) -> dict:
        tr_loss, tr_acc, tr_n = self.evaluate(self.train)
        te_loss, te_acc, te_n = self.evaluate(self.test)
        row = {
            "round": t + 1,
            "train_loss": _weighted(tr_loss, tr_n),
            "train_accuracy": _weighted(tr_acc, tr_n),
            "test_loss": float(np.mean(te_loss)),
            "test_accuracy": float(np.mean(te_acc)),
            "test_accuracy_weighted": _weighted(te_acc, te_n),
            "test_accuracy_p10": float(np.percentile(te_acc, 10)),
            "consensus_distance": self.consensus_distance(),
            **self.traffic(),
            "seconds_local": self.times["local"],
            "seconds_exchange": self.times["exchange"],
            "client_test_accuracy": [round(float(a), 5) for a in te_acc],
            **self.mixture_usage(),
        }
        if len(self.unseen_ids):
            _, acc, n = self.evaluate_unseen()
            row["unseen_test_accuracy"] = float(np.mean(acc))
            row["unseen_test_accuracy_p10"] = float(np.percentile(acc, 10))
        return row

    def mixture_usage(self) -> dict:
        """Each component's mean mixture weight over the training peers, and how many peers
        put their largest weight on it: a component dying out or taking over every client
        shows here (empty without mixture weights)."""
        pi = self.gathered_pi()
        if pi is None:
            return {}
        return {
            "mixture_weights": [round(float(w), 5) for w in pi.mean(0)],
            "mixture_leaders": np.bincount(pi.argmax(1), minlength=self.M).tolist(),
        }

    def gathered_pi(self) -> np.ndarray | None:
        """Every training peer's mixture weights (n, M), on every rank; None for one model."""
        if self.M == 1 or "pi" not in self.personal:
            return None
        return self.gather(list(self.personal["pi"].T), self.peers, self.n_peers).T

    def traffic(self) -> dict:
        """Traffic so far: ``model_bytes`` as if every peer were its own machine (the
        schedule's messages x the shared state's size), and the bytes and messages this run's
        ranks actually sent to each other, in total and per rank."""
        sent = torch.zeros(2, self.comm.world_size, dtype=torch.float64, device=self.device)
        sent[0, self.comm.rank] = self.exchanger.bytes_sent
        sent[1, self.comm.rank] = self.exchanger.messages_sent
        sent = self.comm.all_reduce_sum(sent).cpu().numpy().astype(np.int64)
        return {
            "model_bytes": int(self.model_bytes),
            "bytes_sent": int(sent[0].sum()),
            "messages_sent": int(sent[1].sum()),
            "bytes_sent_per_rank": sent[0].tolist(),
            "messages_sent_per_rank": sent[1].tolist(),
        }

    def cluster_recovery(self) -> float | None:
        """Share of peers whose arg-max pi matches their true cluster, under the best matching
        of components to clusters. Only for data made of clusters: the synthetic generator's
        true pi (meta['pi']) one-hot for every client."""
        true_pi = self.dataset.meta.get("pi")
        if true_pi is None or self.M == 1 or "pi" not in self.personal:
            return None
        if not np.all(np.asarray(true_pi).max(1) == 1.0):
            return None
        truth = np.asarray(true_pi).argmax(1)
        pi = self.gathered_pi()
        truth = truth[self.train_ids]
        guess = pi.argmax(1)
        k = max(self.M, int(truth.max()) + 1)
        agree = np.zeros((k, k), dtype=np.int64)
        np.add.at(agree, (guess, truth), 1)
        from itertools import permutations

        best = max(
            sum(agree[m, c] for m, c in zip(range(k), perm)) for perm in permutations(range(k))
        )
        return float(best) / len(truth)

    def summary(self, last: dict, wall: float) -> dict:
        recovery = self.cluster_recovery()
        extra = {"cluster_recovery": recovery} if recovery is not None else {}
        return {
            **extra,
            "algorithm": self.cfg.algorithm.name,
            "rounds": self.cfg.rounds,
            "test_accuracy": last["test_accuracy"],
            "test_accuracy_p10": last["test_accuracy_p10"],
            "test_accuracy_weighted": last["test_accuracy_weighted"],
            "train_accuracy": last["train_accuracy"],
            "train_loss": last["train_loss"],
            "consensus_distance": last["consensus_distance"],
            "wall_seconds": wall,
            "world_size": self.comm.world_size,
            # another thread count rounds the convolutions differently (README, Fashion-MNIST)
            "torch_threads": torch.get_num_threads(),
            "bytes_sent": last["bytes_sent"],
            "client_test_accuracy": last["client_test_accuracy"],
            **{k: v for k, v in last.items() if k.startswith(("unseen_", "mixture_"))},
        }

    def describe(self) -> str:
        sched = repr(self.schedule) if self.schedule is not None else "none (W = I)"
        return (
            f"{self.cfg.algorithm.name}: {self.placement.describe()}, M = {self.M}, "
            f"{self.layout.numel} parameters per component, schedule {sched}, "
            f"device {self.device}, local work {self.forward.describe()}"
        )

    def shared_parameters(self) -> np.ndarray:
        """This rank's peers' shared state (L, M, P) as a numpy array (for tests)."""
        return self.nodes[: len(self.peers)].detach().cpu().numpy()


@torch.no_grad()
def fit_mixture_weights(
    losses: torch.Tensor, mask: torch.Tensor, iters: int, tol: float = 1e-6
) -> torch.Tensor:
    """EM on the mixture weights alone, components fixed: pi (L, M) from uniform.

    ``losses`` (L, M, N) per-sample losses, ``mask`` (L, N). The likelihoods are computed once
    (shifted by the per-sample minimum loss, so huge losses cannot underflow everything); each
    iteration is then q = pi * lik / sum_m, pi = mean q. Stops when pi moves less than ``tol``.
    Clients without samples keep uniform weights.
    """
    lik = torch.exp(-(losses - losses.min(dim=1, keepdim=True).values)).double()  # (L, M, N)
    weight = mask.double() / mask.sum(-1, keepdim=True).clamp_min(1)  # 1/n_i on real samples
    pi = torch.full(lik.shape[:2], 1.0 / lik.shape[1], dtype=torch.float64, device=lik.device)
    for _ in range(iters):
        # pi_m <- pi_m * mean_i lik_im / sum_k pi_k lik_ik  (two batched products per sweep)
        denom = torch.einsum("lmn,lm->ln", lik, pi).clamp_min(1e-300)
        new = pi * torch.einsum("lmn,ln->lm", lik, weight / denom)
        new = torch.where(mask.sum(-1, keepdim=True) > 0, new, pi)
        done = (new - pi).abs().max() < tol
        pi = new
        if done:
            break
    return pi.to(losses.dtype)


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

    def report(self, t: int, row: dict) -> None:
        if not self.enabled:
            return
        fields = {
            "loss": f"{row['train_loss']:.4f}",
            "acc": f"{row['test_accuracy']:.4f}",
            "consensus": f"{max(row['consensus_distance']):.3g}",
        }
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
        else:
            self.log(f"round {t + 1}  " + "  ".join(f"{k} {v}" for k, v in fields.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _write_rows(path: Path, rows: list[dict], append: bool = False) -> None:
    with open(path, "a" if append else "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def _weighted(values: np.ndarray, counts: np.ndarray) -> float:
    return float((values * counts).sum() / max(counts.sum(), 1))


def _dump_yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def run(cfg: RunConfig, dataset=None, comm=None, log=print, resume: bool = False) -> dict:
    """Build a trainer, run it (or resume it from cfg.out) and always tear the process group
    down, also when building the trainer fails."""
    rt = cfg.runtime
    comm = comm or init_comm(rt.device, rt.backend, rt.timeout_s)
    try:  # a config error found while building the trainer must not leave the group alive
        return Trainer(cfg, dataset, comm, log).run(resume=resume)
    finally:
        comm.close()  # a no-op for one process


__all__ = ["Trainer", "run", "build_schedule"]
