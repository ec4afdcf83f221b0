"""The EM workload: federated EM in sufficient-statistic space on the shared round loop
(gossip_pfl.loop)::

    for t in rounds:  sample(t) -> local_work(t) -> communicate(t) -> log -> checkpoint

Dieuleveut, Fort, Moulines, Robin, "Federated Expectation Maximization with heterogeneity
mitigation and variance reduction" (NeurIPS 2021). ``local_work`` is the workers' part: a
minibatch estimate of sbar_i(T(S)) (or VR-FedEM's SPIDER estimate), the compressed increment
Quant(Delta_i) and the memory update V_i += alpha Quant(Delta_i). ``communicate`` moves the
increments through the Exchanger: on the star (``star_phases``) the hub's rule turns the
participants' weighted mean into S_{k+1} and every worker copies it back; over gossip
(new, not in the paper) every peer mixes (increment, S_i, V_i) through W_t's phases and applies
the same rule to its own row, then T locally. Workers weigh in by N_i / N.

Every random draw is a function of (seed, client, round) (gossip_pfl.expfam.draws), and sums
over clients are taken in client order on every rank after an exact gather, so one process and
any number of ranks compute the same S_k.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from gossip_pfl import checkpoint
from gossip_pfl.algorithms import get_algorithm
from gossip_pfl.algorithms.rules import Inbox
from gossip_pfl.config import RunConfig, to_dict
from gossip_pfl.errors import GossipError
from gossip_pfl.expfam import draws
from gossip_pfl.expfam.compress import build_compressor
from gossip_pfl.expfam.data import ExpFamData, build_data, check_rows
from gossip_pfl.expfam.imputation import LowRankGaussian, initial_lowrank
from gossip_pfl.expfam.models import (
    DTYPE,
    GaussianMixtureDiagonal,
    GaussianMixtureShared,
    initial_params,
)
from gossip_pfl.loop import RoundLoop
from gossip_pfl.rundir import is_number, read_rows
from gossip_pfl.runtime.comm import gather_rows, init_comm
from gossip_pfl.runtime.exchange import Exchanger
from gossip_pfl.runtime.messages import Bundle
from gossip_pfl.runtime.participation import star_phases
from gossip_pfl.runtime.placement import Placement
from gossip_pfl.runtime.threads import configure_host

State = dict[str, torch.Tensor]

#: algorithm -> the workers' estimator: minibatch (FedEM, naive) | spider (VR-FedEM)
ESTIMATOR = {"fedem_em": "minibatch", "naive_em": "minibatch", "vr_fedem": "spider",
             "gossip_fedem_em": "minibatch", "gossip_vr_fedem": "spider"}  # fmt: skip


# ---- the rules: the hub's (one row), or each peer's in the gossip form (L rows) -------------
@dataclass(frozen=True)
class MemoryRule:
    """FedEM's hub (Alg. 4): with inc = sum_{i in A} w_i Quant(Delta_i),
    H = V + inc / p, S <- project(S + gamma H), V <- V + alpha inc. State: S, V (R, q).

    On the star ``inbox.mean["q"]`` is the participants' weighted mean and ``inbox.mass`` their
    share of the weight; in gossip the peer's mixed (n w_i Quant(Delta_i), S_i, V_i)."""

    gamma: float
    alpha: float
    p: float
    project: Callable
    name: ClassVar[str] = "em_memory"

    def init(self, S0: torch.Tensor, V0: torch.Tensor) -> State:
        return {"S": S0.clone(), "V": V0.clone()}

    def update(self, inbox: Inbox, state: State) -> tuple[State, torch.Tensor, int]:
        S = inbox.mean.get("S", state["S"])
        V = inbox.mean.get("V", state["V"])
        inc = inbox.mass * inbox.mean["q"]
        H = V + inc / self.p
        S_new, fixed = self.project(S + self.gamma * H)
        return {"S": S_new, "V": V + self.alpha * inc}, H, fixed


@dataclass(frozen=True)
class NaiveRule:
    """The baseline without memories: H = inc / p with inc = sum_{i in A} w_i Quant(S_i - S)."""

    gamma: float
    p: float
    project: Callable
    name: ClassVar[str] = "em_naive"

    def init(self, S0: torch.Tensor, V0: torch.Tensor | None = None) -> State:
        return {"S": S0.clone()}

    def update(self, inbox: Inbox, state: State) -> tuple[State, torch.Tensor, int]:
        S = inbox.mean.get("S", state["S"])
        H = inbox.mass * inbox.mean["q"] / self.p
        S_new, fixed = self.project(S + self.gamma * H)
        return {"S": S_new}, H, fixed


def build_model(e, data: ExpFamData):
    """The model of ``expfam.model`` for ``data``, and its initial parameters' maker."""
    if e.model == "imputation":
        check_rows(data, "expfam.data")
        return LowRankGaussian(data.dim, e.rank), lambda seed: initial_lowrank(data.x, e.rank)
    if torch.isnan(data.x).any():
        raise GossipError(
            f"config key 'expfam.model': {e.model} needs complete data; data {data.name} has "
            "missing entries (use model imputation)"
        )
    diagonal = e.model == "gmm_diag"
    cls = GaussianMixtureDiagonal if diagonal else GaussianMixtureShared
    real = data.x[data.mask].unsqueeze(0)  # (1, N, d): padding left out
    model = cls.from_data(real, e.components)

    def theta0(seed: int):
        return initial_params(real, e.components, diagonal, torch.Generator().manual_seed(seed))

    return model, theta0


#: what an EM checkpoint holds (:meth:`ExpFamRun.checkpoint`)
CHECKPOINT_KEYS = ("rounds_done", "config", "workers", "rule_state", "H_sq", "counters",
                   "times", "rows")  # fmt: skip


class ExpFamRun(RoundLoop):
    """One rank's workers (and, on rank 0, the hub) of a federated EM run."""

    summary_keys = ("h_sq", "H_sq", "loglik", "epochs", "bits_up", "bits_sent", "projected",
                    "mixture_weights", "imputation_rmse", "mean_imputation_rmse", "rounds",
                    "wall_seconds")  # fmt: skip
    #: ||h||^2 and ||H||^2 go to 1e-6 and below: three significant digits, not 0.0000
    summary_formats = {"h_sq": ".3g", "H_sq": ".3g"}

    @staticmethod
    def write_plots(run_dir: Path) -> list[Path]:
        return plot_run(Path(run_dir))

    @staticmethod
    def comm_device(rt) -> str:
        """EM runs on the CPU, also where a GPU is visible (``auto``); asked for CUDA (a
        device or NCCL), a one-line error."""
        if rt.device == "cuda" or rt.backend == "nccl":
            key, value = ("device", rt.device) if rt.device == "cuda" else ("backend", rt.backend)
            raise GossipError(
                f"config key 'runtime.{key}' {value!r}: EM runs on the CPU (its statistics are "
                "a few numbers a worker, in float64); leave runtime.device at auto or cpu and "
                "runtime.backend at auto or gloo"
            )
        return "cpu" if rt.device == "auto" else rt.device  # (another name: init_comm's error)

    def __init__(self, cfg: RunConfig, dataset: ExpFamData | None = None, comm=None, log=print):
        from gossip_pfl.train import build_schedule

        self.cfg, self.log = cfg, log
        self.spec = get_algorithm(cfg.algorithm.name)
        e = self.e = cfg.expfam
        if cfg.participation != 1.0:
            raise GossipError(
                f"config key 'participation' is for model workloads (got {cfg.participation!r}); "
                "EM workers take part with probability expfam.p"
            )
        rt = cfg.runtime
        if rt.precision != "float32":  # the closed forms need float64 (models.DTYPE)
            raise GossipError(
                f"config key 'runtime.precision' {rt.precision!r}: EM runs in float64; "
                "leave it at float32"
            )
        self.threads = configure_host(rt.threads)  # before any torch work, as the Trainer
        self.comm = comm or init_comm(self.comm_device(rt), rt.backend, rt.timeout_s)
        self.device = self.comm.device
        self.data = dataset if dataset is not None else build_data(e, cfg.seed)
        self.model, theta0 = build_model(e, self.data)
        n = self.n_peers = self.data.n
        self.q = self.model.q
        opts = {"dithering": {"levels": e.levels, "norm": e.norm},
                "block": {"blocks": e.block, "p": e.block_norm}}.get(e.compressor, {})  # fmt: skip
        self.quant = build_compressor(e.compressor, **opts)
        self.estimator = ESTIMATOR[cfg.algorithm.name]
        project = self.model.project
        naive = self.spec.rule == "em_naive"
        self.rule = (
            NaiveRule(e.gamma, e.p, project)
            if naive
            else MemoryRule(e.gamma, e.alpha, e.p, project)
        )
        self.schedule = build_schedule(cfg, n, self.spec)
        self.route = "star" if self.schedule is None else "gossip"
        n_nodes = n + 1 if self.schedule is None else max(p.size for p in self.schedule.phases(0))
        self.placement = Placement(n, self.comm.world_size, self.comm.rank)
        self.peers = self.placement.peers
        self.n_local_nodes = len(self.placement.nodes(n_nodes))
        self.exchanger = Exchanger(self.placement, self.comm)
        kinds = () if self.route == "star" else (("S",) if naive else ("S", "V"))
        self.bundle = Bundle((1, self.q), tensors=kinds)  # "theta": the increment

        dev = self.device
        self.w = torch.as_tensor(self.data.weights, dtype=DTYPE, device=dev)  # N_i / N
        self.x = self.data.x[self.peers].to(dev)
        self.counts = torch.as_tensor(self.data.counts[self.peers], device=dev)
        self.mask = self.data.mask[self.peers].to(dev)
        self.N = int(self.data.counts.sum())

        # S_0: one E-step at the initial parameters; V_{0,i} = h_i(S_0) (2 N expectations);
        # T(S_0) is the first round's model whatever the memories start at: a singular one
        # is the start's fault, not the step size's
        L = len(self.peers)
        try:
            S0 = self.weighted_sum(self.full_means(theta0(cfg.seed)))
            means = self.full_means(self.model.T(S0))
        except torch.linalg.LinAlgError:
            raise GossipError(
                f"the model at start is singular on this data ({self.N} samples in all, "
                f"dimension {self.x.shape[-1]}): give the clients more samples (expfam.samples, "
                f"expfam.clients) or fewer components (expfam.components)"
            ) from None
        if naive or e.init_memory == "zero":
            V_i = torch.zeros(L, self.q, dtype=DTYPE, device=dev)
        else:
            V_i = means - S0
        self.V_i = V_i
        self.S = S0.expand(L, -1).clone()  # each worker's copy of the statistics
        self.S_prev = self.S.clone()  # VR-FedEM: S_{t,k-1}
        self.spider = torch.zeros_like(self.S)  # VR-FedEM: S_{t,k,i}
        V0 = self.weighted_sum(V_i)
        if self.route == "star":
            self.hub = self.rule.init(S0[None], V0[None]) if self.comm.rank == 0 else {}
        else:
            self.hub = self.rule.init(self.S, V0.expand(L, -1))
        self.H_sq = torch.zeros(L if self.route == "gossip" else 1, dtype=DTYPE, device=dev)
        # this rank's share of the run's counters (summed over ranks when logged)
        self.counters = dict.fromkeys(("expectations", "bits_up", "bits_sent", "projected"), 0)
        self.init_expectations = self.N * (1 if naive or e.init_memory == "zero" else 2)
        self.baseline = self._mean_imputation_rmse()
        self.times = {"local": 0.0, "exchange": 0.0}
        self.round = 0
        self.outbox = None

    # ---- sums over all workers, the same on every rank and placement -----------------------
    def rows_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's per-worker rows (L, ...) -> (n, ...) in worker order on every rank
        (disjoint rows summed with zeros: exact)."""
        return gather_rows(self.comm, tensor, self.peers, self.n_peers)

    def weighted_sum(self, rows: torch.Tensor) -> torch.Tensor:
        """sum_i (N_i / N) rows_i over all workers, in worker order."""
        return (self.w[:, None] * self.rows_of(rows)).sum(0)

    def total(self, value: float) -> float:
        """A counter summed over the ranks."""
        t = torch.tensor([float(value)], dtype=DTYPE, device=self.device)
        return float(self.comm.all_reduce_sum(t)[0]) if self.comm.world_size > 1 else float(value)

    # ---- E-steps ------------------------------------------------------------------------
    def full_means(self, theta, rows=None) -> torch.Tensor:
        """sbar_i(theta) over each worker's samples (L, q) (``rows``: those workers only)."""
        x, mask = (self.x, self.mask) if rows is None else (self.x[rows], self.mask[rows])
        s = self.model.sbar(theta, x)
        return (s * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)

    def batch_means(self, thetas, t: int, rows: torch.Tensor) -> list[torch.Tensor]:
        """Each worker's b-sample mean of sbar_ij at each theta of ``thetas`` (one minibatch per
        worker, drawn from (seed, worker, round), without replacement)."""
        b = self.e.batch
        m_max = self.x.shape[1]
        if b == 0 or b >= m_max:
            return [self.full_means(th, rows) for th in thetas]
        who = self.peers[rows.cpu().numpy()]
        u = draws.uniforms(self.cfg.seed, draws.BATCH, t, who, (m_max,))
        u = torch.as_tensor(u, device=self.device)
        u = torch.where(self.mask[rows], u, torch.full_like(u, 2.0))  # padding sorts last
        idx = u.argsort(1)[:, :b]
        xb = torch.gather(self.x[rows], 1, idx[..., None].expand(-1, -1, self.x.shape[-1]))
        real = (torch.arange(b, device=self.device) < self.counts[rows, None]).to(DTYPE)
        return [(self.model.sbar(th, xb) * real[..., None]).sum(1) / real.sum(1, keepdim=True)
                for th in thetas]  # fmt: skip

    def expectations(self, rows, b: int | None) -> int:
        c = self.counts[rows]
        return int((c if not b else c.clamp(max=b)).sum())

    # ---- one round, in named steps -------------------------------------------------------
    def sample(self, t: int) -> np.ndarray:
        """Bernoulli(p) participants from (seed, round): the same on every rank."""
        if self.estimator == "spider":
            return np.ones(self.n_peers, dtype=bool)
        return draws.bernoulli(self.cfg.seed, t, self.n_peers, self.e.p)

    def local_work(self, t: int, active: np.ndarray | None = None) -> None:
        """The participants' estimate of sbar_i(T(S_k)) and compressed increment (zero for the
        others, which keep their memory)."""
        try:
            self._local_work(t, active)
        except torch.linalg.LinAlgError:  # T(S) is a singular model: S left the valid set
            raise self._singular(t + 1) from None

    def _singular(self, rnd: int) -> GossipError:
        batch = f" or raise expfam.batch (now {self.e.batch})" if self.e.batch else ""
        return GossipError(
            f"round {rnd}: the statistics S map to a singular model (a covariance that is "
            f"not positive definite): lower expfam.gamma (now {self.e.gamma}){batch}"
        )

    def _local_work(self, t: int, active: np.ndarray | None) -> None:
        L = len(self.peers)
        mine = torch.as_tensor(active[self.peers], device=self.device)
        rows = mine.nonzero()[:, 0]
        est = torch.zeros(L, self.q, dtype=DTYPE, device=self.device)
        if self.estimator == "spider":
            if t % self.e.k_in == 0:  # outer loop: S_{t,0,i} = sbar_i(T(S)), a full pass
                self.spider = self.full_means(self.model.T(self.S))
                self.S_prev = self.S.clone()
                self.counters["expectations"] += self.expectations(rows, None)
            now, before = self.batch_means([self.model.T(self.S), self.model.T(self.S_prev)],
                                           t, rows)  # fmt: skip
            self.spider = self.spider + (now - before)
            est = self.spider
            self.counters["expectations"] += 2 * self.expectations(rows, self.e.batch)
        elif len(rows):
            (est[rows],) = self.batch_means([self.model.T(self.S[rows])], t, rows)
            self.counters["expectations"] += self.expectations(rows, self.e.batch)
        base = self.S if self.rule.name == "em_naive" else self.S + self.V_i
        u = draws.uniforms(self.cfg.seed, draws.QUANT, t, self.peers, (self.q,))
        msg = self.quant(est - base, u=torch.as_tensor(u, device=self.device))
        msg = torch.where(mine[:, None], msg, torch.zeros_like(msg))
        if self.rule.name == "em_memory":
            self.V_i = self.V_i + self.e.alpha * msg
        self.outbox = msg

    def communicate(self, t: int, active: np.ndarray | None = None) -> None:
        if self.route == "star":
            self._star(t, active)
        else:
            self._gossip(t, active)
        self.outbox = None
        if not torch.isfinite(self.S).all():  # the model workloads stop the same way
            raise GossipError(f"round {t + 1}: the statistics S became NaN/inf; lower "
                              f"expfam.gamma (now {self.e.gamma})")  # fmt: skip

    def _star(self, t: int, active: np.ndarray) -> None:
        """Up: the hub receives the participants' weighted mean; the hub's rule; down: every
        worker copies S_{k+1}."""
        L = len(self.peers)
        full = bool(active.all())
        phases = star_phases(active, self.data.counts.astype(np.float64))
        flat = torch.zeros(self.n_local_nodes, self.q, dtype=DTYPE, device=self.device)
        flat[:L] = self.outbox
        for k, phase in enumerate(phases):
            flat = self.exchanger.mix(
                flat, self.exchanger.plan(phase, ("star", k) if full or k == 1 else None)
            )
            if k == 0 and self.comm.rank == 0:  # the hub, between the up and down phases
                mass = float(self.data.weights[active].sum())
                inbox = Inbox({"q": flat[L:]}, mass=mass)
                self.hub, H, fixed = self.rule.update(inbox, self.hub)
                self.H_sq = (H**2).sum(-1)
                self.counters["projected"] += fixed
                flat[L:] = self.hub["S"]
        if self.comm.rank == 0:  # the run's traffic, counted once
            self.counters["bits_up"] += int(active.sum()) * self.quant.bits(self.q)
            self.counters["bits_sent"] += (int(active.sum()) * self.quant.bits(self.q)
                                           + self.n_peers * 64 * self.q)  # fmt: skip
        self.S_prev, self.S = self.S, flat[:L].clone()

    def _gossip(self, t: int, active: np.ndarray) -> None:
        """Each peer mixes (n w_i Quant(Delta_i), S_i, V_i) with its neighbours through W_t's
        phases and applies the rule to its row; a peer not drawn sends a zero increment but
        still mixes (it is online, it only skips the E-step)."""
        L = len(self.peers)
        n = self.n_peers
        parts = {"theta": (n * self.w[self.peers, None]) * self.outbox, **self.hub}
        flat = torch.zeros(self.n_local_nodes, self.bundle.width, dtype=DTYPE, device=self.device)
        self.bundle.pack({k: v.reshape(L, 1, self.q) for k, v in parts.items()}, out=flat[:L])
        period = self.schedule.period
        phases = self.schedule.phases(t)
        for k, phase in enumerate(phases):
            flat = self.exchanger.mix(flat, self.exchanger.plan(phase, (t % period, k)
                                                                if period else None))  # fmt: skip
            if self.comm.rank == 0:
                per_msg = self.quant.bits(self.q) + 64 * self.q * len(self.bundle.tensors)
                self.counters["bits_up"] += phase.messages * self.quant.bits(self.q)
                self.counters["bits_sent"] += phase.messages * per_msg
        got = {k: v[:L, 0] for k, v in self.bundle.unpack(flat).items()}
        mixed = {"q": got.pop("theta"), **got}
        self.hub, H, fixed = self.rule.update(Inbox(mixed), self.hub)
        self.H_sq = (H**2).sum(-1)
        self.counters["projected"] += fixed
        self.S_prev, self.S = self.S, self.hub["S"]

    # ---- measurements ---------------------------------------------------------------------
    def statistics(self) -> torch.Tensor:
        """The run's S: the hub's (every worker holds a copy), or the peers' mean (gossip)."""
        if self.route == "star":
            return self.S[0]
        return self.rows_of(self.S).mean(0)

    def _sample_loglik(self, theta, x) -> torch.Tensor:
        if hasattr(self.model, "sample_loglik"):
            return self.model.sample_loglik(theta, x)
        return torch.logsumexp(self.model.log_joint(theta, x), dim=-1)

    def _mean_imputation_rmse(self) -> float | None:
        truth = self.data.truth
        if truth is None:
            return None
        hidden = torch.isnan(self.data.x) & self.data.mask[..., None]
        col = torch.nanmean(self.data.x[self.data.mask], 0)
        err = (truth - col)[hidden]
        return float(err.pow(2).mean().sqrt())

    def metrics_row(self, t: int) -> dict:
        try:
            return self._metrics_row(t)
        except torch.linalg.LinAlgError:  # the round's update left the valid set: evaluated
            raise self._singular(t + 1) from None  # before the next round's local work saw it

    def _metrics_row(self, t: int) -> dict:
        S = self.statistics()
        theta = self.model.T(S)
        sbar = self.weighted_sum(self.full_means(theta))
        h = sbar - S
        ll = (self._sample_loglik(theta, self.x) * self.mask).sum(1) / self.mask.sum(1)
        loglik = float((self.w * self.rows_of(ll)).sum())
        if self.route == "star":  # the hub's H, known on rank 0
            H_sq = self.total(float(self.H_sq[0]) if self.comm.rank == 0 else 0.0)
            spread = 0.0
        else:
            H_sq = float(self.rows_of(self.H_sq).mean())
            spread = float(((self.rows_of(self.S) - S) ** 2).sum(-1).mean())
        expect = self.total(self.counters["expectations"]) + self.init_expectations
        row = {
            "round": t + 1,
            "epochs": expect / self.N,
            "h_sq": float((h**2).sum()),
            "H_sq": H_sq,
            "loglik": loglik,
            "bits_up": int(self.total(self.counters["bits_up"])),
            "bits_sent": int(self.total(self.counters["bits_sent"])),
            "projected": int(self.total(self.counters["projected"])),
            "consensus_distance": [spread],
            "seconds_local": self.times["local"],
            "seconds_exchange": self.times["exchange"],
        }
        if hasattr(theta, "weights"):
            row["mixture_weights"] = [round(float(v), 6) for v in theta.weights]
        if self.data.truth is not None:
            filled = self.model.impute(theta, self.x)
            hidden = torch.isnan(self.x) & self.mask[..., None]
            truth = self.data.truth[self.peers].to(self.device)
            sq = torch.where(hidden, (filled - truth) ** 2, torch.zeros_like(filled))
            err = self.total(float(sq.sum())) / max(self.total(float(hidden.sum())), 1)
            row["imputation_rmse"] = err**0.5
            row["mean_imputation_rmse"] = self.baseline
        return row

    def progress_fields(self, row: dict) -> dict[str, str]:
        return {"loglik": f"{row['loglik']:.4f}", "h_sq": f"{row['h_sq']:.3g}",
                "epochs": f"{row['epochs']:.1f}"}  # fmt: skip

    def summary(self, last: dict, wall: float) -> dict:
        keep = ("epochs", "h_sq", "H_sq", "loglik", "bits_up", "bits_sent", "projected",
                "mixture_weights", "imputation_rmse", "mean_imputation_rmse")  # fmt: skip
        if last.get("projected") and self.comm.rank == 0:  # (none in the shipped experiments)
            warnings.warn(f"S left the M-step's domain in {last['projected']} updates and was "
                          "projected back: the fit may be degenerate (lower expfam.gamma, now "
                          f"{self.e.gamma})", stacklevel=2)  # fmt: skip
        return {
            "algorithm": self.cfg.algorithm.name,
            "route": self.route,
            "rounds": self.cfg.rounds,
            **{k: last[k] for k in keep if k in last},
            "bits_up_per_round": last["bits_up"] / self.cfg.rounds,
            "omega": self.quant.omega(self.q),
            "statistics": self.statistics().cpu().tolist(),
            "wall_seconds": wall,
            "world_size": self.comm.world_size,
            "torch_threads": torch.get_num_threads(),
        }

    def describe(self) -> str:
        e = self.e
        where = (
            f"star (a hub; workers take part with probability {e.p})"
            if self.route == "star"
            else f"gossip {self.schedule!r} (each peer applies T)"
        )
        return (
            f"{self.cfg.algorithm.name}: {where}, model {e.model} (q = {self.q}) on "
            f"{self.data.name} (N = {self.N}), compressor {e.compressor} (omega "
            f"{self.quant.omega(self.q):.3g}, {self.quant.bits(self.q)} bits a message), "
            f"{self.placement.describe()}, {self.threads}"
        )

    # ---- checkpoints ----------------------------------------------------------------------
    def checkpoint(self, out: Path, rounds_done: int, rows: list) -> None:
        """Every worker's state in worker order, the hub's (rank 0) and the counters."""
        gossip = self.route == "gossip"
        state = {
            "rounds_done": rounds_done,
            "config": to_dict(self.cfg),
            "workers": {k: self.rows_of(v).cpu() for k, v in self._worker_state().items()},
            "rule_state": {
                k: (self.rows_of(v) if gossip else v).cpu() for k, v in self.hub.items()
            },
            "H_sq": (self.rows_of(self.H_sq) if gossip else self.H_sq).cpu(),
            "counters": {k: self.total(v) for k, v in self.counters.items()},
            "times": dict(self.times),
            "rows": rows,
        }
        if self.comm.rank == 0:
            checkpoint.save(state, out)

    def _worker_state(self) -> State:
        return {"S": self.S, "S_prev": self.S_prev, "V_i": self.V_i, "spider": self.spider}

    def _saved_like(self) -> dict:
        """The shapes and types of what :meth:`checkpoint` saves (its tensors on the meta
        device: every worker's rows, the hub's or every worker's rule state)."""
        rows = self.n_peers if self.route == "gossip" else 1
        zero = torch.zeros(rows, self.q, dtype=DTYPE)
        return {
            "workers": {
                k: torch.empty(self.n_peers, *v.shape[1:], dtype=v.dtype, device="meta")
                for k, v in self._worker_state().items()
            },  # fmt: skip
            "rule_state": {k: v.to("meta") for k, v in self.rule.init(zero, zero).items()},
            "H_sq": torch.empty(rows, dtype=DTYPE, device="meta"),
            "counters": dict.fromkeys(self.counters, 0),
        }

    def restore(self, out: Path) -> tuple[int, list]:
        state = self.load_checkpoint(out)
        where = f"--resume {out}"
        self.check_config(state, where)
        checkpoint.check_structure(state, self.n_peers, (), CHECKPOINT_KEYS, where=where)
        self.check_resumable(state, where)
        for key, like in self._saved_like().items():  # (a wrong width was a traceback)
            checkpoint.check_like(state[key], like, key, where)
        idx = torch.as_tensor(self.peers)
        dev = self.device
        self.S, self.S_prev, self.V_i, self.spider = (
            state["workers"][k][idx].to(dev) for k in ("S", "S_prev", "V_i", "spider")
        )
        if self.route == "gossip":
            self.hub = {k: v[idx].to(dev) for k, v in state["rule_state"].items()}
            self.H_sq = state["H_sq"][idx].to(dev)
        elif self.comm.rank == 0:
            self.hub = {k: v.to(dev) for k, v in state["rule_state"].items()}
            self.H_sq = state["H_sq"].to(dev)
        # the totals go to rank 0 (the others start from 0): sums over ranks stay right
        self.counters = {k: (int(v) if self.comm.rank == 0 else 0)
                         for k, v in state["counters"].items()}  # fmt: skip
        self.times = dict(state["times"])
        return state["rounds_done"], list(state["rows"])


def plot_run(run_dir: Path, out: Path | None = None, label: str | None = None) -> list[Path]:
    """||h(S_k)||^2 and ||H_k||^2 (and the mixture weights) against epochs, written to
    ``out`` (default RUN_DIR/plots) as expfam.png; ``label`` titles the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(Path(run_dir) / "metrics.jsonl")
    if not rows:
        return []
    for i, r in enumerate(rows):  # (a row without one was a KeyError's traceback)
        for key in ("epochs", "h_sq", "H_sq"):
            if isinstance(r.get(key), bool) or not isinstance(r.get(key), (int, float)):
                raise GossipError(f"{Path(run_dir) / 'metrics.jsonl'}: row {i + 1} has no "
                                  f"number {key!r} (an EM run's rows hold epochs, h_sq and "
                                  "H_sq)")  # fmt: skip
    panels = 3 if "mixture_weights" in rows[0] else 2
    for i, r in enumerate(rows if panels == 3 else []):  # (a traceback, or drawn as numbers)
        w = r.get("mixture_weights")
        if not (
            isinstance(w, list)
            and len(w) == len(rows[0]["mixture_weights"])
            and all(is_number(x) for x in w)
        ):
            raise GossipError(f"{Path(run_dir) / 'metrics.jsonl'}: row {i + 1}'s mixture_weights "
                              f"is {w!r:.60}, not the numbers of row 1's "
                              f"{len(rows[0]['mixture_weights'])} components")  # fmt: skip
    ep = [r["epochs"] for r in rows]
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4))
    for ax, key, title in zip(axes, ("h_sq", "H_sq"), ("||h(S_k)||^2", "||H_k||^2")):
        ax.semilogy(ep, [max(r[key], 1e-300) for r in rows])
        ax.set(xlabel="epochs", title=title)
    if panels == 3:
        axes[2].plot(ep, [r["mixture_weights"] for r in rows])
        axes[2].set(xlabel="epochs", title="mixture weights")
    if label:
        fig.suptitle(label)
    fig.tight_layout()
    out = Path(run_dir) / "plots" if out is None else Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "expfam.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
