"""PeFLL's workload: PeFLL-train rounds on the shared round loop, PeFLL-predict for every
client (:mod:`gossip_pfl.algorithms.pefll` holds the networks, the hub's rule and the
protocol's message kinds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.func import vmap

from gossip_pfl import checkpoint
from gossip_pfl.algorithms.pefll import (
    KINDS,
    Functional,
    HyperNetwork,
    PeFLLHub,
    check_emittable,
    descriptors,
    hub_models,
)
from gossip_pfl.algorithms.rules import Inbox, State
from gossip_pfl.config import RunConfig, to_dict
from gossip_pfl.errors import GossipError
from gossip_pfl.loop import RoundLoop
from gossip_pfl.metrics import client_accuracies, score_entries, unseen_entries
from gossip_pfl.models import EMBEDDINGS, build_model, check_model_reads
from gossip_pfl.runtime.comm import gather_rows, init_comm, set_cuda_numerics
from gossip_pfl.runtime.data import PaddedSplit, RankData, client_ids, round_batches
from gossip_pfl.runtime.participation import participant_count, sample_participants
from gossip_pfl.runtime.placement import Placement
from gossip_pfl.runtime.stack import BatchedForward, ParamLayout
from gossip_pfl.runtime.threads import configure_host, even_pieces, map_pieces

#: what a checkpoint of a PeFLL run holds (clients hold nothing)
CHECKPOINT_KEYS = ("rounds_done", "config", "hub", "times", "kind_bytes", "rows")
_STREAM_STEPS, _STREAM_DESCRIPTOR = 0, 1  # separate minibatch streams per (peer, round)


class PeFLLRun(RoundLoop):
    """PeFLL-train rounds on the shared loop; evaluation is PeFLL-predict for every client."""

    summary_keys = ("test_accuracy", "test_accuracy_p10", "train_accuracy",
                    "unseen_test_accuracy", "bytes_per_round", "rounds",
                    "wall_seconds")  # fmt: skip

    def __init__(self, cfg: RunConfig, dataset=None, comm=None, log=print):
        self.cfg, self.log, p = cfg, log, cfg.pefll
        self.updated_round: int | None = None
        unseen = cfg.data.options.get("unseen_fraction", 0.0)
        if isinstance(unseen, bool) or not isinstance(unseen, (int, float)) or not 0 <= unseen < 1:
            raise GossipError(
                f"config key 'data.unseen_fraction' must be in [0, 1) (got {unseen!r})"
            )
        rt = cfg.runtime
        self.threads = configure_host(rt.threads)  # before any torch work, as the Trainer
        self.comm = comm or init_comm(rt.device, rt.backend, rt.timeout_s)
        self.device = self.comm.device
        if self.device.type == "cuda":  # (runtime.tf32 and runtime.deterministic, as a model's)
            set_cuda_numerics(rt.tf32, rt.deterministic)
        if dataset is None:
            from gossip_pfl.data import load_dataset

            dataset = load_dataset(cfg.data.name, **cfg.data.options)
        self.dataset = dataset
        self.data_state()  # the checkpoints' data digest, now rather than in the rounds' time
        if dataset.task != "multiclass":
            raise GossipError(
                f"data.name '{dataset.name}': PeFLL's embedding reads class labels; the dataset's "
                f"task is {dataset.task!r}, not multiclass"
            )
        self.train_ids, self.unseen_ids = client_ids(dataset)
        n = self.n_peers = len(self.train_ids)
        sizes = np.array([len(dataset.clients[i].y_train) for i in self.train_ids])
        small = int(np.argmin(sizes))
        if p.descriptor_batch > sizes[small]:
            raise GossipError(
                f"config key 'pefll.descriptor_batch' is {p.descriptor_batch} but client "
                f"{self.train_ids[small]} has only {sizes[small]} training samples (the "
                f"smallest); set it to at most {sizes[small]}"
            )
        self.dim = p.embed_dim or max(1, len(dataset.clients) // 4)
        shape, C = tuple(dataset.input_shape), dataset.num_classes

        check_model_reads(cfg.model.name, dataset)
        model = build_model(cfg.model.name, shape, C, **cfg.model.options).to(self.device)
        check_emittable(model, cfg.model.name)
        self.layout = ParamLayout(model)
        self.forward = BatchedForward(model, self.layout, rt.batching, rt.precision)
        torch.manual_seed(cfg.seed * 1009 + 101)  # the hub's networks: from the seed alone
        self.hyper = Functional(HyperNetwork(self.dim, self.layout, p.hidden, p.hidden_layers))
        self.embed = Functional(EMBEDDINGS[p.embed](shape, C, self.dim))
        self.hyper.module.to(self.device)
        self.embed.module.to(self.device)
        self.hub = PeFLLHub(p.lr, p.clip, p.lambda_h, p.lambda_v)
        self.hub_state: State = {}
        if self.comm.rank == 0:
            self.hub_state = self.hub.init(self.hyper.initial(), self.embed.initial())

        self.placement = Placement(n, self.comm.world_size, self.comm.rank)
        self.peers = self.placement.peers
        data = RankData.of(dataset, self.train_ids, self.unseen_ids, self.peers,
                           self.comm.rank, self.comm.world_size, self.device)  # fmt: skip
        self.train, self.test, self.unseen_pos = data.train, data.test, data.unseen_pos
        self.unseen_train, self.unseen_test = data.unseen_train, data.unseen_test
        self.counts = sizes[self.peers]
        self.n_active = participant_count(cfg.participation, n)
        P, Pv = self.layout.numel, self.embed.layout.numel
        #: floats per message of each kind
        self.kind_sizes = dict(zip(KINDS, (Pv, self.dim, P, P, self.dim, Pv)))
        self.kind_bytes = dict.fromkeys(KINDS, 0)
        self.times = {"local": 0.0, "exchange": 0.0}
        self.round = 0
        self.scratch: dict = {}  # within a round only: what the next message needs

    # ---- transport: the hub (rank 0) and the clients (every rank) ------------------------
    def from_hub(self, value: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        """Hub -> clients: rank 0's ``value`` on every rank."""
        if self.comm.world_size == 1:
            return value
        buf = value.clone() if self.comm.rank == 0 else torch.zeros(shape, device=self.device)
        return self.comm.all_reduce_sum(buf)

    def to_hub(self, rows: torch.Tensor, positions, total: int) -> torch.Tensor:
        """Clients -> hub: this rank's ``rows`` (A, ...) put at ``positions`` of a (total, ...)
        table, summed over ranks (every rank gets it; only the hub reads it)."""
        return gather_rows(self.comm, rows, positions, total)

    def count(self, kind: str, messages: int) -> None:
        self.kind_bytes[kind] += messages * self.kind_sizes[kind] * 4  # float32

    # ---- one round, in named steps -------------------------------------------------------
    def sample(self, t: int) -> np.ndarray:
        return sample_participants(self.cfg.seed, t, self.n_peers, self.n_active)

    def batches(self, rows: np.ndarray, t: int, stream: int, steps: int, batch: int):
        """(idx (steps, A, B), weight) minibatches of this rank's peers ``rows`` in round t,
        drawn from (seed, client, round, stream) alone."""
        idx, w = round_batches(self.counts[rows], self.train_ids[self.peers[rows]],
                               self.cfg.seed, t, batch, steps=steps, stream=stream)  # fmt: skip
        return torch.as_tensor(idx, device=self.device), torch.as_tensor(w, device=self.device)

    def local_work(self, t: int, active: np.ndarray | None = None) -> None:
        """Forward half: eta_v down, descriptors up, the hub's models down; then each
        participant's k local steps (the model delta is sent in ``communicate``)."""
        p = self.cfg.pefll
        active = np.ones(self.n_peers, dtype=bool) if active is None else active
        part = np.flatnonzero(active)  # the round's clients, in peer order
        rows = np.flatnonzero(active[self.peers])  # this rank's participants
        pos = np.searchsorted(part, self.peers[rows])
        S = len(part)
        rows_t = torch.as_tensor(rows, dtype=torch.long, device=self.device)

        eta_v = self.from_hub(self.hub_state.get("eta_v"), (self.embed.layout.numel,))
        self.count("embed_params", S)
        idx, w = self.batches(rows, t, _STREAM_DESCRIPTOR, 1, p.descriptor_batch)
        xd, yd = self.train.take(rows_t, idx[0])
        with torch.no_grad():  # (a rank without participants this round sends none)
            v = descriptors(self.embed, eta_v, xd, yd, w[0]) if len(rows) else \
                eta_v.new_zeros(0, self.dim)  # fmt: skip
        v_all = self.to_hub(v, pos, S)
        self.count("descriptor", S)
        theta_all = None
        if self.comm.rank == 0:  # the hub
            if p.normalize:
                self.hub_state = self.hub.normalize(self.hub_state, v_all)
            with torch.no_grad():
                theta_all = hub_models(self.hyper, self.hub_state, v_all)
        theta_all = self.from_hub(theta_all, (S, self.layout.numel))
        self.count("client_model", S)
        if not torch.isfinite(theta_all).all():
            raise GossipError(
                f"round {t + 1}: the hypernetwork's models became NaN/inf; lower pefll.lr "
                f"(now {p.lr}) or pefll.client_lr (now {p.client_lr})"
            )
        theta = theta_all[torch.as_tensor(pos, dtype=torch.long, device=self.device)]
        delta = self.local_steps(theta, rows, t) - theta
        self.scratch = {"pos": pos, "S": S, "v_all": v_all, "eta_v": eta_v, "delta": delta,
                        "descriptor_batch": (xd, yd, w[0])}  # fmt: skip

    def local_steps(self, theta: torch.Tensor, rows: np.ndarray, t: int) -> torch.Tensor:
        """k steps of SGD with momentum on every participant of this rank at once, on its
        loss + lambda_theta ||theta||^2; ``theta`` (A, P) -> the models after them."""
        p = self.cfg.pefll
        if len(rows) == 0:
            return theta
        idx, w = self.batches(rows, t, _STREAM_STEPS, p.local_steps, p.batch_size)
        rows_t = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        out = torch.empty_like(theta)

        def steps(sl: slice) -> None:  # the clients of ``sl``, every step: they are independent
            model, buf = theta[sl].clone(), torch.zeros_like(theta[sl])
            for s in range(p.local_steps):
                x, y = self.train.take(rows_t[sl], idx[s, sl])
                logits, leaves = self.forward.for_grad(model[:, None], x)
                logits = logits[:, 0]  # (A, B, C)
                nll = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(),
                                                  reduction="none")  # fmt: skip
                # each client's mean over its real samples; summed: each its own gradient
                ws = w[s, sl]
                loss = ((nll.view_as(y) * ws).sum(1) / ws.sum(1).clamp_min(1)).sum()
                parts = torch.autograd.grad(loss, leaves, materialize_grads=True)
                g = self.forward.flat_grad(parts)[:, 0]
                g = g + 2 * p.lambda_theta * model
                buf = p.momentum * buf + g
                model = model - p.client_lr * buf
            out[sl] = model.detach()

        # on a CPU, the clients in as many even pieces as threads, at once (one: every client)
        threads = self.forward.piece_threads(self.device)
        map_pieces(steps, even_pieces(len(rows), min(threads, len(rows))), threads)
        return out

    def communicate(self, t: int, active: np.ndarray | None = None) -> None:
        """Backward half: deltas up, the hub's vector-Jacobian product through h, descriptor
        gradients down, the clients' through their embedding, their gradients up, Adam."""
        sc, self.scratch = self.scratch, {}
        S, pos = sc["S"], sc["pos"]
        delta_all = self.to_hub(sc["delta"], pos, S)
        self.count("model_delta", S)
        g_h = g_v_all = None
        if self.comm.rank == 0:  # the hub: one VJP for all S clients, -delta as dL/dtheta
            pull = self.hyper.vjp(lambda eh, v: hub_models(self.hyper, self.hub_state, v, eh),
                                  self.hub_state["eta_h"], sc["v_all"])  # fmt: skip
            g_h, g_v_all = pull(-delta_all)
        g_v_all = self.from_hub(g_v_all, (S, self.dim))
        self.count("descriptor_grad", S)
        g_v = self.client_embed_grads(sc["eta_v"], *sc["descriptor_batch"], g_v_all[pos])
        # one message per client, summed on the hub in client order: any placement adds the
        # same numbers in the same order
        g_eta_v = self.to_hub(g_v, pos, S).sum(0)
        self.count("embed_grad", S)
        if self.comm.rank == 0:
            inbox = Inbox({"hyper_grad": g_h / S, "embed_grad": g_eta_v / S})
            self.hub_state = self.hub.update(inbox, self.hub_state)
        self.updated_round = t  # (settle checks the update)

    def client_embed_grads(self, eta_v, x, y, w, g_v) -> torch.Tensor:
        """The participants of this rank backpropagate their descriptor gradient (A, l)
        through v(B_i; eta_v): their messages (A, Pv). One VJP per client, all of them in
        one call (``torch.func.vmap``): a client's own batch alone, so its message does not
        depend on who shares its rank (to the bit on a CPU, tested; a GPU's convolutions may
        choose kernels by batch size). A lone client runs as two lanes, itself twice: a batch
        of one takes other CPU kernels, 2e-8 apart with the LeNet embedding."""
        if len(g_v) == 0:
            return eta_v.new_zeros((0, eta_v.numel()))
        if len(g_v) == 1:
            two = (t.expand(2, *t.shape[1:]) for t in (x, y, w, g_v))
            return self.client_embed_grads(eta_v, *two)[:1]

        def message(x1, y1, w1, g1) -> torch.Tensor:  # one client's, its batch (B, ...)
            pull = self.embed.vjp(
                lambda ev: descriptors(self.embed, ev, x1[None], y1[None], w1[None]), eta_v
            )
            return pull(g1[None])[0]

        return vmap(message)(x, y, w, g_v)

    # ---- PeFLL-predict and evaluation -----------------------------------------------------
    @torch.no_grad()
    def full_descriptors(self, split: PaddedSplit, eta_v: torch.Tensor) -> torch.Tensor:
        """Each row's descriptor from all its samples of ``split``: (rows, l)."""
        total = torch.zeros(split.y.shape[0], self.dim, device=self.device)
        for rows, _, x, y, m in split.chunks(4096):
            phi = self.embed(eta_v, x.flatten(0, 1), y.flatten()).view(*y.shape, -1)
            total.index_add_(0, rows, (phi * m[..., None]).sum(1))
        return total / split.counts.clamp_min(1)[:, None].to(total.dtype)

    @torch.no_grad()
    def predict(self, train: PaddedSplit | None, positions, total: int) -> tuple:
        """PeFLL-predict for ``total`` clients spread over ranks (this rank's at
        ``positions``): their descriptors (total, l) and this rank's models (A, P)."""
        eta_v = self.from_hub(self.hub_state.get("eta_v"), (self.embed.layout.numel,))
        v = self.full_descriptors(train, eta_v) if train is not None else None
        v = v if v is not None else torch.zeros(0, self.dim, device=self.device)
        v_all = self.to_hub(v, positions, total)
        theta = hub_models(self.hyper, self.hub_state, v_all) if self.comm.rank == 0 else None
        theta = self.from_hub(theta, (total, self.layout.numel))
        return v_all, theta[torch.as_tensor(positions, dtype=torch.long, device=self.device)]

    def client_descriptors(self, which: str = "train") -> np.ndarray:
        """Every training (or ``unseen``) client's descriptor from all its training data,
        (clients, l) on every rank, before normalization (the descriptor analysis)."""
        if which == "train":
            v, _ = self.predict(self.train, self.peers, self.n_peers)
        else:
            v, _ = self.predict(self.unseen_train, self.unseen_pos, len(self.unseen_ids))
        return v.cpu().numpy()

    @torch.no_grad()
    def scores(self, split: PaddedSplit, theta: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-row (mean log-loss, accuracy) of models ``theta`` (A, P) on ``split``."""
        correct = torch.zeros(theta.shape[0], dtype=torch.float64, device=self.device)
        nll = torch.zeros_like(correct)
        for rows, _, x, y, m in split.chunks(4096):
            logits = self.forward(theta[rows][:, None], x)[:, 0]
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
            nll.index_add_(0, rows, (loss.view_as(y) * m).sum(1).double())
            correct.index_add_(0, rows, ((logits.argmax(-1) == y).float() * m).sum(1).double())
        counts = split.counts.double().clamp_min(1)
        return nll / counts, correct / counts

    def evaluate(self, train, tests, positions, total) -> list[np.ndarray]:
        """(loss, accuracy, count) arrays over ``total`` clients for each split in ``tests``;
        keeps how far the predicted models spread (``self.spread``)."""
        _, theta = self.predict(train, positions, total)
        sums = torch.cat([theta.double().sum(0), theta.double().pow(2).sum().view(1)])
        sums = self.comm.all_reduce_sum(sums)
        mean = sums[:-1] / total  # (1/n) sum ||theta_i - mean||^2 = E||theta||^2 - ||mean||^2
        self.spread = float(sums[-1] / total - mean.pow(2).sum())
        out = []
        for split in tests:
            if split is None:
                vals = [torch.zeros(0, dtype=torch.float64, device=self.device)] * 3
            else:
                vals = [*self.scores(split, theta), split.counts.double()]
            out.append([self.to_hub(v.double(), positions, total).cpu().numpy() for v in vals])
        return out

    def settle(self) -> None:
        """Before a log or a checkpoint: the hub's networks after their last update are
        finite on every rank, so a round that blew them up is neither evaluated nor saved (the
        next round's models would be checked only in that round: the last one's never)."""
        p, t = self.cfg.pefll, self.updated_round
        if t is None:  # (no update since the start or the checkpoint)
            return
        bad = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.comm.rank == 0:
            bad += sum(int(not torch.isfinite(self.hub_state[k]).all()) for k in ("eta_h", "eta_v"))
        if self.comm.all_reduce_sum(bad).item():
            raise GossipError(
                f"round {t + 1}: the hub's networks became NaN/inf; lower pefll.lr "
                f"(now {p.lr}) or pefll.client_lr (now {p.client_lr})"
            )

    def metrics_row(self, t: int) -> dict:
        train, test = self.evaluate(self.train, [self.train, self.test], self.peers, self.n_peers)
        te_acc = test[1]
        row = {
            "round": t + 1,
            **score_entries(train, test),
            # how personalized the hub's models are: mean ||theta_i - mean theta||^2
            "consensus_distance": [self.spread],
            "model_bytes": int(sum(self.kind_bytes.values())),
            "model_bytes_by_kind": dict(self.kind_bytes),
            "bytes_per_round": sum(self.kind_bytes.values()) / (t + 1),
            "seconds_local": self.times["local"],
            "seconds_exchange": self.times["exchange"],
            "client_test_accuracy": client_accuracies(te_acc, test[2]),
        }
        if len(self.unseen_ids):
            ((_, acc, n),) = self.evaluate(self.unseen_train, [self.unseen_test],
                                           self.unseen_pos, len(self.unseen_ids))  # fmt: skip
            row.update(unseen_entries(acc, n))
        return row

    # ---- checkpoints ----------------------------------------------------------------------
    def checkpoint(self, out: Path, rounds_done: int, rows: list) -> None:
        """The hub's state (clients keep none), counters and rows, saved by rank 0."""
        if self.comm.rank != 0:
            return
        checkpoint.save({
            "rounds_done": rounds_done,
            "config": to_dict(self.cfg),
            "data": self.data_state(),
            "hub": {k: v.detach().cpu() for k, v in self.hub_state.items()},
            "times": dict(self.times),
            "kind_bytes": dict(self.kind_bytes),
            "rows": rows,
        }, out)  # fmt: skip

    def restore(self, out: Path) -> tuple[int, list]:
        where = f"--resume {out}"
        state = self.load_checkpoint(out)
        self.check_config(state, where)  # a changed key, named before the shapes it changes
        self.check_data(state, where)
        checkpoint.check_structure(state, self.n_peers, (), CHECKPOINT_KEYS, where=where)
        hub = state["hub"]
        fresh = self.hub.init(self.hyper.initial(), self.embed.initial())
        if not isinstance(hub, dict) or set(hub) != set(fresh):
            raise GossipError(f"{where}: checkpoint key 'hub' does not hold PeFLL's hub state")
        for k, v in fresh.items():
            if not isinstance(hub[k], torch.Tensor) or hub[k].shape != v.shape:
                raise GossipError(
                    f"{where}: checkpoint key 'hub.{k}' has shape "
                    f"{tuple(getattr(hub[k], 'shape', ()))}, this run {tuple(v.shape)}"
                )
        self.check_resumable(state, where)
        checkpoint.check_like(state["kind_bytes"], self.kind_bytes, "kind_bytes", where)
        if self.comm.rank == 0:
            self.hub_state = {k: v.to(self.device) for k, v in hub.items()}
        self.times = dict(state["times"])
        self.kind_bytes = dict(state["kind_bytes"])
        return state["rounds_done"], list(state["rows"])

    def summary(self, last: dict, wall: float) -> dict:
        keep = ("test_accuracy", "test_accuracy_p10", "test_accuracy_weighted", "train_accuracy",
                "train_loss", "model_bytes", "bytes_per_round", "client_test_accuracy")  # fmt: skip
        return {
            "algorithm": "pefll",
            "participation": self.n_active,
            "rounds": self.cfg.rounds,
            **{k: last[k] for k in keep},
            "wall_seconds": wall,
            "world_size": self.comm.world_size,
            "torch_threads": torch.get_num_threads(),
            **{k: v for k, v in last.items() if k.startswith("unseen_")},
        }

    def describe(self) -> str:
        p = self.cfg.pefll
        return (
            f"pefll: a hub writes each client's model ({self.n_active} of {self.n_peers} "
            f"clients a round, {len(self.unseen_ids)} unseen), embedding '{p.embed}' l = "
            f"{self.dim} ({self.embed.layout.numel} parameters), hypernetwork "
            f"{self.hyper.layout.numel} parameters -> client model '{self.cfg.model.name}' "
            f"{self.layout.numel} parameters, k = {p.local_steps}, "
            f"{self.placement.describe()}, device {self.device}, {self.threads}"
        )


__all__ = ["PeFLLRun", "CHECKPOINT_KEYS"]
