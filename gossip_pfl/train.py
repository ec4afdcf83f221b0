"""The model workload: build the pieces from the config, then the shared round loop
(gossip_pfl.loop):

    for t in rounds:  sample(t) -> local_work(t) -> communicate(t) -> log -> checkpoint

``local_work`` is the client update of the round's participants (their surrogate's E-step and
the local solver); ``communicate`` delivers their messages along the route (the star with the
hub's rule between its up and down phases, W_t's phases with each peer's rule, or a rule's own
phase) and applies the rule. An algorithm is a composition of a surrogate, a solver and a
rule (gossip_pfl.algorithms); what names one here chooses a faster path for it (the mixture's
fused E-step, the line search's kernels) or its evaluation (unseen clients' mixture weights,
Clustered FL's cluster models), not what a round computes.

The same code runs with every peer in one process or spread over torchrun ranks; every random
draw is seeded per peer (data order, initialization) or per round (schedule), never per rank.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from gossip_pfl import checkpoint
from gossip_pfl.algorithms import (
    ALGORITHMS,
    RULE_KEYS,
    AlgorithmSpec,
    build_solver,
    build_surrogate,
    get_algorithm,
)
from gossip_pfl.algorithms.losses import num_outputs, sample_loss
from gossip_pfl.algorithms.mixture import MixtureSurrogate, fit_mixture_weights
from gossip_pfl.algorithms.rules import Average, Inbox, build_rule, check_rule, gossip_rules
from gossip_pfl.config import EvalConfig, RuleConfig, RunConfig, read_yaml, to_dict
from gossip_pfl.errors import GossipError
from gossip_pfl.loop import RoundLoop, digest31, rows_unlike_rank0
from gossip_pfl.metrics import (
    client_accuracies,
    mixture_entries,
    recovery_entry,
    score_entries,
    unseen_entries,
)
from gossip_pfl.models import build_model, check_model_reads
from gossip_pfl.runtime.comm import (
    comm_from_config,
    device_memory,
    gather_rows,
    set_cuda_numerics,
)
from gossip_pfl.runtime.data import (
    REORDER_ON,
    BatchPlanner,
    PaddedSplit,
    RankData,
    Uploads,
    client_ids,
    dense_layout,
    linear_host,
    round_batches,
    step_plan,
)
from gossip_pfl.runtime.exchange import Exchanger, weight_by_size
from gossip_pfl.runtime.graphs import GraphReplay
from gossip_pfl.runtime.messages import Bundle
from gossip_pfl.runtime.participation import (
    participant_count,
    sample_participants,
    sit_out,
    star_phases,
)
from gossip_pfl.runtime.placement import Placement
from gossip_pfl.runtime.solver import LocalArmijo, LocalSGD, Search
from gossip_pfl.runtime.stack import BatchedForward, ParamLayout, PendingEStep, init_components
from gossip_pfl.runtime.threads import configure_host, even_pieces, map_pieces
from topologies import MixingSchedule, TopologyError
from topologies.analysis import check_mixing
from topologies.spec import KNOWN_KEYS, check_not_data_file, schedule_from_spec

#: devices on which the finite check is queued rather than waited for (see _check_finite)
QUEUE_CHECK_ON: tuple[str, ...] = ("cuda",)


def build_schedule(cfg: RunConfig, n: int, spec: AlgorithmSpec):
    """The run's gossip schedule over its ``n`` training peers; None where the algorithm's
    topology is not a gossip schedule (the server's star, or W = I). A schedule that
    contradicts the algorithm is an error naming what to change."""
    sched = cfg.schedule
    if spec.topology != "given":
        if sched is None or (spec.topology == "server" and sched == {"graph": "server"}):
            return None
        what = "the server schedule (a hub)" if spec.topology == "server" else "no schedule"
        gossip = [k for k, a in ALGORITHMS.items()
                  if a.workload == spec.workload and a.topology == "given"]  # fmt: skip
        em = spec.workload == "expfam"
        rule = "" if em else " (rule.name picks the gossip rule)"
        raise GossipError(
            f"algorithm '{cfg.algorithm.name}' runs on {what} but 'schedule' is set to "
            f"{sched!r}: drop 'schedule', or for gossip choose algorithm.name "
            f"{' or '.join(gossip)}{rule}; clients per round are set by "
            f"{'expfam.p' if em else 'participation'}"
        )
    if sched is None:
        raise GossipError(
            f"algorithm '{cfg.algorithm.name}' needs a schedule: set 'schedule' to a topology "
            "spec or a schedule YAML path (e.g. schedule: {graph: ring, weights: metropolis})"
        )
    base_dir = file = None
    if isinstance(sched, str):
        base_dir, file = Path(sched).parent, sched
        if Path(sched).is_dir():
            raise GossipError(f"config key 'schedule': {sched} is a folder, not a schedule file")
        if not Path(sched).is_file():
            raise GossipError(f"config key 'schedule': schedule file not found: {sched}")
        try:
            check_not_data_file(Path(sched))
        except TopologyError as err:
            raise GossipError(f"config key 'schedule': {err}") from None
        sched = read_yaml(sched)
    if not isinstance(sched, dict):
        raise GossipError(f"config key 'schedule' must be a mapping or a file path, got {sched!r}")
    sched = dict(sched)
    args = sched.get("graph_args") or {}
    if isinstance(args, dict) and "participation" in args:  # not a mapping: the spec says so
        raise GossipError(
            "schedule.graph_args.participation samples inside the schedule; in a run, clients "
            "per round are the top-level key 'participation' (drop it from the schedule)"
        )
    given = sched.get("n", n)
    if isinstance(given, bool) or not isinstance(given, int):  # (was told as a mismatch)
        raise GossipError(f"config key 'schedule.n' must be an int, got {given!r}")
    if given != n:
        raise GossipError(
            f"schedule has n = {sched['n']} but the run has {n} training peers; "
            "set schedule.n to match or drop it"
        )
    sched["n"] = n
    sched.setdefault("seed", cfg.seed)
    try:
        schedule = schedule_from_spec(sched, base_dir=base_dir)
    except TopologyError as err:  # an inline spec's keys are the config's schedule.* keys
        if "but n is" in str(err):  # (a demo's 18 clients made n 14, unsaid)
            n_is = ("its workers, expfam.clients" if spec.workload == "expfam" else
                    "its clients less those data.unseen_fraction holds out")  # fmt: skip
            err = TopologyError(f"{err} (the run's training peers: {n_is})")
        if file:  # a schedule file: the message names it
            raise TopologyError(f"schedule file {file}: {err}") from None
        keyed = str(err).split(":")[0] in KNOWN_KEYS
        raise TopologyError(f"schedule{'.' if keyed else ': '}{err}") from None
    if cfg.check_schedule:  # the checks of `topology describe`, with the figures
        try:
            # every round the run takes (a periodic schedule's: one period), at least 100 (a
            # short run of a schedule that connects over a few rounds is a smoke test, not an
            # error); a random schedule's draws: 100 (one generator makes every round). A user
            # file's W_100 onwards went unchecked, their drift with them
            horizon = 100 if schedule.is_random else max(100, cfg.rounds)
            check_mixing(schedule, horizon=horizon)
        except TopologyError as err:
            raise GossipError(
                f"{err}; fix the schedule, or set check_schedule: false to run it anyway"
            ) from None
    return schedule


class Trainer(RoundLoop):
    """Everything one rank holds for a run, and the round loop."""

    summary_keys = ("test_accuracy", "test_accuracy_p10", "train_accuracy", "rounds",
                    "wall_seconds", "unseen_test_accuracy", "cluster_recovery",
                    "mixture_weights")  # fmt: skip

    def __init__(self, cfg: RunConfig, dataset=None, comm=None, log=print):
        self.cfg, self.log = cfg, log
        self.spec = get_algorithm(cfg.algorithm.name)
        rt = cfg.runtime
        self.threads = configure_host(rt.threads)  # before any torch work (first log line)
        self.comm = comm or comm_from_config(rt)
        # False in a peer-to-peer world: metrics, checks and checkpoints stay per process
        self.collectives = self.comm.collectives
        self.device = self.comm.device
        if self.device.type == "cuda":
            set_cuda_numerics(rt.tf32, rt.deterministic)
        if dataset is None:
            from gossip_pfl.data import load_dataset

            dataset = load_dataset(cfg.data.name, **cfg.data.options)
        self.dataset = dataset
        self.train_ids, self.unseen_ids = client_ids(dataset)
        n = len(self.train_ids)
        sizes = np.array([len(dataset.clients[i].y_train) for i in self.train_ids])
        self.n_peers = n
        self.data_state()  # the checkpoints' data digest, now rather than in the rounds' time
        self.M = 1 if self.spec.single_model else cfg.algorithm.components
        self.schedule: MixingSchedule | None = build_schedule(cfg, n, self.spec)
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

        check_model_reads(cfg.model.name, dataset)

        def model_fn():
            return build_model(cfg.model.name, shape, n_out, **cfg.model.options)

        model = model_fn().to(self.device)
        self.layout = ParamLayout(model)
        kernels = rt.cpu_kernels and self.device.type == "cpu"
        self.forward = BatchedForward(model, self.layout, rt.batching, rt.precision, kernels,
                                      self._compiling)  # fmt: skip
        self._held: dict[str, torch.Tensor] = {}  # what the graphs read, held across rounds
        self.task = task
        # Samples per batched call (0 in the config: the model's CPU hint, else no limit for
        # steps and 16384 for evaluation). On a GPU bigger calls are better, so no hint there.
        hint = getattr(model, "samples_per_call", None)
        hint = hint(self.M) if hint is not None and not dense_layout(self.device) else 0
        self.step_chunk = rt.step_chunk or hint
        self.planner = BatchPlanner()  # each round's minibatch plan, drawn a round ahead
        self.uploads = Uploads(self.device)  # the plans' copies, without waiting on a GPU
        wide = 16384
        if self.forward.closed_form:  # M * C floats a sample: a million samples a call, and 8
            # million on a GPU (the synthetic test split, 1.5 million, in one call, not pieces
            # with gathers and scatter-adds)
            wide = 1 << 23 if dense_layout(self.device) else 1 << 20
        self.eval_chunk = cfg.eval.chunk or hint or wide

        # The round protocol: who takes part, the rule, and the route its messages take.
        self.sizes = sizes
        self.agg_weights = sizes.astype(np.float64) if cfg.aggregation == "size" else np.ones(n)
        self.n_active = participant_count(cfg.participation, n)
        self.rule = check_rule(build_rule(cfg.rule.name or self.spec.rule, cfg.rule, n))
        self.route = self._route()
        if not self.collectives and self.route not in ("gossip", "none"):
            raise GossipError(
                f"algorithm '{cfg.algorithm.name}' (rule {self.rule.name}) needs a hub or "
                "gathers every peer's update; runtime.transport zmq runs gossip schedules only "
                "(dsgd, dfedem, local)"
            )
        self.client = self.rule.client_part()
        # Shared state: (local nodes, M, P); rows past L are auxiliary nodes (an aggregating hub).
        n_nodes = n + 1 if self.route == "star" else n
        if self.schedule is not None:
            n_nodes = max(p.size for p in self.schedule.phases(0))
        self.n_local_nodes = len(self.placement.nodes(n_nodes))
        need, have = self.n_local_nodes * self.M * self.layout.numel * 4, device_memory(self.device)
        # before torch draws M models (10**8 of them spun for minutes)
        if have is not None and need > have:
            raise GossipError(
                f"the shared state alone needs {self.n_local_nodes} nodes x "
                f"algorithm.components {self.M} x {self.layout.numel:,} parameters x 4 bytes = "
                f"{need / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} GiB of this "
                f"{self.device.type} device; lower algorithm.components or the model's size"
            )
        theta0 = init_components(model_fn, self.layout, self.M, cfg.seed).to(self.device)
        self.nodes = theta0.expand(self.n_local_nodes, *theta0.shape).clone()
        self.bundle = Bundle(tuple(theta0.shape), self.rule.tensors, self.rule.scalars)
        # rule state: the hub's (one row, rank 0) on the star, each peer's in gossip, and
        # replicated on every rank for a rule with its own route
        rows = {"star": 1, "gossip": L}.get(self.route, 0)
        self.rule_state = {}
        if self.route != "star" or self.comm.rank == 0:
            self.rule_state = self.rule.init(theta0.expand(rows, *theta0.shape).clone())
        self.client_state = self.client.init(self.nodes[:L]) if self.client else {}
        self.keep_start = self.rule.needs_theta or self.client is not None

        # Private state and data of this rank's peers.
        data = RankData.of(dataset, self.train_ids, self.unseen_ids, self.peers,
                           self.comm.rank, self.comm.world_size, self.device)  # fmt: skip
        self.train, self.test, self.unseen_pos = data.train, data.test, data.unseen_pos
        # the fused linear step's host side, worked out by the planner a round ahead
        self._linear_host = partial(linear_host, cfg.algorithm.batch_size,
                                    dense=dense_layout(self.device))  # fmt: skip
        self.unseen_train, self.unseen_test = data.unseen_train, data.unseen_test
        self.counts = self.train.counts.cpu().numpy()
        a = cfg.algorithm
        self.surrogate = build_surrogate(cfg, self.spec, self.M, task)
        self.personal = self.surrogate.init_personal(self.train_ids[self.peers], theta0)
        self.solver = build_solver(cfg, self.spec, self.rule)
        if isinstance(self.solver, LocalArmijo) and not hasattr(self.surrogate, "shared_loss"):
            raise GossipError(
                f"rule.name {cfg.rule.name or self.spec.rule!r}: its clients search their step "
                f"on the shared model's loss, which algorithm.name {a.name!r} does not give "
                "(its clients train a personal model); choose another rule"
            )
        self.opt_state = self.solver.init(self.nodes[:L])
        ft = cfg.eval.finetune_epochs
        self.finetune_epochs = self.spec.finetune_epochs if ft is None else ft
        # D-FedEM (Alg. 4) moves the client weight n_t/n into the step; scaled by T so the mean
        # multiplier is 1 and FedEM and D-FedEM share one learning rate (fedem.md, scale note).
        decentral = self.spec.topology == "given"
        step_weights = decentral and a.client_weighting == "step"
        scale = self.counts * n / sizes.sum() if step_weights else np.ones(L)
        self.lr_scale = torch.as_tensor(scale, dtype=torch.float32, device=self.device)
        self._lr_scale_np = self.lr_scale.cpu().numpy()  # (the host's copy: no read back)
        #: one step size for every peer: the solver may then take its fused kernel
        self.unit_scale = bool(np.all(scale == 1))
        # ... or the gossip weights neighbours by sample count (see phases): the server's n_t / n
        # average on a complete graph, without the large steps that destabilize momentum SGD.
        self.gossip_by_size = decentral and a.client_weighting == "gossip"
        self.forward.check(self.nodes[:L], self.train.x)
        self.exchanger = Exchanger(self.placement, self.comm)
        self.times = {"local": 0.0, "exchange": 0.0}
        self.round = 0
        self.kind_bytes = dict.fromkeys(self.bundle.columns(), 0)  # as if one peer per machine
        self._spare = {}  # mixing output buffers by shape (see _mix)
        self.last_loss = torch.zeros(L, dtype=torch.float64, device=self.device)
        self.steps_taken = torch.zeros(L, dtype=torch.float64, device=self.device)
        self._taken = np.zeros(L)  # steps_taken on the host: uploaded only when it changes
        self._eta_recorded = None  # (factor, peers) of opt_state's last step sizes recorded
        self._everyone = torch.ones(L, dtype=torch.bool, device=self.device)
        self.participants: np.ndarray | None = None  # the round's, during begin_round
        self.e_step_graphs = self.step_graphs = None
        if self.device.type == "cuda":
            self.use_cuda_graphs()
        self.track_loss = "loss" in self.rule.scalars
        self.line_search = isinstance(self.solver, LocalArmijo)
        # the line search's grow reset: 2^(1 / batches per epoch)
        per_epoch = -(-self.counts // a.batch_size)
        self.batches_per_epoch = torch.as_tensor(per_epoch, device=self.device)
        self._batches_host = per_epoch  # (the compiled line search's)
        # the compiled loops of this run beside its forward's, with the setup
        if self._armijo_linear():
            self.forward.warm_up("armijo_round")
        if self._personal_compiled():
            self.forward.warm_up("personal_round")
        self.outbox = None
        self._finite_pending = None  # a queued _check_finite
        self._mixed_round: int | None = None  # the last round whose communicate ran
        self._finite_host = None

    def _compiling(self) -> None:
        """Said once, by the main process, while numba compiles the CPU loops (a first run on
        a machine: 10 to 20 s before the run's first line)."""
        if getattr(self, "_said_compiling", False) or not (
            self.comm.rank == 0 or not self.comm.collectives
        ):
            return
        self._said_compiling = True
        self.log("compiling the linear model's CPU loops for this machine (numba: once, then "
                 "cached; 10 to 20 s)...")  # fmt: skip

    def _route(self) -> str:
        """How messages travel: star (hub), gossip (W_t), rule (the rule's own phase), none."""
        name, n, k = self.rule.name, self.n_peers, self.n_active
        if self.spec.topology == "none":
            if name != "average":
                raise GossipError(
                    f"rule.name {name!r} needs a topology; algorithm "
                    f"'{self.cfg.algorithm.name}' trains each peer alone"
                )
            return "none"
        if self.spec.topology == "server":
            if not hasattr(self.rule, "phase"):
                return "star"
            if k < n:
                raise GossipError(
                    f"rule.name {name!r} needs every client in every round "
                    f"(participation is {self.cfg.participation!r}); set participation: 1.0"
                )
            return "rule"
        if not self.rule.gossip:
            forms = gossip_rules(RuleConfig(), n)  # (FedLi-LS's has rule.step one only)
            options = " under these rule.* options" if name in forms else ""
            raise GossipError(
                f"rule.name {name!r} has no gossip form{options} (schedule is "
                f"{self.schedule!r}); gossip rules: {', '.join(forms)} (with their default "
                "options); or drop 'schedule' and use a server algorithm"
            )
        if k < n:
            if max(p.size for p in self.schedule.phases(0)) > n:
                raise GossipError(
                    "participation below all clients needs a gossip schedule without a hub; "
                    "for a server, use a server algorithm"
                )
            if not getattr(self.schedule, "symmetric", False):
                raise GossipError(
                    f"participation {self.cfg.participation!r} needs a symmetric schedule "
                    f"({self.schedule!r} is not): a sitting-out peer's links go to the "
                    "diagonals, which keeps W_t doubly stochastic only when it is symmetric"
                )
        return "gossip"

    # ---- one round, in named steps -------------------------------------------------------
    def sample(self, t: int) -> np.ndarray:
        """This round's participants (n,) bool, from (seed, round) alone: the same on every
        rank and placement."""
        return sample_participants(self.cfg.seed, t, self.n_peers, self.n_active)

    def local_work(self, t: int, active: np.ndarray | None = None) -> None:
        """The participants' client update: E-step + personal update, then the local solver's
        steps on every participating peer at once; then what they send (``self.outbox``)."""
        L = len(self.peers)
        mine = np.ones(L, dtype=bool) if active is None else active[self.peers]
        # every peer (the common case): a mask made once, not an upload every round
        act = self._everyone if mine.all() else self.uploads("active", mine)
        theta = self.nodes[:L]
        self.start = theta.clone() if self.keep_start else None
        # (with fuses_e_step, q and the personal state are filled during the local steps)
        self.participants = None if mine.all() else mine
        try:
            if self.e_step_graphs is not None:  # (every peer's rows, whoever takes part)
                personal, q = self._graphed_e_step(theta)
            else:
                personal, q = self.surrogate.begin_round(self, theta, self.personal,
                                                         self.train.mask)  # fmt: skip
        finally:
            self.participants = None  # (read in begin_round only)
        a = self.cfg.algorithm
        factor = self.solver.factor(t, self.cfg.rounds)
        self.solver.begin_round(self.opt_state)
        self.local_steps(theta, q, self.opt_state, t, a.local_epochs, a.local_steps, factor,
                         personal, active=mine)  # fmt: skip
        if not mine.all():  # those sitting out keep their personal state (a tensor the steps
            # wrote in place has it: it keeps its place, which a step's CUDA graph reads)
            personal = {k: v if v is self.personal.get(k) else _where(act, v, self.personal[k])
                        for k, v in personal.items()}  # fmt: skip
        self.personal = personal
        self._check_finite(t, theta)
        self.outbox = self.client_messages(theta, act)

    def use_cuda_graphs(self, simulate: bool = False) -> None:
        """The CUDA graphs the config asks for: ``runtime.cuda_graphs``, the linear model's
        steps and FedEM's E-step on it (about 20 launches a round, :meth:`_graphed_e_step`);
        ``runtime.cuda_graph_steps``, other models' local steps, a graph per step shape (a
        round's dozens of shapes, :meth:`_step_graph`). ``simulate``: on a CPU (tests,
        ``benchmarks/bench_ops.py --gpu-layout``)."""
        rt = self.cfg.runtime
        if rt.cuda_graphs and self.forward.closed_form:
            self.forward.graphs = GraphReplay(simulate=simulate)
            if self._graphs_e_step():
                # (each graph reads its input and held tensors, writes held ones: one pool)
                self.e_step_graphs = GraphReplay(keep=4, share_pool=True, simulate=simulate)
        if rt.cuda_graph_steps:
            self.step_graphs = GraphReplay(keep=1024, share_pool=True, simulate=simulate)

    def _graphs_e_step(self) -> bool:
        """The E-step can be a CUDA graph (:meth:`_graphed_e_step`): FedEM's mixture surrogate
        (M > 1) on the binary linear model's closed form, whose E-step is a few fixed-shape
        device operations on the round's parameters and the mixture weights alone, over the
        training split in one piece of every peer (a view: the pieces of a larger split, some
        10,000 peers, write their rows by an index, which with deterministic kernels on a GPU
        sorts them and may wait for the device). Its losses are every peer's whoever takes
        part (:meth:`train_losses`: one product gives every row), so a round of some peers
        takes the same graph; the others keep their state after (:meth:`local_work`)."""
        if not (
            self.forward.closed_form
            and self.task == "binary"
            and type(self.surrogate) is MixtureSurrogate
            and self.M > 1
            and set(self.personal) == {"pi"}
            and not self.fuses_e_step  # (the CPU's compiled loops work it out themselves)
        ):
            return False
        plan = self.train.chunk_plan(self.eval_chunk)
        return len(plan) == 1 and isinstance(plan[0][1], slice)

    def _graphed_e_step(self, theta: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """The surrogate's E-step (the losses, q and the new pi, every peer's) replayed as a
        CUDA graph per stack (gossip alternates between two): the mixture weights go in
        through the graph's buffer, q and pi come out in tensors held across rounds; pi is
        copied out of them, so the personal state is the run's own. Three launches where the
        eager E-step took about 20, the same operations. The first time, eagerly: that call
        makes the split's caches the E-step reads and the held outputs, which a graph must
        find made (it replays a call's operations)."""
        begin = partial(self.surrogate.begin_round, self, theta, mask=self.train.mask)

        def e_step(pi_in: torch.Tensor) -> None:
            personal, q = begin({"pi": pi_in})
            self._hold("e_step_q", q)
            self._hold("e_step_pi", personal["pi"])

        if "e_step_q" not in self._held:
            e_step(self.personal["pi"])
        else:
            self.e_step_graphs(tuple(theta.shape), e_step, self.personal["pi"],
                               places=(theta,))  # fmt: skip
            self.e_step_graphs = self._unless_failed(self.e_step_graphs, "runtime.cuda_graphs",
                                                     "the E-step", "it runs")  # fmt: skip
        return {"pi": self._held["e_step_pi"].clone()}, self._held["e_step_q"]

    def _unless_failed(
        self, graphs: GraphReplay | None, key: str, what: str, then: str
    ) -> GraphReplay | None:  # fmt: skip
        """``graphs``, or None where a capture failed (said once in the log: ``what`` could
        not be captured, ``then`` eagerly)."""
        if graphs is None or graphs.failure is None:
            return graphs
        self.log(f"{key}: {what} could not be captured as a CUDA graph ({graphs.failure}); "
                 f"{then} eagerly")  # fmt: skip
        return None

    def client_messages(self, theta: torch.Tensor, act: torch.Tensor) -> dict:
        """The bundle each peer sends: its parameters, and the scalars and tensors the rule
        reads (a client part updates its own state here)."""
        parts = {"theta": theta}
        for name in self.rule.scalars:
            if name == "loss":  # the last local minibatch's objective (FedLi)
                parts[name] = self.last_loss
            elif name == "eta":  # the last local step size
                parts[name] = self.opt_state.eta
            elif name == "sq_delta":  # ||Delta_i||^2 (FedExP)
                parts[name] = (self.start - theta).double().flatten(1).pow(2).sum(1)
        if self.client is not None:
            tensors, self.client_state = self.client.finish(
                self.client_state, self.start, theta, self.steps_taken, self.opt_state.eta, act
            )
            parts.update(tensors)
        return parts

    def local_steps(
        self, theta, q, opt_state, t, epochs, steps=None, factor=1.0, personal=None, stream=0,
        active=None,
    ) -> None:  # fmt: skip
        """The local solver on the surrogate, in place on ``theta`` (L, M, P); peers not
        ``active`` take no step."""
        personal = self.personal if personal is None else personal
        L, a = len(self.peers), self.cfg.algorithm
        counts = self.counts if active is None else np.where(active, self.counts, 0)
        plain, sgd = self._plain_sgd(), self._affine_sgd()  # (plain SGD is one of sgd)
        affine = sgd and not plain  # (the fused round adds its terms)
        # pFedMe's and APFL's steps in the fused round
        steps_of = None
        if sgd and self._personal_fused():
            steps_of = self.surrogate.compiled_steps(personal)
        fused = sgd and (self._fused_linear() or steps_of is not None)  # one call
        # the torch operations' host side of the fused step, drawn with the plan
        post = self._linear_host if fused and not self.forward.kernels else None
        idx, weight, taken, *host = self.planner(
            counts, self.train_ids[self.peers], self.cfg.seed, t, a.batch_size, epochs, steps,
            stream, post, a.loss_divisor == "batch",
        )  # fmt: skip
        if not np.array_equal(taken, self._taken):  # a round like the last one: no upload
            self.steps_taken.copy_(self.uploads("taken", taken))
            self._taken = np.array(taken, dtype=np.float64)
        if self._armijo_linear():  # FedLi-LS's line search: the round in one call
            qe = None if q is None else q.expand(L, self.M, -1)
            self.forward.linear_armijo_round(theta, self.train, (idx, weight), qe, a.batch_size,
                                             self.solver, opt_state.eta, self.last_loss,
                                             self._batches_host)  # fmt: skip
            return
        if fused:
            with np.errstate(over="ignore"):  # an lr past float32: the finite check names it
                neg = np.float32(-(self.solver.lr * factor)) * self._lr_scale_np
            heavy = None
            # the steps in the gradient's units, each peer's -lr applied after: momentum (its
            # velocity in those units) and, in torch operations, FedLi-LU's kept losses (the
            # plan's own weights) and pFedMe's and APFL's steps
            torch_units = self.track_loss or steps_of is not None
            if self.solver.momentum or (torch_units and not self.forward.kernels):
                velocity = opt_state.momentum if self.solver.momentum else None
                heavy = (velocity, self.solver.momentum, neg)
                neg = np.ones_like(neg)
            qe = q if q is None or isinstance(q, PendingEStep) else q.expand(L, self.M, -1)
            terms = self._affine_terms(neg) if affine else None
            losses = self.last_loss if self.track_loss else None  # (in place)
            self.forward.linear_sgd_round(theta, self.train, (idx, weight, *host), neg, qe,
                                          a.batch_size, terms, steps_of, losses,
                                          heavy)  # fmt: skip
            self._record_eta(opt_state, factor, taken)
            return
        prefix = self.device.type in REORDER_ON
        plan, order = step_plan(
            idx, weight, self.train.y.shape[1], self.device, prefix, self.uploads
        )
        # reordered (order not None): for the steps, the stack, the solver's state, the
        # personal rows a step reads and the losses it keeps hold the peers in that order, in
        # place (a copy each, each step's peers a slice of it); the rest is indexed by the
        # peers (rows)
        scale = self.lr_scale if order is None else self.lr_scale[order]
        undo = []  # what is in the plan's order, put back after the steps (or an error)
        try:
            if order is not None:
                back = torch.argsort(order)
                theta.copy_(theta[order])
                undo.append(lambda: theta.copy_(theta[back]))
                eta = not self._eta_by_round  # (else recorded after the steps, in peer order)
                self.solver.permute_rows(opt_state, order, eta)
                undo.append(lambda: self.solver.permute_rows(opt_state, back, eta))
                mine = [self.last_loss] if self.track_loss or self.line_search else []
                if getattr(self.surrogate, "step_reads_personal", True):
                    mine += [_per_peer(k, v, L) for k, v in personal.items()]
                for v in mine:
                    v.copy_(v[order])
                undo.append(lambda: [v.copy_(v[back]) for v in mine])
            self._plan_steps(plan, order, theta, q, opt_state, scale, factor,
                             personal, plain)  # fmt: skip
        except BaseException as err:
            traceback.clear_frames(err.__traceback__)  # the steps' tensors: room to put back
            raise
        finally:
            for put_back in reversed(undo):
                put_back()
        if self._eta_by_round:
            self._record_eta(opt_state, factor, taken)

    def _plan_steps(
        self, plan, order, theta, q, opt_state, scale, factor, personal, plain
    ) -> None:  # fmt: skip
        """:meth:`local_steps`' steps of a :func:`step_plan` on ``theta`` (``order`` not None:
        in the plan's order, the peers at each row, each step's peers a slice); ``scale`` is
        each peer's step-size multiplier in the same order."""
        L, reordered = len(self.peers), order is not None
        qt = None
        if q is not None:  # (L * N, M): a step's responsibilities are one index_select
            qt = q.expand(L, self.M, -1).transpose(1, 2).reshape(-1, self.M)
        # plain SGD (no momentum, decay, proximal term or correction): theta -= c g in one
        # scatter-add per step, the step size c of every peer worked out once per round
        neg_step = -(self.solver.lr * factor) * scale[:, None, None] if plain else None
        scale = None if self.unit_scale else scale  # the solver's: None, 1 for every peer
        graph, anchor = self._step_graph(theta, opt_state, scale, factor, neg_step, order,
                                         personal)  # fmt: skip
        if anchor is None and self.solver.prox_mu:
            anchor = theta.clone()
        for st in plan:
            rows, sel = st.rows, st.sel
            peers = rows if reordered else sel  # the step's peers in their own order
            A, width = st.shape
            # the samples' weights: responsibilities (none: 1) times the padding mask, (A, M, B)
            b_w = st.weight
            if qt is None:
                sw = b_w[:, None, :].expand(-1, self.M, -1)
            else:
                sw = qt.index_select(0, st.flat).view(A, width, self.M) * b_w[..., None]
                sw = sw.transpose(1, 2)
            if graph is not None and isinstance(sel, slice):
                graph(st, sw)
                continue
            x, y = self.train.take_flat(st.flat, st.shape)
            grad, loss = self.surrogate.shared_grad(self, theta[sel], personal, sel, x, y, sw)
            if plain:
                if isinstance(sel, slice):
                    theta[sel].add_(neg_step[sel] * grad)
                else:
                    theta.index_add_(0, rows, neg_step[rows] * grad)
                continue
            extra = {}
            if self.track_loss or self.line_search:
                mean = self._keep_loss(loss, b_w, sel)
                loss = loss * mean
            if self.client is not None:
                extra["correction"] = self.client.correction(self.client_state, peers)
            if self.line_search:
                grad = grad * mean[:, None, None]

                def loss_at(cand, sub, x=x, y=y, sw=sw, mean=mean):
                    return (
                        self.surrogate.shared_loss(self, cand, x[sub], y[sub], sw[sub]) * mean[sub]
                    )

                extra.update(loss=loss, loss_at=loss_at, batches=self.batches_per_epoch[peers])
            if self._eta_by_round:
                extra["record"] = False  # (once a round, after the steps)
            self.solver.step(theta, grad, opt_state, sel, scale, factor, anchor, **extra)
        self.step_graphs = self._unless_failed(self.step_graphs, "runtime.cuda_graph_steps",
                                               "a step", "the steps run")  # fmt: skip

    def _keep_loss(self, loss: torch.Tensor, b_w: torch.Tensor, sel) -> torch.Tensor:
        """Keep the step's objective for the rule (FedLi), at ``sel`` of the kept losses (in
        the stack's order), and return the factor that made it: FedLi's objective is the
        mean over the batch's real samples, the loss divides by B (with loss_divisor batch
        the plan's weights make it that mean already, and the factor is 1). (A,)"""
        mean = self._batch_mean(b_w, loss.dtype)
        self.last_loss[sel] = (loss * mean).double()
        return mean

    def _batch_mean(self, b_w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The factor that makes a step's loss (over the batch size) the mean over each
        batch's real samples (``b_w``: the padding mask, or the plan's weights). (A,)"""
        return (self.cfg.algorithm.batch_size / b_w.sum(-1).clamp_min(1)).to(dtype)

    def _step_graph(self, theta, opt_state, scale, factor: float, neg_step, order, personal):
        """This round's steps as CUDA graphs (``runtime.cuda_graph_steps``): a function
        ``(step, sw)`` that runs a step whose peers are a slice of the stack (the samples'
        gather, the gradient, the solver's update) as the graph of its shape, captured at its
        first call; and FedProx's anchor. None for models without their own batched layers or
        the linear model's closed form (both read only their arguments; the others swap a
        module's parameters: the LSTM, MobileNet), and for a solver other than SGD and the
        line search (FedLi-LS's, :meth:`_search_graphs`). pFedMe's and APFL's personal rows
        and FedLi's kept losses are read and written in place, in the stack's order. The
        round's step sizes, anchor and clients' corrections (SCAFFOLD's c - c_i, in the
        stack's ``order``) are copied into tensors held across rounds (``_hold``), which the
        graphs read: a value taken from the host at capture would stay the first round's (the
        lr schedule's factor), and a tensor made anew each round would be elsewhere."""
        if (self.step_graphs is None or type(self.solver) not in (LocalSGD, LocalArmijo)
                or not (self.forward.by_parameter or self.forward.closed_form)):  # fmt: skip
            return None, None
        solver, train = self.solver, self.train
        # what a graph reads, by its place: a new place (another stack) is another graph
        reads = [theta, opt_state.momentum, train.x, train.y]
        if getattr(self.surrogate, "step_reads_personal", True):
            reads += list(personal.values())
        if self.track_loss or self.line_search:  # (FedLi: each step keeps its loss)
            reads.append(self.last_loss)
        anchor = self._hold("anchor", theta) if solver.prox_mu else None
        if anchor is not None:
            reads.append(anchor)
        correction = None
        if self.client is not None:  # fixed within a round (the state changes after it)
            rows = slice(None) if order is None else order
            correction = self._hold("correction", self.client.correction(self.client_state, rows))
            reads.append(correction)
        if self.line_search:  # (its step sizes are its own: none held)
            return self._search_graphs(theta, opt_state, personal, anchor, correction, order,
                                       tuple(reads))  # fmt: skip
        if neg_step is not None:
            neg = self._hold("neg_step", neg_step)
            reads.append(neg)
        else:
            lr_scale = None if scale is None else self._hold("scale", scale)
            if "factor" not in self._held:  # (filled on the device: no upload)
                self._held["factor"] = torch.zeros((), dtype=torch.float64, device=self.device)
            lr_factor = self._held["factor"].fill_(factor)
            reads += [lr_factor] if lr_scale is None else [lr_scale, lr_factor]
        places = tuple(reads)

        def step(st, sw) -> None:
            def run(flat, sw, *b_w, sel=st.sel, shape=st.shape) -> None:
                x, y = train.take_flat(flat, shape)
                grad, loss = self.surrogate.shared_grad(self, theta[sel], personal, sel, x, y,
                                                        sw)  # fmt: skip
                if b_w:
                    self._keep_loss(loss, b_w[0], sel)
                if neg_step is not None:
                    theta[sel].add_(neg[sel] * grad)
                else:
                    corr = None if correction is None else correction[sel]
                    solver.step(theta, grad, opt_state, sel, lr_scale, lr_factor, anchor, corr,
                                record=False)  # fmt: skip

            key = (st.shape, st.sel == slice(None), solver, neg_step is None)
            kept = (st.weight,) if self.track_loss else ()  # (the batch's real samples)
            self.step_graphs(key, run, st.flat, sw, *kept, places=places)

        return step, anchor

    def _search_graphs(self, theta, opt_state, personal, anchor, correction, order, places):
        """:meth:`_step_graph` for FedLi-LS's line search (:class:`LocalArmijo`): a step is a
        graph of its start (the gradient, the search's values and the first trial), then,
        while a peer of the step is still searching (one value read back, as the eager form's
        nonzero), a graph of one more trial over all its peers (those done left as they are:
        no row count read back), then a graph of its end. The search's values lie in tensors
        held across rounds in the stack's order, each step's peers a slice: one graph reads
        what another wrote there, never its temporaries (the graphs share a memory pool)."""
        solver, train, L = self.solver, self.train, len(self.peers)
        per_epoch = self.batches_per_epoch
        batches = self._hold("batches", per_epoch if order is None else per_epoch[order])
        search = self._held.get("search")
        if search is None or search.g.shape != theta.shape or search.g.dtype != theta.dtype:
            f64 = torch.zeros(L, dtype=torch.float64, device=self.device)
            search = self._held["search"] = Search(
                torch.zeros_like(theta), f64, f64.clone(), f64.clone(), f64.clone(),
                torch.zeros(L, dtype=torch.bool, device=self.device),
            )  # fmt: skip
        places += (opt_state.eta, batches, *vars(search).values())
        last = solver.max_trials - 1

        def step(st, sw) -> None:
            sel, shape = st.sel, st.shape
            s = Search(*(v[sel] for v in vars(search).values()))

            def trial(x, y, sw, mean, last: bool) -> None:
                def loss_at(cand, _sub):  # (every peer of the step)
                    return self.surrogate.shared_loss(self, cand, x, y, sw) * mean

                rows = None if anchor is None else anchor[sel]
                solver.trial(theta[sel], s, loss_at, last, anchor=rows)

            def start(flat, sw, b_w) -> None:
                x, y = train.take_flat(flat, shape)
                grad, loss = self.surrogate.shared_grad(self, theta[sel], personal, sel, x, y,
                                                        sw)  # fmt: skip
                mean = self._keep_loss(loss, b_w, sel)
                corr = None if correction is None else correction[sel]
                begun = solver.begin(theta[sel], grad * mean[:, None, None], opt_state, sel,
                                     anchor, corr, loss * mean, batches[sel])  # fmt: skip
                for held, value in zip(vars(s).values(), vars(begun).values()):
                    held.copy_(value)
                trial(x, y, sw, mean, last == 0)

            def more(flat, sw, b_w, last: bool) -> None:
                x, y = train.take_flat(flat, shape)
                trial(x, y, sw, self._batch_mean(b_w, theta.dtype), last)

            def end() -> None:
                solver.end(theta, opt_state, sel, theta[sel], s)

            key = (shape, sel == slice(None), solver)
            self.step_graphs((key, "start"), start, st.flat, sw, st.weight, places=places)
            for k in range(1, solver.max_trials):
                if not bool(s.pending.any()):  # (a wait for a GPU)
                    break
                self.step_graphs((key, "trial", k == last), partial(more, last=k == last),
                                 st.flat, sw, st.weight, places=places)  # fmt: skip
            self.step_graphs((key, "end"), end, places=places)

        return step, anchor

    def _hold(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A tensor of the trainer's kept across rounds (made again if ``value``'s shape or
        type changes), holding ``value``'s values."""
        held = self._held.get(name)
        if held is None or held.shape != value.shape or held.dtype != value.dtype:
            held = self._held[name] = torch.empty_like(value, device=self.device)
        return held.copy_(value)

    @property
    def _eta_by_round(self) -> bool:
        """The round's step sizes are recorded once, after its steps (:meth:`_record_eta`):
        the steps of :class:`LocalSGD` (plain or not) all take the round's size. A line
        search's differ by step: it records them itself."""
        return type(self.solver) is LocalSGD

    def _record_eta(self, opt_state, factor: float, taken: np.ndarray) -> None:
        """The step size each peer took last (FedLi's clients send it): lr x the schedule's
        factor x the peer's multiplier, where ``taken`` (L,) says it took a step this round.
        A round of the run's state like its last one (the same factor and peers stepping)
        finds them recorded: no operation."""
        took = taken > 0
        key = (factor, took.tobytes()) if opt_state is self.opt_state else None
        if (key is not None and key == self._eta_recorded) or not took.any():
            return
        eta = (self.solver.lr * factor) * self.lr_scale.double()
        opt_state.eta.copy_(torch.where(self.steps_taken > 0, eta, opt_state.eta))
        self._eta_recorded = key

    def _plain_sgd(self) -> bool:
        """The local solver is plain SGD (no momentum, decay, proximal term, line search or
        rule correction) and no rule reads the loss."""
        plain = self.solver.plain and self.client is None and not self.track_loss
        return plain and not self.line_search

    def _affine_sgd(self) -> bool:
        """SGD, plain (:meth:`_plain_sgd`) or taking momentum, adding terms linear in the
        parameters (FedProx's proximal term, weight decay, SCAFFOLD's correction) or keeping
        its loss for the rule (FedLi-LU), no line search: the round's steps are fused
        (:meth:`BatchedForward.linear_sgd_round`; with the compiled CPU loops one call)."""
        return type(self.solver) is LocalSGD and not self.line_search

    def _affine_terms(self, neg: np.ndarray) -> tuple[np.ndarray | None, torch.Tensor | None]:
        """The fused round's added terms times each peer's -lr (``neg``, (L,) float32; 1
        with momentum): (L, 2) the proximal term's and the weight decay's coefficients or
        None (neither), and (L, M, P) SCAFFOLD's correction c - c_i on the device (fixed
        within a round) or None."""
        solver, coef = self.solver, None
        if solver.prox_mu or solver.weight_decay:
            # a term that is off is 0, not neg * 0 (NaN where an overflowing lr made neg
            # infinite)
            coef = np.stack([neg * np.float32(c) if c else np.zeros_like(neg)
                             for c in (solver.prox_mu, solver.weight_decay)], axis=1)  # fmt: skip
        if self.client is None:
            return coef, None
        corr = self.client.correction(self.client_state, slice(None))
        return coef, self.uploads("neg_step", neg)[:, None, None] * corr

    @property
    def fuses_e_step(self) -> bool:
        """The round's compiled loop works a mixture's E-step out per peer, just before its
        steps (:class:`gossip_pfl.runtime.stack.PendingEStep`): SGD (no line search) on the
        binary linear model with the compiled CPU loops."""
        return self.forward.kernels and self._affine_sgd() and self._fused_linear()

    def _fused_linear(self) -> bool:
        """The whole round's SGD steps in closed form (stack.linear_sgd_round): the binary
        linear model, a loss without a personal part (FedEM, FedAvg, local, ...)."""
        return (
            self.forward.closed_form
            and self.task == "binary"
            and type(self.surrogate) is MixtureSurrogate
        )

    def _armijo_linear(self) -> bool:
        """The line search (FedLi-LS's clients) as one compiled call a round: the binary
        linear model under a mixture or plain-risk surrogate, with the compiled CPU loops,
        no client correction."""
        return (self.line_search and self.forward.kernels and self.client is None
                and self._fused_linear())  # fmt: skip

    def _personal_linear(self) -> bool:
        """A personal-model surrogate (pFedMe, APFL: ``compiled_steps``) on the binary linear
        model's closed form: its evaluated model is one sigmoid, scored as a mixture of one
        (:meth:`scores`), and with the compiled CPU loops its round's steps are one call."""
        return (self.forward.closed_form and self.task == "binary"
                and hasattr(self.surrogate, "compiled_steps"))  # fmt: skip

    def _personal_fused(self) -> bool:
        """pFedMe's or APFL's round is fused (:meth:`BatchedForward.linear_sgd_round`; with
        the compiled CPU loops one call, :func:`gossip_pfl.runtime.kernels.personal_round`),
        where no rule reads the loss (the fused round keeps none for them; a line search's
        rule is refused for them)."""
        return self._personal_linear() and not self.track_loss

    def _personal_compiled(self) -> bool:
        """:meth:`_personal_fused` with the compiled CPU loops (their loop is loaded)."""
        return self.forward.kernels and self._personal_fused()

    def communicate(self, t: int, active: np.ndarray | None = None) -> None:
        """Deliver the peers' messages along the route and apply the rule: on the star, the
        hub's rule between the up and down phases; in gossip, each peer's rule after W_t's
        phases; or the rule's own phase (Sattler et al.'s split rule)."""
        if self.route == "none":
            return
        L = len(self.peers)
        active = np.ones(self.n_peers, dtype=bool) if active is None else active
        phases, keys = self.phases(t, active)
        hook = None
        if self.route == "star":
            hub_theta = self.nodes[L:].clone() if self.rule.needs_theta else None
            hook = lambda rows: self._hub(rows, hub_theta, active)  # noqa: E731
        outbox = self.outbox or {"theta": self.nodes[:L]}
        received = self.bundle.unpack(self._mix(self._pack(outbox), phases, keys, hook))
        theta = received["theta"]
        # each peer's rule (the plain average is what W_t's phases delivered; a rule that does
        # not read the round-start model gets None, as on the hub)
        if self.route == "gossip" and not isinstance(self.rule, Average):
            act = self.uploads("rule_active", active[self.peers])  # (not waiting on a GPU)
            inbox = Inbox({k: v[:L] for k, v in received.items()})
            new, state = self.rule.update(inbox, self.rule_state, self.start)
            self.rule_state = {k: _where(act, v, self.rule_state[k]) for k, v in state.items()}
            # in the received rows' place; the peers' clients below receive the rule's
            # models, as from a hub
            theta[:L] = _where(act, new, self.nodes[:L])
        if theta.is_contiguous():  # the exchange's double buffers, taken in turn
            self.nodes = theta
        else:  # a view of wider message rows: copied into the stack, which keeps its place
            self.nodes.copy_(theta)  # (a CUDA graph keyed on its address then stays valid)
        self._mixed_round = t  # (settle checks what the rule made)
        if self.client is not None:
            mine = {k: v[:L] for k, v in received.items()}
            self.client_state = self.client.receive(self.client_state, mine)
        self.outbox = None

    def phases(self, t: int, active: np.ndarray) -> tuple[list, list | None]:
        """The round's mixing phases along the route, and their plan-cache keys (None: plan
        anew, for phases that change from round to round)."""
        full = bool(active.all())
        if self.route == "rule":  # the rule splits its groups from every peer's update
            delta = (self.nodes[: len(self.peers)] - self.start).flatten(1).double()
            self.rule_state = self.rule.split(self.rule_state, self.rows_of(delta).cpu().numpy())
            return [self.rule.phase(self.rule_state, self.sizes.astype(np.float64))], None
        if self.route == "star":
            keys = [("star", 0) if full else None, ("star", 1)]  # down: whoever took part
            return star_phases(active, self.agg_weights), keys
        phases = [sit_out(p, active) for p in self.schedule.phases(t)]
        if self.gossip_by_size:
            phases = [weight_by_size(p, self.sizes) for p in phases]
        period = self.schedule.period
        keys = [(t % period, k) for k in range(len(phases))] if period and full else None
        return phases, keys

    def _pack(self, outbox: dict) -> torch.Tensor:
        """This rank's message rows (local nodes, width); a hub row starts as zeros."""
        if self.bundle.plain:
            return self.nodes.view(self.n_local_nodes, -1)
        L = len(self.peers)
        flat = self.nodes.new_zeros((self.n_local_nodes, self.bundle.width))
        self.bundle.pack(outbox, out=flat[:L])
        return flat

    def _hub(self, rows: torch.Tensor, hub_theta, active: np.ndarray) -> None:
        """Between the star's up and down phases, on the hub's rank: the rule turns the
        participants' average into the model (and tensors) the hub sends back."""
        L = len(self.peers)
        clients = {}
        if self.rule.per_client:  # the participants' rows by their indices: no wait on a GPU
            at = self.uploads("hub_active", np.flatnonzero(active))
        for name in self.rule.per_client:  # a gather: every rank joins it
            table = self.rows_of(self.outbox[name].double()[:, None])[:, 0]
            clients[name] = table.index_select(0, at)
        if self.comm.rank != 0:
            return
        mass = float(self.agg_weights[active].sum() / self.agg_weights.sum())
        inbox = Inbox(self.bundle.unpack(rows[L:]), clients, mass)
        new, self.rule_state = self.rule.update(inbox, self.rule_state, hub_theta)
        if new.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr():
            new = new.clone()  # the plain average is a view of the rows it is written to
        reply = {"theta": new, **{k: self.rule_state[k] for k in self.rule.tensors}}
        reply.update({k: torch.zeros(1, device=self.device) for k in self.rule.scalars})
        self.bundle.pack(reply, out=rows[L:])

    def _mix(self, flat, phases, keys, hook=None) -> torch.Tensor:
        """Mix ``flat`` (local nodes, width) through ``phases``, with ``hook(rows)`` after the
        first; counts the traffic by message kind."""
        for k, phase in enumerate(phases):
            # double buffering: the previous state becomes the next output (no fresh pages);
            # the first one is zeros, not garbage, in case a kernel reads it despite beta = 0
            spare = self._spare.pop(flat.shape, None)
            spare = torch.zeros_like(flat) if spare is None else spare
            self.comm.set_tag(self.round, k)  # a p2p peer queues later phases, drops earlier
            plan = self.exchanger.plan(phase, keys[k] if keys else None)
            new = self.exchanger.mix(flat, plan, out=spare)
            self._spare[flat.shape], flat = flat, new
            # what the peers would send with one peer per machine, whatever the placement
            for kind, b in self.bundle.bytes_by_kind(phase.messages, flat.element_size()).items():
                self.kind_bytes[kind] += b
            if hook is not None and k == 0:  # the hub, between the star's up and down phases
                hook(flat)
        return flat

    def peer_pieces(self, n_peers: int, batch: int) -> list[slice]:
        """Slices of the peer axis with at most ``step_chunk`` samples each (0: one piece); a
        piece holds at least one peer. Where pieces run at once (:meth:`map_pieces`), they
        are of even sizes and at least as many as the threads: a step of a few peers (the
        end of the big clients' epochs) would otherwise run as one piece, each operation
        split over the threads."""
        chunk = self.step_chunk
        per = max(1, n_peers if chunk <= 0 else chunk // max(1, batch))  # >= 1: a range step
        threads = self.forward.piece_threads(self.device)
        if chunk <= 0 or threads <= 1 or n_peers == 0:
            return [slice(k, min(k + per, n_peers)) for k in range(0, n_peers, per)]
        return even_pieces(n_peers, max(-(-n_peers // per), min(threads, n_peers)))

    def map_pieces(self, fn: Callable, pieces: list) -> list:
        """``fn`` over independent pieces of the peer axis, ``BatchedForward.piece_threads``
        at a time, each on one thread (``runtime/threads.py: map_pieces``)."""
        return map_pieces(fn, pieces, self.forward.piece_threads(self.device))

    def map_chunks(self, fn: Callable, split: PaddedSplit, active=None) -> list:
        """``fn(rows, at, sample slice, x, y, mask)`` over the evaluation-sized chunks of
        ``split`` (``PaddedSplit.chunk_plan``), through :meth:`map_pieces`; each chunk's
        inputs are gathered when it runs. ``at`` indexes the chunk's rows: a slice for a
        chunk of every peer (views, and on a GPU no indexing kernel: a deterministic
        ``index_put_`` sorts its indices), else ``rows``."""
        split.mask  # noqa: B018 - a cached property, built here rather than by two chunks
        plan = split.chunk_plan(self.eval_chunk, active, self.uploads)
        return self.map_pieces(lambda p: fn(p[0], p[1], *split.inputs(*p)[1:]), plan)

    # ---- measurements ---------------------------------------------------------------------
    @torch.no_grad()
    def train_losses(
        self,
        theta: torch.Tensor,
        split: PaddedSplit | None = None,
        active: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Every sample's loss under every component: (L, M, N_max), 0 on padding (training
        data by default). ``active`` (L,) bool: only those peers' are needed, and the others'
        rows are 0, except on the binary linear model's closed form (one product gives every
        row at once)."""
        split = split or self.train
        if self.forward.closed_form and self.task == "binary":
            return self.forward.linear_losses(theta, split, self.eval_chunk)
        losses = torch.zeros(*theta.shape[:2], split.y.shape[1], device=self.device)

        def chunk(_rows, at, sl, x, y, _mask) -> None:  # the chunks' places do not overlap
            losses[at, :, sl] = sample_loss(self.forward(theta[at], x), y, self.task)

        self.map_chunks(chunk, split, active)
        return losses

    @torch.no_grad()
    def evaluate_unseen(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Clients held out of training: download the peers' average components (fine-tuned
        on the client's own training data with ``eval.finetune_epochs``, FedAvg+; else kept
        fixed), fit pi to maximum likelihood on that data (to the optimum, or one EM step
        from uniform as in the paper), then evaluate (every client has training data:
        :func:`client_ids`). Under Clustered FL a client takes the cluster model of least
        loss on its training data instead."""
        n_unseen = len(self.unseen_ids)
        theta = self.nodes[: len(self.peers)].double().sum(0)
        theta_bar = (self.comm.all_reduce_sum(theta) / self.n_peers).to(self.nodes.dtype)
        clusters = self.cluster_models() if self.route == "rule" else None  # (every rank)
        if self.unseen_train is None:
            zero = torch.zeros(0, device=self.device)
            return tuple(self.gather([zero, zero, zero], [], n_unseen))
        u = len(self.unseen_pos)
        theta_u = theta_bar.expand(u, *theta_bar.shape)
        if clusters is not None:
            theta_u = self.nearest_cluster(clusters, theta_u)
        personal = self.surrogate.init_personal(self.unseen_ids[self.unseen_pos], theta_bar)
        if self.finetune_epochs:  # FedAvg+: the local epochs a seen peer takes, on its own data
            theta_u = theta_u.clone()
            with torch.enable_grad():
                self.finetune_unseen(theta_u, personal)
        if self.M > 1:
            losses = self.train_losses(theta_u, self.unseen_train)
            steps = 1 if self.cfg.eval.unseen_em == "one_step" else 100
            personal["pi"] = fit_mixture_weights(losses, self.unseen_train.mask, steps)
        theta_u = self.surrogate.eval_state(theta_u, personal)  # pFedMe, APFL: personal models
        nll, acc = self.scores(self.unseen_test, theta_u, personal)
        return tuple(self.gather([nll, acc, self.unseen_test.counts], self.unseen_pos, n_unseen))

    def cluster_models(self) -> torch.Tensor:
        """Clustered FL's model of each cluster (C, M, P): after a round every member holds
        its cluster's average; the first member's, sent by its rank (a sum with zeros, so
        the same on any number of ranks; all ranks join it)."""
        labels = self.rule_state["labels"].cpu().numpy()
        first = np.unique(labels, return_index=True)[1]  # each cluster's first member
        models = self.nodes.new_zeros((len(first), *self.nodes.shape[1:]))
        here = np.isin(first, self.peers)
        at = np.searchsorted(self.peers, first[here])  # (this rank's peers are sorted)
        mask, rows = (torch.as_tensor(a, device=self.device) for a in (here, at))
        models[mask] = self.nodes[rows]
        return self.comm.all_reduce_sum(models)

    def nearest_cluster(self, clusters: torch.Tensor, theta_u: torch.Tensor) -> torch.Tensor:
        """Each unseen client's cluster model of least mean loss on its own training data
        (every client has some: :func:`client_ids`). (Our choice: Sattler et al. sort a new
        client down their tree of splits by the cosine similarity of its update.)"""
        # the cluster models as one client's components (Clustered FL trains one model):
        # every client's loss under every cluster model in one call, (U, C, N); the least
        # total is the least mean, a client's count dividing every cluster's alike
        as_components = clusters[:, 0].expand(len(theta_u), *clusters[:, 0].shape)
        loss = self.train_losses(as_components, self.unseen_train).double().sum(2)
        return clusters[loss.argmin(1)]

    def keys_before(self) -> dict:
        """Before ``algorithm.loss_divisor`` existed, every minibatch was divided by B."""
        return {"algorithm.loss_divisor": "batch_size"}

    def finetune_unseen(self, theta: torch.Tensor, personal: dict) -> None:
        """``eval.finetune_epochs`` of plain SGD at ``algorithm.lr`` on each unseen client's
        training data, in place on ``theta`` (U, M, P) and ``personal``: what :meth:`evaluate`
        does for the seen peers (no momentum, decay or rule correction; minibatches from stream 1 of
        (seed, client, round)), through the surrogate's generic gradient."""
        split, a = self.unseen_train, self.cfg.algorithm
        ids = self.unseen_ids[self.unseen_pos]
        idx, weight = round_batches(split.counts.cpu().numpy(), ids, self.cfg.seed, self.round,
                                    a.batch_size, self.finetune_epochs, stream=1,
                                    mean=a.loss_divisor == "batch")  # fmt: skip
        for st in step_plan(idx, weight, split.y.shape[1], self.device, upload=self.uploads)[0]:
            x, y = split.take_flat(st.flat, st.shape)
            sw = st.weight[:, None, :].expand(-1, self.M, -1)
            grad, _ = self.surrogate.shared_grad(self, theta[st.sel], personal, st.rows, x, y, sw)
            theta.index_add_(0, st.rows, grad, alpha=-a.lr)

    @torch.no_grad()
    def consensus_distance(self) -> list[float]:
        """(1/n) sum_i ||theta_{m,i} - theta_bar_m||^2 per component, over all ranks."""
        theta = self.nodes[: len(self.peers)].double()
        mean = self.comm.all_reduce_sum(theta.sum(0)) / self.n_peers
        diff = theta - mean  # squared by a product: pow's first call on a GPU takes 35 ms
        dist2 = (diff * diff).sum(dim=(0, 2))
        return (self.comm.all_reduce_sum(dist2) / self.n_peers).tolist()

    @torch.no_grad()
    def scores(self, split: PaddedSplit, theta, personal) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row (mean log-loss, accuracy) of the personalized prediction on ``split``."""
        counts = split.counts.double().clamp_min(1)
        if self._fused_linear() or self._personal_linear():  # a mixture of sigmoids
            # (pFedMe's and APFL's evaluated model: a mixture of one, of weight 1)
            pi = personal["pi"] if self._fused_linear() else theta.new_ones(theta.shape[:2])
            nll, correct = self.forward.linear_mixture_scores(theta, pi, split, self.eval_chunk)
            return nll / counts, correct / counts
        correct = torch.zeros(theta.shape[0], device=self.device, dtype=torch.float64)
        nll = torch.zeros_like(correct)

        def chunk(rows, at, _sl, x, y, m) -> tuple:
            mine = {k: v[at] for k, v in personal.items()}
            probs = self.surrogate.predict(self.forward(theta[at], x), mine)
            p_true = probs.gather(-1, y[..., None])[..., 0].clamp_min(1e-12)
            hits = ((probs.argmax(-1) == y).float() * m).sum(-1).double()
            return rows, (-torch.log(p_true) * m).sum(-1).double(), hits

        # a peer's samples may span chunks: the sums are added here, in the chunks' order
        for rows, part, hits in self.map_chunks(chunk, split):
            nll.index_add_(0, rows, part)
            correct.index_add_(0, rows, hits)
        return nll / counts, correct / counts

    def gather(self, values: list[torch.Tensor], positions, total: int) -> np.ndarray:
        """Rows computed on each rank -> (len(values), total) array on every rank."""
        rows = torch.stack([v.double() for v in values], 1)  # (A, len(values))
        return gather_rows(self.comm, rows, positions, total).T.cpu().numpy()

    def evaluate(self, split: PaddedSplit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-peer (loss, accuracy, count) gathered as length-n arrays (training-peer order).
        With ``eval.finetune_epochs`` (FedAvg+), a copy of each peer's model first takes that
        many local epochs of plain SGD (no momentum, decay or rule correction), as FedAvg+ does."""
        theta = self.nodes[: len(self.peers)]
        personal = self.personal
        if self.finetune_epochs:
            theta = theta.clone()
            personal = {k: v.clone() for k, v in personal.items()}
            plain = LocalSGD(self.cfg.algorithm.lr)
            kept = self.last_loss.clone()  # (FedLi's losses for the rule are the round's)
            saved = (self.solver, self.client, self.line_search, self.lr_scale, self.unit_scale,
                     self._lr_scale_np)  # fmt: skip
            try:
                self.solver, self.client, self.line_search = plain, None, False
                # at lr itself, as an unseen client's: gossip's client weighting scales a
                # training step by T n_i / n (a seen client's fine-tune took 0.5 to 1.6 lr)
                self.lr_scale, self.unit_scale = torch.ones_like(self.lr_scale), True
                self._lr_scale_np = np.ones(self.lr_scale.shape, dtype=np.float32)
                self.local_steps(
                    theta, None, plain.init(theta), self.round, self.finetune_epochs,
                    personal=personal, stream=1,
                )  # fmt: skip
            finally:
                (self.solver, self.client, self.line_search, self.lr_scale, self.unit_scale,
                 self._lr_scale_np) = saved  # fmt: skip
                self.last_loss.copy_(kept)
        theta = self.surrogate.eval_state(theta, personal)
        nll, acc = self.scores(split, theta, personal)
        return tuple(self.gather([nll, acc, split.counts], self.peers, self.n_peers))

    def _check_finite(self, t: int, theta: torch.Tensor) -> None:
        """Stop when a peer's parameters became NaN/inf in round ``t`` (naming the first).

        On the devices of :data:`QUEUE_CHECK_ON` (a GPU), with one process or collectives, the
        check is queued, not waited for: its answer comes back to the host without a
        synchronisation, and is read at the next check or before a log or checkpoint
        (:meth:`settle`), so a bad round is never logged or saved. Peers that exchange without
        collectives check at once: one that went bad stops before it sends its parameters."""
        self._finite_checked()  # the last round's first: one in the queue (its buffer is reused)
        flat = theta.view(theta.shape[0], -1)
        # and the peers' private state (APFL's and pFedMe's models, alpha, FedEM's pi): an
        # APFL run whose personal models went NaN ended with exit 0, its losses NaN
        # (dtype and shape read in Python: no operation dispatched where none is needed)
        parts = [
            flat,
            *(
                v if v.dim() == 2 else v.reshape(v.shape[0], -1)
                for v in self.personal.values()
                if v.dtype.is_floating_point and v.dim() and v.shape[0] == flat.shape[0]
            ),
        ]
        multi = self.comm.world_size > 1 and self.collectives
        queue = self.device.type in QUEUE_CHECK_ON and (self.comm.world_size == 1 or multi)
        if not queue and not multi and flat.numel():
            if not all(_all_finite(part) for part in parts):  # (the first bad peer in any
                bad = sum((~torch.isfinite(part)).any(-1) for part in parts)  # part: as queued)
                self._raise_not_finite(t, int(bad.nonzero()[0, 0]) + 1, 1)
            return
        if multi:  # (first bad peer here + 1 or 0, the same summed over the ranks), on the device
            flag = torch.zeros(2, dtype=torch.float64, device=self.device)
            if flat.numel():
                lo, hi = _row_bounds(parts)
                bad = ~(torch.isfinite(lo) & torch.isfinite(hi))
                first = bad.to(torch.uint8).argmax() + 1  # the first True (argmax: the first)
                flag[:] = torch.where(bad.any(), first, 0).double()
            self.comm.all_reduce_sum(flag[1:])
        elif not flat.numel():
            return
        else:  # one process: each peer's smallest and largest value, read on the host (two
            # operations and the copy where the flag took a dozen: on a GPU, host time)
            flag = torch.stack(_row_bounds(parts))  # (2, L)
        self._finite_pending = (t, flag)
        if not queue:
            return self._finite_checked()
        if self.device.type != "cuda":  # (a test queues it on the CPU)
            return
        host = self._finite_host  # one page-locked buffer: read before the next copy
        if host is None or host.shape != flag.shape or host.dtype != flag.dtype:
            host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
            self._finite_host = host
        host.copy_(flag, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self._finite_pending = (t, host, done)

    def settle(self) -> None:
        self._finite_checked()
        # the models the last round's rule made: the next round's local work checks them,
        # but a log or a checkpoint comes first (the last round's were never checked)
        t, self._mixed_round = self._mixed_round, None
        if t is not None:
            self._check_finite(t, self.nodes[: len(self.peers)])
            self._finite_checked()

    def _finite_checked(self) -> None:
        """Read a queued :meth:`_check_finite` (none: nothing to do): the ranks' summed flag
        (first bad row + 1 here, any anywhere), or one process's (2, L) smallest and largest
        value of each row."""
        if self._finite_pending is None:
            return
        t, flag, *done = self._finite_pending
        self._finite_pending = None
        if done:
            done[0].synchronize()  # the copy to the host, queued before the round's exchange
        if flag.dim() == 2:  # (host memory: the page-locked copy, or a CPU's own)
            lo_hi = flag if flag.dtype in (torch.float32, torch.float64) else flag.float()
            ok = np.isfinite(lo_hi.numpy()).all(0)
            first = worst = 0 if ok.all() else int(np.argmin(ok)) + 1
        else:
            first, worst = (int(v) for v in flag.tolist())
        if worst:
            self._raise_not_finite(t, first, worst)

    def _raise_not_finite(self, t: int, first: int, worst: int) -> None:
        """``first``: this rank's first bad row + 1 (0: none here); ``worst`` nonzero: some
        rank has one."""
        peer = f"peer {int(self.peers[first - 1])}" if first else "peer ?"
        a, r = self.cfg.algorithm, self.cfg.rule
        # every step size or weight the config set, not only algorithm.lr (a weight decay of
        # 1e10 was blamed on the learning rate)
        reads = RULE_KEYS.get(r.name or self.spec.rule, ())  # the rule's own steps too
        steps = [("algorithm.lr", a.lr), ("algorithm.momentum", a.momentum or None),
                 ("algorithm.weight_decay", a.weight_decay or None), ("algorithm.mu", a.mu or None),
                 ("algorithm.personal_lr", a.personal_lr), ("rule.lr", r.lr),
                 *((f"rule.{k}", getattr(r, k)) for k in ("eta", "lam") if k in reads)]  # fmt: skip
        named = ", ".join(f"{k} (now {v:g})" for k, v in steps if v is not None)
        raise GossipError(
            f"round {t + 1}: the parameters of a peer (first: {peer} on rank "  # rounds from 1
            f"{self.comm.rank}) became NaN/inf; lower the steps: {named}"
        )

    # ---- checkpoints ----------------------------------------------------------------------
    def rows_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """A per-peer tensor (L, ...) of this rank -> (n, ...) in peer order on every rank."""
        return gather_rows(self.comm, tensor, self.peers, self.n_peers)

    def checkpoint(self, out: Path, rounds_done: int, rows: list) -> None:
        """Every peer's shared and private state, optimizer state and counters, saved by
        rank 0 (all ranks take part in the gather)."""
        L = len(self.peers)
        state = {
            "rounds_done": rounds_done,
            "config": to_dict(self.cfg),
            "data": self.data_state(),
            "shared": self.rows_of(self.nodes[:L]).cpu(),
            "aux": self.nodes[L:].cpu() if self.comm.rank == 0 else None,
            "personal": {k: self.rows_of(v).cpu() for k, v in self.personal.items()},
            "momentum": self.rows_of(self.opt_state.momentum).cpu(),
            "eta": self.rows_of(self.opt_state.eta).cpu(),
            "rule_state": self._rule_state_rows(),
            "client_state": {k: self.rows_of(v).cpu() for k, v in self.client_state.items()},
            "times": dict(self.times),
            "kind_bytes": dict(self.kind_bytes),
            "traffic": self.traffic(),
            "rows": rows,
        }
        if self.comm.rank == 0 or not self.collectives:  # p2p: each process its own
            checkpoint.save(state, out)

    def _rule_state_rows(self) -> dict | None:
        """The rule's state for a checkpoint: the hub's (rank 0), each peer's in peer order
        (gossip; every rank joins the gather), or the replicated one."""
        if self.route == "gossip":
            return {k: self.rows_of(v).cpu() for k, v in self.rule_state.items()}
        return {k: v.cpu() for k, v in self.rule_state.items()}

    def restore(self, out: Path, name: str | None = None) -> tuple[int, list]:
        """Load RUN_DIR/checkpoint.pt (or RUN_DIR/``name``) into this rank's peers; returns
        (first round, rows)."""
        # digest checked: altered or cut files stop
        state = self.load_checkpoint(out, name or checkpoint.FILE)
        where = f"--resume {out}"
        self.check_config(state, where)  # a changed key, named before the shapes it changes
        self.check_data(state, where)
        # keys, shapes, peer count and components, before any of this rank's state is touched
        checkpoint.check_structure(state, self.n_peers, tuple(self.nodes.shape[1:]), where=where)
        self.check_resumable(state, where)
        checkpoint.check_like(state["kind_bytes"], self.kind_bytes, "kind_bytes", where)
        traffic = {"bytes_sent": 0, "messages_sent": 0, "bytes_sent_per_rank": [],
                   "messages_sent_per_rank": []}  # fmt: skip
        checkpoint.check_like(state["traffic"], traffic, "traffic", where)
        idx = torch.as_tensor(self.peers)
        L = len(self.peers)
        self.nodes[:L] = state["shared"][idx].to(self.device)
        if self.comm.rank == 0 and state["aux"] is not None:
            self.nodes[L:] = state["aux"].to(self.device)
        self.personal = {k: v[idx].to(self.device) for k, v in state["personal"].items()}
        self.opt_state.momentum.copy_(state["momentum"][idx])
        self.opt_state.eta.copy_(state["eta"][idx])
        self._eta_recorded = None
        saved = {k: v.to(self.device) for k, v in (state["rule_state"] or {}).items()}
        if self.route == "gossip":  # per peer, saved in peer order
            self.rule_state = {k: v[idx.to(self.device)] for k, v in saved.items()}
        elif self.route != "star" or self.comm.rank == 0:  # the hub's, or replicated
            self.rule_state = saved
        self.client_state = {k: v[idx].to(self.device) for k, v in state["client_state"].items()}
        self._finite_pending = None  # a check of a round the checkpoint rolls back
        self.times = dict(state["times"])
        self.kind_bytes = dict(state["kind_bytes"])
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
        test = self.evaluate(self.test)
        te_acc = test[1]
        row = {
            "round": t + 1,
            **score_entries(self.evaluate(self.train), test),
            "consensus_distance": self.consensus_distance(),
            **self.traffic(),
            "seconds_local": self.times["local"],
            "seconds_exchange": self.times["exchange"],
            "client_test_accuracy": client_accuracies(te_acc, test[2]),
            **self.mixture_usage(),
        }
        if len(self.unseen_ids):
            _, acc, n = self.evaluate_unseen()
            row.update(unseen_entries(acc, n))
        return row

    def mixture_usage(self) -> dict:
        """Each component's mean mixture weight over the training peers, and how many peers
        put their largest weight on it: a component dying out or taking over every client
        shows here (empty without mixture weights)."""
        pi = self.gathered_pi()
        return {} if pi is None else mixture_entries(pi)

    def gathered_pi(self) -> np.ndarray | None:
        """Every training peer's mixture weights (n, M), on every rank; None for one model."""
        if self.M == 1 or "pi" not in self.personal:
            return None
        return self.gather(list(self.personal["pi"].T), self.peers, self.n_peers).T

    def traffic(self) -> dict:
        """Traffic so far: ``model_bytes`` as if every peer were its own machine (the
        route's messages x the message's size; by message kind in ``model_bytes_by_kind``),
        and the bytes and messages this run's ranks actually sent to each other, in total and
        per rank."""
        sent = torch.zeros(2, self.comm.world_size, dtype=torch.float64, device=self.device)
        sent[0, self.comm.rank] = self.exchanger.bytes_sent
        sent[1, self.comm.rank] = self.exchanger.messages_sent
        sent = (self.comm.all_reduce_sum(sent) if self.collectives else sent).cpu()
        sent = sent.numpy().astype(np.int64)
        return {
            "model_bytes": int(sum(self.kind_bytes.values())),
            "model_bytes_by_kind": {k: int(v) for k, v in self.kind_bytes.items()},
            "bytes_sent": int(sent[0].sum()),
            "messages_sent": int(sent[1].sum()),
            "bytes_sent_per_rank": sent[0].tolist(),
            "messages_sent_per_rank": sent[1].tolist(),
        }

    def summary(self, last: dict, wall: float) -> dict:
        # how well the mixture weights find the synthetic data's groups (empty: no groups)
        extra = recovery_entry(self.dataset.meta.get("pi"), self.gathered_pi(), self.train_ids)
        return {
            **extra,
            "algorithm": self.cfg.algorithm.name,
            "rule": self.rule.name,
            "participation": self.n_active,
            "rounds": self.cfg.rounds,
            "test_accuracy": last["test_accuracy"],
            "test_accuracy_p10": last["test_accuracy_p10"],
            "test_accuracy_weighted": last["test_accuracy_weighted"],
            "train_accuracy": last["train_accuracy"],
            "train_loss": last["train_loss"],
            "consensus_distance": last["consensus_distance"],
            "wall_seconds": wall,
            "world_size": self.comm.world_size,
            # another thread count rounds the convolutions differently (docs/results.md)
            "torch_threads": torch.get_num_threads(),
            "bytes_sent": last["bytes_sent"],
            "client_test_accuracy": last["client_test_accuracy"],
            **{k: v for k, v in last.items() if k.startswith(("unseen_", "mixture_"))},
        }

    def run(self, resume: bool = False) -> dict:
        if not resume:
            self.check_fresh()
        return super().run(resume)

    def check_fresh(self) -> None:
        """A fresh start's checks that need the data (a resume goes on as it started, as
        validate's checks of keys it does not read do): eval.unseen_em where no client is
        held out ran unheeded."""
        em = self.cfg.eval.unseen_em
        if em != EvalConfig.unseen_em and not len(self.unseen_ids):
            raise GossipError(f"config key 'eval.unseen_em' is {em!r} but the data holds no "
                              "unseen clients (data.unseen_fraction)")  # fmt: skip

    def describe(self) -> str:
        """The run's first log line: it names the schedule actually used."""
        k, n = self.n_active, self.n_peers
        sched = {
            "star": f"server (a hub averages {k} of {n} clients a round, "
            f"{self.cfg.aggregation} weights)",
            "gossip": f"gossip {self.schedule!r}"
            + (f", {k} of {n} peers a round" if k < n else ""),
            "rule": f"the rule's own ({self.rule.name})",
            "none": "none (W = I)",
        }[self.route]
        return (
            f"{self.cfg.algorithm.name}: schedule {sched}, rule {self.rule.name}, "
            f"{self.placement.describe()}, M = {self.M}, {self.layout.numel} parameters per "
            f"component, device {self.device}, {self.threads}, "
            f"local work {self.forward.describe()}"
            + (", its steps as CUDA graphs by shape" if self.step_graphs is not None else "")
            + (", the E-step as a CUDA graph" if self.e_step_graphs is not None else "")
        )

    def shared_parameters(self) -> np.ndarray:
        """This rank's peers' shared state (L, M, P) as a numpy array (for tests)."""
        return self.nodes[: len(self.peers)].detach().cpu().numpy()


def _row_bounds(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's smallest and largest value over ``parts`` (each (L, k), the same rows; NaN
    propagates: aminmax, then minimum and maximum, one pass each, no temporary)."""
    lo, hi = torch.aminmax(parts[0], dim=1)
    for part in parts[1:]:
        if part.numel():
            lo2, hi2 = torch.aminmax(part.to(lo.dtype), dim=1)
            lo, hi = torch.minimum(lo, lo2), torch.maximum(hi, hi2)
    return lo, hi


def _all_finite(x: torch.Tensor) -> bool:
    """Every value of ``x`` is finite. On a CPU, NumPy's check on a view: torch's reductions
    wake its OpenMP threads every time (130 against 23 us a round for the synthetic D-FedEM's
    136,000 values on 2 cores). Elsewhere one reduction: the largest |value| is finite iff
    all are (NaN propagates through amax), a fifth of isfinite's time."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad:
        return bool(np.isfinite(x.numpy()).all())
    return bool(torch.isfinite(x.abs().amax()))


def _per_peer(key: str, v: torch.Tensor, peers: int) -> torch.Tensor:
    """A personal tensor a step reads by its rows (one a peer), or an error naming it: the
    trainer puts those rows in the stack's order for a reordered round."""
    if v.shape[:1] != (peers,):
        raise RuntimeError(
            f"personal state {key!r} has shape {tuple(v.shape)}: a surrogate "
            f"whose steps read personal rows holds one row per peer ({peers})"
        )
    return v


def _where(mask: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Per-row choice: ``new`` where ``mask`` (L,) is set, else ``old``."""
    return torch.where(mask.view(-1, *([1] * (new.dim() - 1))), new, old)


#: workload name (AlgorithmSpec.workload) -> its RoundLoop class, or "module:Class" (imported
#: when a run uses it)
WORKLOADS: dict[str, str | type[RoundLoop]] = {
    "model": "gossip_pfl.train:Trainer",
    "expfam": "gossip_pfl.expfam.run:ExpFamRun",
    "pefll": "gossip_pfl.pefll_run:PeFLLRun",
}


def workload_class(name: str) -> type[RoundLoop]:
    """The RoundLoop subclass that runs algorithms of workload ``name``."""
    from importlib import import_module

    where = WORKLOADS[name]
    if not isinstance(where, str):
        return where
    module, cls = where.split(":")
    return getattr(import_module(module), cls)


def run(cfg: RunConfig, dataset=None, comm=None, log=print, resume: bool = False) -> dict:
    """Build the algorithm's workload, run it (or resume it from cfg.out) and always tear the
    process group down, also when building the workload fails."""
    rt = cfg.runtime
    cls = workload_class(get_algorithm(cfg.algorithm.name).workload)
    comm = comm or comm_from_config(rt, cls.comm_device(rt))
    try:  # a config error found while building the workload must not leave the group alive
        check_same_config(comm, cfg)
        return cls(cfg, dataset, comm, log).run(resume=resume)
    finally:
        comm.close()  # a no-op for one process


def check_same_config(comm, cfg: RunConfig) -> None:
    """Every rank runs rank 0's config (where it writes and how it runs aside). Each node
    reads its own copy of the config: one rank's --set algorithm.lr=0.3 trained and reported
    a mix of two runs, exit 0; another rounds aborted a rank inside Gloo. One all-reduce of
    each rank's digest; the configs themselves travel only when they differ."""
    if comm.world_size == 1 or not comm.collectives:
        return
    import torch.distributed as dist

    skip = checkpoint.PER_PROCESS
    digest, kept = config_digest(cfg, skip)
    _, other = rows_unlike_rank0(comm, [digest])
    if other is None:
        return
    keys = "?"
    if dist.is_initialized():  # (another transport with collectives: no torch group to ask)
        configs = [None] * comm.world_size
        dist.all_gather_object(configs, kept)
        keys = ", ".join(checkpoint.config_differences(configs[0], configs[other], skip=skip))
    raise GossipError(f"rank {other} was started with another config than rank 0's (keys "
                      f"differ: {keys}); start every rank with the same config and "
                      "--set")  # fmt: skip


def config_digest(cfg: RunConfig, skip: tuple[str, ...]) -> tuple[int, dict]:
    """(a positive 31-bit digest of the config without the dotted keys in ``skip``, that
    config); a schedule file counts by its content (each rank or process may spell its path
    from another folder; a missing one is said where the schedule is built)."""
    mine = to_dict(cfg)
    sched = mine.get("schedule")
    if isinstance(sched, str) and Path(sched).is_file():
        mine["schedule"] = read_yaml(sched)
    kept = _without(mine, skip)
    return digest31(kept), kept


def _without(config: dict, skip: tuple[str, ...], prefix: str = "") -> dict:
    """``config`` without the dotted keys in ``skip``."""
    out = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if path not in skip:
            out[key] = _without(value, skip, f"{path}.") if isinstance(value, dict) else value
    return out


__all__ = ["Trainer", "run", "build_schedule", "WORKLOADS", "workload_class"]
