"""Run configuration: typed dataclasses, strict loading, ``--set a.b=value`` overrides.

Precedence: command line ``--set`` > YAML file > defaults. Unknown keys (with a did-you-mean),
wrong types and bad values fail up front with the key path in a one-line error.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gossip_pfl.algorithms import RULE_NAMES
from gossip_pfl.errors import GossipError
from topologies import TopologyError
from topologies.spec import KNOWN_FAMILIES, load_yaml, read_mapping


@dataclass
class DataConfig:
    """Which federated dataset; every key besides ``name`` goes to the dataset's loader."""

    name: str = "synthetic"
    options: dict = field(default_factory=dict)


@dataclass
class ModelConfig:
    name: str = "linear"  #: linear | mlp | cnn
    options: dict = field(default_factory=dict)  #: e.g. {hidden: [200, 200]}


@dataclass
class AlgorithmConfig:
    name: str = "dfedem"  #: see gossip_pfl.algorithms.ALGORITHMS
    components: int = 3  #: M, number of shared component models (1 for single-model methods)
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    batch_size: int = 128
    #: what a minibatch's summed loss is divided by: batch (its own real samples, so a short
    #: batch is a mean as every other: the released FedEM code) | batch_size (B, so a short
    #: batch takes a step of b / B)
    loss_divisor: str = "batch"
    local_epochs: int = 1
    local_steps: int | None = None  #: fixed steps per round instead of epochs
    lr_decay: list[float] = field(default_factory=list)  #: fractions of the run where lr *= 0.1
    mu: float = 0.0  #: FedProx proximal weight; pFedMe's lambda (0: its default 15)
    inner_steps: int = 5  #: pFedMe's steps on the prox problem
    personal_lr: float | None = None  #: pFedMe / APFL personal step size (default: lr)
    alpha: float = 0.5  #: APFL's initial mixing weight
    alpha_lr: float | None = None  #: APFL's step on alpha (default: personal_lr; 0 = fixed)
    #: how D-FedEM weights client t by n_t / n: step (Alg. 4: local step x T n_t / n) | gossip
    #: (the mix weights neighbour j by n_j: sum_j W_ij n_j theta_j / sum_j W_ij n_j) | none
    client_weighting: str = "step"
    pi_init: str = "uniform"  #: mixture weights at start: uniform (released code) | random
    #: FedEM's local loss weights each component by (1 - eps) q + eps / M instead of q (pi is
    #: still the mean of q): every component keeps learning a little from every sample
    q_smoothing: float = 0.0


@dataclass
class LineSearchConfig:
    """FedLi-LS's client step: stochastic Armijo line search on each minibatch."""

    c: float = 0.1  #: sufficient decrease: f(w - eta g) <= f(w) - c eta ||g||^2
    beta: float = 0.9  #: backtracking factor
    eta_max: float = 1.0  #: first trial of a round
    max_trials: int = 100  #: backtracking trials per step; the last trial's eta is then taken
    #: where the next step's search starts: grow (eta * 2^(1/batches per epoch), the reset of
    #: SLS, Vaswani et al.'s stochastic line search), keep (the last accepted eta) or max
    #: (eta_max every step)
    reset: str = "grow"


@dataclass
class RuleConfig:
    """The aggregation rule (gossip_pfl.algorithms.rules) and its options; the algorithm
    names a default rule, ``name`` overrides it."""

    name: str | None = None  #: average | server_sgd | fedavgm | fedadam | fedyogi | ...
    lr: float | None = None  #: server step size (default per rule: 1, or 0.01 for fedadam & co)
    momentum: float = 0.9  #: FedAvgM's server momentum
    #: FedAdam / FedYogi / FedAdagrad (Reddi et al., Adaptive Federated Optimization, 2021)
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3  #: adaptivity: step lr m / (sqrt(v) + tau)
    eps: float = 1e-3  #: FedExP's epsilon
    lam: float = 0.0  #: FedLi-LU's weight decay lambda (r = lambda w)
    eta: float = 1.0  #: FedLi-LU's server step size (the largest step along Delta)
    step: str = "one"  #: FedLi-LS's server step: one | max (the largest client step size)
    tol1: float = 0.4  #: Clustered FL: split when ||mean update|| < tol1 ...
    tol2: float = 1.6  #: ... and max ||update_i|| > tol2


@dataclass
class PeFLLConfig:
    """PeFLL (Scott, Zakerinia, Lampert): the hub's hypernetwork and embedding network, and
    the clients' local steps. Defaults are the paper's values and its public code's."""

    embed: str = "lenet"  #: embedding network: lenet (image + label planes) | labels (linear)
    embed_dim: int | None = None  #: descriptor length l (unset: n / 4 of all n clients)
    hidden: int = 100  #: width of the hypernetwork's hidden layers
    hidden_layers: int = 3  #: hidden ReLU layers before the heads (one linear head per tensor)
    local_steps: int = 50  #: k, the clients' SGD steps on the model they receive
    batch_size: int = 32  #: the clients' minibatch
    descriptor_batch: int = 32  #: samples of the descriptor in training (all data at evaluation)
    client_lr: float = 2.0e-3  #: the clients' SGD step size
    momentum: float = 0.9  #: the clients' SGD momentum
    lr: float = 2.0e-4  #: the hub's Adam step size (both networks)
    clip: float = 50.0  #: the hub clips each network's gradient to this norm (0: no clipping)
    lambda_h: float = 1.0e-3  #: weight of ||eta_h||^2 in the objective
    lambda_v: float = 1.0e-3  #: weight of ||eta_v||^2
    lambda_theta: float = 5.0e-5  #: weight of ||theta_i||^2 in the clients' loss
    #: descriptors are shifted and scaled by the mean and std of the first one the hub receives
    normalize: bool = True


@dataclass
class ExpFamConfig:
    """Federated EM in sufficient-statistic space (gossip_pfl.expfam; algorithms fedem_em,
    naive_em, vr_fedem and their gossip forms): the data, the model and the algorithm's
    options. Clients take part with probability ``p`` (not the key 'participation')."""

    data: str = "gmm2d"  #: gmm2d | fashion_mnist | lowrank (NaN marks missing entries)
    clients: int = 100  #: n workers
    samples: int = 100  #: samples per worker (the mean with sizes: unequal; fashion_mnist 0: all)
    sizes: str = "equal"  #: equal | unequal (worker i holds about 2 m (i+1)/(n+1))
    #: gmm2d: each worker's share of component 0: iid (1/2 each) | mixed (its own, uniform in
    #: [0.1, 0.9]) | sorted (the first half of the workers hold component 0 only, the rest 1)
    split: str = "mixed"
    dim: int = 10  #: lowrank: dimension d
    missing: float = 0.2  #: lowrank: fraction of entries marked missing
    pca: int = 20  #: fashion_mnist: principal components kept
    model: str = "gmm_shared"  #: gmm_shared | gmm_diag | imputation (low-rank Gaussian)
    components: int = 2  #: G, mixture components
    rank: int = 2  #: r, the imputation model's rank (< dimension)
    compressor: str = "identity"  #: identity | dithering | block
    levels: int = 1  #: dithering: s levels
    norm: float = 2.0  #: dithering: the norm r (.inf: the max norm)
    block: int = 8  #: block: block length
    block_norm: float = 2.0  #: block: the block's norm p (.inf: the max norm)
    p: float = 1.0  #: each worker takes part in a round with probability p (Bernoulli)
    gamma: float = 0.01  #: step size on S
    alpha: float = 0.01  #: memory step size (theory: 1 / (1 + omega))
    batch: int = 20  #: b, samples per worker and round (0: all)
    k_in: int = 20  #: VR-FedEM: inner steps per outer loop
    init_memory: str = "h"  #: V_{0,i}: h (h_i(S_0), the paper's) | zero


@dataclass
class EvalConfig:
    every: int = 10  #: evaluate every k rounds (and after the last)
    #: local epochs of plain SGD at `algorithm.lr` on a copy of each peer's model (and of an
    #: unseen client's average model) before it is evaluated (FedAvg+; pFedMe and APFL take
    #: their own local update of their personal models instead); unset: the algorithm's
    #: default (1 for fedavg_plus, else 0)
    finetune_epochs: int | None = None
    #: samples per evaluation forward, all peers (0: the model's hint, else 2^20 for the
    #: linear model's closed form, 2^23 on a GPU, else 16384); on a CPU as many
    #: such calls as the run has threads run at once
    chunk: int = 0
    #: converge | one_step (the paper's experiments); mixtures (M > 1) only
    unseen_em: str = "converge"


@dataclass
class FaultsConfig:
    """Fault injection for peer-to-peer runs (``runtime.transport: zmq``; docs/p2p.md),
    seeded so that a fault run repeats."""

    drop: float = 0.0  #: probability that a link between two processes is down in an exchange
    ack_drop: float = 0.0  #: probability that an acknowledgement is lost (the ends may disagree)
    seed: int | None = None  #: seed of the draws (unset: the run's seed)
    #: processes that crash: a list of {id: K, round: R, restart: R2}; K exits at the start of
    #: round R, and ``gossip-pfl peers-local`` restarts it once the others reach round R2
    kill: list = field(default_factory=list)


@dataclass
class RuntimeConfig:
    device: str = "auto"  #: auto | cpu | cuda
    backend: str = "auto"  #: auto | gloo | nccl
    batching: str = "auto"  #: auto | vmap | loop
    #: float32 | bf16: bf16 runs the model's forward (and so its backward) under bfloat16
    #: autocast; losses, gradients and parameters stay float32. Helps convolutional models on
    #: a GPU (tensor cores); on a CPU it may be slower. The closed-form linear step is float32.
    precision: str = "float32"
    #: CPU only: the binary linear model's local round of SGD (with a mixture's E-step, peer
    #: by peer before its steps; with momentum, FedProx's proximal term, weight decay and
    #: SCAFFOLD's correction; keeping FedLi-LU's losses; with pFedMe's and APFL's personal
    #: models; FedLi-LS's line search), E-step losses and scores as compiled loops
    #: (numba; gossip_pfl/runtime/kernels.py); false runs them as torch operations, as on a
    #: GPU (the same numbers up to float rounding)
    cpu_kernels: bool = True
    #: CUDA only: the binary linear model's local SGD steps (plain, or with momentum, weight
    #: decay, FedProx's and SCAFFOLD's terms, FedLi-LU's kept losses, pFedMe's and APFL's
    #: personal models) as one CUDA graph, captured in the first round and replayed after
    #: (the same kernels, one launch; 200 synthetic rounds 1.39 to 1.47 s against 1.86 on an
    #: H200, docs/speed-notes.md); rounds of other shapes (partial participation) get their
    #: own; FedEM's E-step on that model too (the same operations, from the second round,
    #: whoever takes part); false launches each kernel
    cuda_graphs: bool = True
    #: CUDA only: the local steps of models with their own batched layers (cnn, lenet, mlp)
    #: and of the linear model as CUDA graphs, one per step shape, captured when a shape first
    #: comes and replayed after, the round's step sizes read from tensors (the same kernels
    #: and numbers; FedEM, FedAvg, FedProx, SCAFFOLD, pFedMe, APFL, FedLi-LU and their gossip
    #: forms with SGD, momentum and weight decay; FedLi-LS's line search as a step's start, a
    #: graph a trial while a peer searches, and its end, each trial on every peer of the
    #: step). On an H200: FedLi-LS's 200 synthetic rounds 5.4-6.0 -> 1.7 s, the full CNN's
    #: FedEM round 0.562 -> 0.555 s (bf16 0.485 -> 0.441 s), its peak memory 12% lower
    #: (docs/speed-notes.md); false launches each kernel
    cuda_graph_steps: bool = True
    timeout_s: float = 300.0  #: a rank waits this long for a dead peer before failing
    metrics_every: int = 1  #: ignored, kept so older run configs load (metrics follow eval.every)
    step_chunk: int = 0  #: samples per forward in a local step, all peers (0: model's hint or all)
    #: CUDA only: let matmuls and convolutions round their inputs to TF32 (faster on Ampere and
    #: later, but about 1e-3 relative error: placements then no longer agree to 1e-6)
    tf32: bool = False
    #: CUDA only: deterministic kernels (cuDNN, cuBLAS, scatter-adds), so a rerun with the same
    #: seed gives the same numbers; false lets cuDNN pick its fastest algorithms by timing
    deterministic: bool = True
    #: torch threads of each rank (0: OMP_NUM_THREADS if set, else the cores this process may
    #: use divided by torchrun's LOCAL_WORLD_SIZE; at most 4 per core; runtime/threads.py)
    threads: int = 0
    #: torch (one process, or torchrun ranks) | zmq (peer-to-peer processes started by
    #: ``gossip-pfl peer``; docs/p2p.md)
    transport: str = "torch"
    #: zmq: the peers file (YAML: process id -> host:port), relative to the config file
    peers: str | None = None
    #: zmq: an exchange waits this long for a neighbour before the link is dropped for that
    #: round (its weight goes to the diagonal); unset: timeout_s
    link_timeout_s: float | None = None
    faults: FaultsConfig = field(default_factory=FaultsConfig)  #: zmq: fault injection


@dataclass
class RunConfig:
    seed: int = 1234
    rounds: int = 50
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    schedule: Any = None  #: topology spec (dict) or path to a schedule YAML; None: by algorithm
    #: refuse a gossip schedule that never connects the peers or is not doubly stochastic
    #: (its graph must be connected either way)
    check_schedule: bool = True
    rule: RuleConfig = field(default_factory=RuleConfig)
    line_search: LineSearchConfig = field(default_factory=LineSearchConfig)
    pefll: PeFLLConfig = field(default_factory=PeFLLConfig)
    expfam: ExpFamConfig = field(default_factory=ExpFamConfig)
    #: clients per round: a count (int) or a fraction in (0, 1]; sampled from (seed, round)
    participation: Any = 1.0
    #: weights of the hub's average: size (n_i over the sampled set) | uniform
    aggregation: str = "size"
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    out: str = "runs/default"
    checkpoint_every: int = 0  #: 0 = only at the end


# Sections whose unknown keys go into ``options`` (validated by the component's own builder).
_OPEN_SECTIONS = {DataConfig: "options", ModelConfig: "options"}


def _check_type(value: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        return _check_type(value, next(a for a in args if a is not type(None)), path)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, path)
    expected = origin or hint
    if expected is list and typing.get_args(hint) and isinstance(value, list):  # list[float]
        (item,) = typing.get_args(hint)
        return [_check_type(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if expected is float and isinstance(value, str):
        try:
            value = float(value)  # YAML reads 1e-3 as a string
        except ValueError:
            pass
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise GossipError(
            f"config key '{path}' must be {expected.__name__}, got {type(value).__name__} "
            f"({value!r})"
        )
    # past these, numpy, numba or torch failed deep inside (a traceback), not here
    big = 2**63 - 1 if path.endswith("seed") else 2**31 - 1
    if expected is int and abs(value) > big:
        raise GossipError(f"config key '{path}' is {value}, beyond {big:,} (the largest this "
                          "key takes)")  # fmt: skip
    return value


def from_dict(cls, data: Any, path: str = ""):
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys with a did-you-mean."""
    if not isinstance(data, dict):
        raise GossipError(f"config key '{path or '<root>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    open_key = _OPEN_SECTIONS.get(cls)
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key in names and key != open_key:
            kwargs[key] = _check_type(value, hints[key], key_path)
        elif open_key:
            extra[key] = value
        else:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f"; known: {', '.join(names)}"
            raise GossipError(f"unknown config key '{key_path}'{hint}")
    if open_key:
        kwargs[open_key] = (
            {**data.get(open_key, {}), **extra}
            if isinstance(data.get(open_key, {}), dict)
            else extra
        )
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    """Plain nested dict (open sections flattened back), as saved in the run directory."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            sub = to_dict(value)
            key = _OPEN_SECTIONS.get(type(value))
            if key:
                sub = {k: v for k, v in sub.items() if k != key} | dict(value.__dict__[key])
            value = sub
        out[f.name] = value
    return out


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``a.b=value`` assignments (value parsed as YAML) applied to a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise GossipError(f"--set expects KEY.PATH=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise GossipError(f"--set {key}: '{part}' is not a section")
        try:
            node[parts[-1]] = load_yaml(raw)
        except yaml.YAMLError as err:
            why = str(err).splitlines()[0]
            raise GossipError(f"--set {key}: {raw!r} is not a YAML value ({why})") from None
    return data


def read_yaml(path: str | Path) -> dict:
    """A YAML mapping from a file; missing files and syntax errors name the file (and line)."""
    try:
        return read_mapping(path, "config file")
    except TopologyError as err:
        raise GossipError(str(err)) from None


def path_override(key: str, path) -> str:
    """``KEY=PATH`` for :func:`load_config`'s overrides, the path quoted: read as YAML, a
    folder named 1e-3, 100 or yes was a number or a boolean."""
    return f"{key}={json.dumps(str(path))}"


def load_config(
    path: str | Path | None = None,
    overrides: list[str] = (),
    base: dict | None = None,
    unread: bool = True,
    saved: bool = False,
) -> RunConfig:
    """Defaults, then ``base`` (an embedded config) or the file at ``path``, then overrides;
    checked (:func:`validate`; ``unread`` False for a resume). ``saved``: ``path`` is a run's
    own config.yaml, whose relative data folders (saved before they were held absolute) are
    relative to the working folder, as that run read them."""
    data = dict(base or {})
    if path is not None:
        data = read_yaml(path)
        # a config's paths are relative to it
        _resolve_paths(data, Path(path).parent, Path.cwd() if saved else None)
    data = apply_overrides(data, list(overrides))
    _resolve_paths(data, Path.cwd())  # --set paths to the working folder (others: absolute)
    cfg = from_dict(RunConfig, data)
    validate(cfg, unread)
    return cfg


def _resolve_paths(data: dict, base: Path, data_base: Path | None = None) -> None:
    """The schedule file, an inline graph file, the peers file and the data's folders (joined
    to ``data_base`` if given) joined to ``base`` and held absolute (an absolute one stays as
    it is, ``~`` expanded): the run's config.yaml, read again by a resume from its own folder,
    named them relative to the working folder."""
    base = base.absolute()
    section = data.get("data")
    if isinstance(section, dict):  # (a LEAF root beside its config was looked for in the cwd)
        folder = (data_base or base).absolute()
        paths = {k: str(folder / _expand(v, f"data.{k}")) for k, v in section.items()
                 if k in ("root", "cache_dir") and isinstance(v, str) and v.strip()}  # fmt: skip
        data["data"] = {**section, **paths}
    sched = data.get("schedule")
    if isinstance(sched, str) and sched.strip():
        data["schedule"] = str(base / sched)
    elif isinstance(sched, dict) and isinstance(sched.get("graph"), str):
        graph = sched["graph"]  # (a family's name is no file, whatever the folder holds)
        if graph not in KNOWN_FAMILIES and (base / graph).is_file():
            data["schedule"] = {**sched, "graph": str(base / graph)}
    rt = data.get("runtime")
    if isinstance(rt, dict) and isinstance(rt.get("peers"), str) and rt["peers"].strip():
        data["runtime"] = {**rt, "peers": str(base / rt["peers"])}


def _expand(path: str, key: str) -> Path:
    """``path`` with ``~`` or ``~user`` expanded; an unknown user is the key's error."""
    try:
        return Path(path).expanduser()
    except RuntimeError:  # ("Could not determine home directory.")
        raise GossipError(
            f"config key '{key}': cannot expand {path!r} (no such user's home folder)"
        ) from None


def _changed(section: str, value, default) -> str:
    """The dotted keys of a config section that differ from its defaults, comma-separated
    ("" when none)."""
    return ", ".join(f"{section}.{k}" for k, v in vars(value).items() if v != getattr(default, k))


#: algorithm keys that only some algorithms read: key -> (whether an algorithm of ``spec``
#: reads it, what reads it)
ALGORITHM_KEYS = {
    "pi_init": (lambda spec: not spec.single_model,
                "the mixtures' mixture weights: fedem, dfedem"),
    "q_smoothing": (lambda spec: not spec.single_model,
                    "the mixtures' loss weights: fedem, dfedem"),
    "inner_steps": (lambda spec: spec.surrogate == "pfedme", "pfedme's inner problem"),
    "personal_lr": (lambda spec: spec.surrogate in ("pfedme", "apfl"),
                    "pfedme and apfl's personal models"),
    "alpha": (lambda spec: spec.surrogate == "apfl", "apfl's mixing weight"),
    "alpha_lr": (lambda spec: spec.surrogate == "apfl", "apfl's mixing weight"),
}  # fmt: skip


def _check_expfam_read(e: ExpFamConfig, name: str) -> None:
    """An expfam key that the chosen data, model or algorithm does not read. (Not the
    compressors' options: a study switches the compressor with one ``--set`` and the config
    keeps the options of the one it names, as docs/expfam.md's experiments do.)"""
    d = ExpFamConfig()
    readers = {  # key -> (read?, by what)
        "split": (e.data == "gmm2d", "expfam.data gmm2d"),
        "dim": (e.data == "lowrank", "expfam.data lowrank"),
        "missing": (e.data == "lowrank", "expfam.data lowrank"),
        "pca": (e.data == "fashion_mnist", "expfam.data fashion_mnist"),
        "components": (e.model != "imputation", "the mixture models (imputation has a rank)"),
        "rank": (e.model == "imputation", "expfam.model imputation"),
        "k_in": ("vr_fedem" in name, "VR-FedEM (vr_fedem, gossip_vr_fedem)"),
        # naive EM keeps no memory: its S moves by the plain average
        "alpha": (name != "naive_em", "the memories of every rule but naive_em"),
        "init_memory": (name != "naive_em", "the memories of every rule but naive_em"),
    }
    for key, (read, by) in readers.items():
        if getattr(e, key) != getattr(d, key) and not read:
            raise GossipError(f"config key 'expfam.{key}' is {getattr(e, key)!r} but this run "
                              f"does not read it (it is for {by})")  # fmt: skip


def _check_read(cfg: RunConfig, spec) -> None:
    """A key set for another rule or solver went unheeded (rule.lr under FedAvg's average ran
    FedAvg to the bit): the rule's own keys, the line search's, FedProx's mu, PeFLL's."""
    from gossip_pfl.algorithms import RULE_KEYS

    a, rule = cfg.algorithm, cfg.rule.name or spec.rule
    if spec.workload != "pefll" and (given := _changed("pefll", cfg.pefll, PeFLLConfig())):
        raise GossipError(f"config key(s) {given} are for algorithm 'pefll'; '{a.name}' does "
                          "not read them")  # fmt: skip
    if not cfg.check_schedule and spec.topology != "given":  # (no gossip schedule to check)
        raise GossipError(f"config key 'check_schedule' is false but '{a.name}' builds no "
                          "gossip schedule to check")  # fmt: skip
    if spec.workload != "model":  # EM and PeFLL read algorithm.name alone
        if given := _changed("algorithm", a, AlgorithmConfig(name=a.name)):
            own = {"expfam": " (its keys are expfam.*)", "pefll": " (its keys are pefll.*)"}
            raise GossipError(f"config key(s) {given}: '{a.name}' reads only algorithm.name"
                              f"{own.get(spec.workload, '')}")  # fmt: skip
        unread = [  # key, value, its no-op values, what reads it
            ("aggregation", cfg.aggregation, (RunConfig.aggregation,),
             "the hub's average of the model workloads' server algorithms"),
            ("eval.finetune_epochs", cfg.eval.finetune_epochs, (None, 0),
             "the model workloads' fine-tuning before evaluation, FedAvg+'s"),
            ("eval.unseen_em", cfg.eval.unseen_em, (EvalConfig.unseen_em,),
             "the mixtures' E-step on unseen clients: fedem, dfedem"),
        ]  # fmt: skip
        for key, value, noop, by in unread:
            if value not in noop:
                raise GossipError(f"config key '{key}' is {value!r} but '{a.name}' does not "
                                  f"read it (it is for {by})")  # fmt: skip
        if spec.workload == "expfam":
            _check_expfam_read(cfg.expfam, a.name)
        return
    for key, (reads, users) in ALGORITHM_KEYS.items():
        if getattr(a, key) != getattr(AlgorithmConfig, key) and not reads(spec):
            raise GossipError(f"config key 'algorithm.{key}' is {getattr(a, key)!r} but "
                              f"'{a.name}' does not read it ({users})")  # fmt: skip
    if spec.single_model and a.components not in (1, AlgorithmConfig.components):
        raise GossipError(f"config key 'algorithm.components' is {a.components} but "
                          f"'{a.name}' trains one model (M = 1)")  # fmt: skip
    if a.local_steps is not None and a.local_epochs != AlgorithmConfig.local_epochs:
        raise GossipError(f"config key 'algorithm.local_epochs' is {a.local_epochs} but "
                          f"algorithm.local_steps ({a.local_steps}) sets the round's steps; "
                          "set one of them")  # fmt: skip
    one_model = spec.single_model or a.components == 1
    if cfg.eval.unseen_em != EvalConfig.unseen_em and one_model:
        raise GossipError(f"config key 'eval.unseen_em' is {cfg.eval.unseen_em!r} but "
                          f"'{a.name}' fits no mixture weights (M = 1)")  # fmt: skip
    for key in ("pi_init", "q_smoothing"):  # (fedem with M = 1 ran as if they were unset)
        if one_model and not spec.single_model and getattr(a, key) != getattr(AlgorithmConfig, key):
            raise GossipError(f"config key 'algorithm.{key}' is {getattr(a, key)!r} but "
                              f"'{a.name}' with algorithm.components 1 has no mixture "
                              "weights")  # fmt: skip
    star = spec.topology == "server" and rule != "clustered"  # (clustered weighs by size)
    if cfg.aggregation != RunConfig.aggregation and not star:
        raise GossipError(f"config key 'aggregation' is {cfg.aggregation!r} but '{a.name}' has "
                          "no hub that averages (gossip weighs by W_t: "
                          "algorithm.client_weighting)")  # fmt: skip
    if a.client_weighting != AlgorithmConfig.client_weighting and spec.topology != "given":
        raise GossipError(f"config key 'algorithm.client_weighting' is {a.client_weighting!r} "
                          f"but '{a.name}' does not gossip (a server's weights: "
                          "aggregation)")  # fmt: skip
    reads = RULE_KEYS.get(rule)  # (None: an unknown name, refused where the rule is built)
    changed = [k for k, v in vars(cfg.rule).items() if k != "name" and v != getattr(RuleConfig, k)]
    unread = [k for k in changed if reads is not None and k not in reads]
    if unread:
        key = unread[0]
        own = ", ".join(f"rule.{k}" for k in reads) or "no rule.* key"
        users = ", ".join(n for n, keys in RULE_KEYS.items() if key in keys)
        raise GossipError(f"config key rule.{key} is set but rule '{rule}' does not read it "
                          f"(it reads {own}; rule.{key} is for {users})")  # fmt: skip
    searches = spec.solver == "armijo" or rule == "fedli_ls"
    if not searches and (given := _changed("line_search", cfg.line_search, LineSearchConfig())):
        raise GossipError(f"config key(s) {given} are for FedLi-LS's line search (rule.name "
                          f"fedli_ls); rule '{rule}' does not search")  # fmt: skip
    if searches and a.momentum:
        raise GossipError(f"config key 'algorithm.momentum' is {a.momentum} but the line "
                          "search (rule fedli_ls) takes plain steps; set it to 0")  # fmt: skip
    if searches and a.lr_decay:  # (the search sets each step size: the schedule went unread)
        raise GossipError(f"config key 'algorithm.lr_decay' is {a.lr_decay} but the line "
                          "search (rule fedli_ls) sets each step size; remove it")  # fmt: skip
    if a.mu and not (spec.prox or spec.surrogate == "pfedme"):
        raise GossipError(f"config key 'algorithm.mu' is {a.mu} but '{a.name}' has no "
                          "proximal term (fedprox and pfedme read it)")  # fmt: skip


def validate(cfg: RunConfig, unread: bool = True) -> None:
    """Cross-field checks that need no data, with the key to change in the message; with
    ``unread``, keys set that the run does not read too (a resume leaves them: its
    checkpoint's config may hold one from before this check, and must not change)."""
    from gossip_pfl.algorithms import ALGORITHMS, get_algorithm

    a, r, ls = cfg.algorithm, cfg.rule, cfg.line_search
    spec = get_algorithm(a.name)  # an unknown name fails here, before any data is built
    # first: expfam.* on a model or PeFLL run went unheeded (an EM config switched to
    # algorithm.name=fedavg ran FedAvg on the default synthetic data)
    if spec.workload != "expfam" and (given := _changed("expfam", cfg.expfam, ExpFamConfig())):
        em = ", ".join(k for k, s in ALGORITHMS.items() if s.workload == "expfam")
        raise GossipError(f"config key(s) {given} are for the EM algorithms ({em}); "
                          f"'{a.name}' does not read them")  # fmt: skip
    checks = [
        (cfg.rounds >= 1, "rounds", "must be >= 1"),
        # '' was the current folder: the run's files among the user's own
        (bool(str(cfg.out).strip()), "out", "must name a folder, not be empty"),
        # torch's seeds are 64-bit: seed * 1009 + m (a component's init) must fit
        (0 <= cfg.seed < 2**48, "seed", "must be in [0, 2**48)"),
        (a.components >= 1, "algorithm.components", "must be >= 1 (M, the number of components)"),
        (a.lr > 0, "algorithm.lr", "must be > 0"),
        (a.weight_decay >= 0, "algorithm.weight_decay", "must be >= 0"),
        (a.mu >= 0, "algorithm.mu", "must be >= 0"),
        (0 <= a.alpha <= 1, "algorithm.alpha", "must be in [0, 1]"),
        (a.batch_size >= 1, "algorithm.batch_size", "must be >= 1"),
        (a.loss_divisor in ("batch", "batch_size"), "algorithm.loss_divisor",
         "must be batch|batch_size"),
        (a.local_epochs >= 1, "algorithm.local_epochs", "must be >= 1"),
        (a.local_steps is None or a.local_steps >= 0, "algorithm.local_steps", "must be >= 0"),
        (0 <= a.momentum < 1, "algorithm.momentum", "must be in [0, 1)"),
        (
            a.client_weighting in ("step", "gossip", "none"),
            "algorithm.client_weighting",
            "must be step|gossip|none",
        ),
        (a.pi_init in ("uniform", "random"), "algorithm.pi_init", "must be uniform|random"),
        (0 <= a.q_smoothing <= 1, "algorithm.q_smoothing", "must be in [0, 1]"),
        (all(0 < f < 1 for f in a.lr_decay), "algorithm.lr_decay", "fractions must be in (0, 1)"),
        (cfg.eval.every >= 1, "eval.every", "must be >= 1"),
        (cfg.eval.unseen_em in ("converge", "one_step"), "eval.unseen_em",
         "must be converge|one_step"),
        (a.inner_steps >= 1, "algorithm.inner_steps", "must be >= 1 (pFedMe's prox steps)"),
        (a.personal_lr is None or a.personal_lr > 0, "algorithm.personal_lr", "must be > 0"),
        (a.alpha_lr is None or a.alpha_lr >= 0, "algorithm.alpha_lr", "must be >= 0 (0: fixed)"),
        (cfg.runtime.metrics_every >= 1, "runtime.metrics_every", "must be >= 1"),
        (cfg.runtime.step_chunk >= 0, "runtime.step_chunk", "must be >= 0 (0: automatic)"),
        (cfg.runtime.threads >= 0, "runtime.threads", "must be >= 0 (0: automatic)"),
        (cfg.runtime.precision in ("float32", "bf16"), "runtime.precision",
         "must be float32|bf16"),
        (cfg.eval.chunk >= 0, "eval.chunk", "must be >= 0 (0: automatic)"),
        (cfg.runtime.timeout_s > 0, "runtime.timeout_s", "must be > 0"),
        (cfg.checkpoint_every >= 0, "checkpoint_every", "must be >= 0"),
        (cfg.aggregation in ("size", "uniform"), "aggregation", "must be size|uniform"),
        (
            cfg.eval.finetune_epochs is None or cfg.eval.finetune_epochs >= 0,
            "eval.finetune_epochs",
            "must be >= 0",
        ),
        (_is_participation(cfg.participation), "participation",
         "must be a count >= 1 or a fraction in (0, 1]"),
        (r.name is None or r.name in RULE_NAMES, "rule.name", "must be " + "|".join(RULE_NAMES)),
        (r.lr is None or r.lr > 0, "rule.lr", "must be > 0"),
        (0 <= r.momentum < 1, "rule.momentum", "must be in [0, 1)"),
        (0 <= r.beta1 < 1, "rule.beta1", "must be in [0, 1)"),
        (0 <= r.beta2 < 1, "rule.beta2", "must be in [0, 1)"),
        (r.tau > 0 and math.isfinite(r.tau * r.tau), "rule.tau",
         "must be > 0, its square finite (v starts at tau^2)"),
        (r.eps > 0, "rule.eps", "must be > 0"),
        (r.lam >= 0, "rule.lam", "must be >= 0"),
        (r.eta > 0, "rule.eta", "must be > 0"),
        (r.step in ("one", "max"), "rule.step", "must be one|max"),
        (r.tol1 >= 0, "rule.tol1", "must be >= 0 (a bound on an update's norm)"),
        (r.tol2 >= 0, "rule.tol2", "must be >= 0 (a bound on an update's norm)"),
        (0 < ls.c < 1, "line_search.c", "must be in (0, 1)"),
        (0 < ls.beta < 1, "line_search.beta", "must be in (0, 1)"),
        (ls.eta_max > 0, "line_search.eta_max", "must be > 0"),
        (ls.max_trials >= 1, "line_search.max_trials", "must be >= 1"),
        (ls.reset in ("grow", "keep", "max"), "line_search.reset", "must be grow|keep|max"),
        *_pefll_checks(cfg.pefll),
        *_transport_checks(cfg.runtime, cfg.rounds),
        *_expfam_checks(cfg),
    ]  # fmt: skip
    for ok, key, msg in checks:
        if not ok:
            raise GossipError(f"config key '{key}' {msg} (got {_get(cfg, key)!r})")
    for key, value in _floats(cfg):
        if not math.isfinite(value) and not (key in _INF_NORMS and value == math.inf):
            raise GossipError(f"config key '{key}' must be a finite number (got {value!r})")
        # the model's steps run in float32: a larger value overflowed with a numpy warning
        # before the finite check's error
        if key.startswith(_FLOAT32_SECTIONS) and math.isfinite(value) and abs(value) > _F32_MAX:
            raise GossipError(f"config key '{key}' must fit in float32, the parameters' "
                              f"precision (|value| <= {_F32_MAX:.3g}; got {value!r})")  # fmt: skip
    if spec.workload != "model" and (given := _changed("rule", cfg.rule, RuleConfig())):
        raise GossipError(f"config key(s) {given}: rules are for the model workloads; "
                          f"'{a.name}' has its own server step")  # fmt: skip
    if spec.workload == "expfam":  # the EM reads expfam.*: data.* and model.* go unheeded
        for key, value, default in (("data", cfg.data, DataConfig()),
                                    ("model", cfg.model, ModelConfig())):  # fmt: skip
            given = {**({"name": value.name} if value.name != default.name else {}),
                     **value.options}  # fmt: skip
            if given:
                keys = ", ".join(f"{key}.{k}={v!r}" for k, v in given.items())
                raise GossipError(f"config keys {keys} are for model workloads; EM's data and "
                                  "model are expfam.data and expfam.model")  # fmt: skip
    if spec.workload == "pefll" and cfg.schedule not in (None, {"graph": "server"}):
        raise GossipError(f"algorithm '{a.name}' runs on the server schedule (a hub) but "
                          f"'schedule' is set to {cfg.schedule!r}: drop 'schedule'")  # fmt: skip
    if spec.topology == "given" and cfg.schedule is None:
        raise GossipError(
            f"algorithm '{a.name}' needs a schedule: set 'schedule' to a topology spec or a "
            "schedule YAML path (e.g. schedule: {graph: ring, weights: metropolis})"
        )
    if unread:  # last: a key the run cannot take at all is said first
        _check_read(cfg, spec)


def _transport_checks(rt: RuntimeConfig, rounds: int) -> list[tuple[bool, str, str]]:
    f = rt.faults
    kills = [k for k in f.kill if _is_kill(k)]  # the malformed ones fail the first kill check
    return [
        (rt.transport in ("torch", "zmq"), "runtime.transport", "must be torch|zmq"),
        (rt.link_timeout_s is None or rt.link_timeout_s > 0, "runtime.link_timeout_s",
         "must be > 0 (unset: timeout_s)"),
        (0 <= f.drop < 1, "runtime.faults.drop", "must be in [0, 1)"),
        (0 <= f.ack_drop < 1, "runtime.faults.ack_drop", "must be in [0, 1)"),
        (f.seed is None or f.seed >= 0, "runtime.faults.seed", "must be an int >= 0 (unset: the "
         "run's seed)"),
        (all(_is_kill(k) for k in f.kill), "runtime.faults.kill",
         "must be a list of {id: K >= 0, round: R >= 1, restart: R2 > R (optional)}"),
        (rt.transport == "zmq" or (not (f.drop or f.ack_drop or f.kill) and f.seed is None),
         "runtime.faults",
         "needs runtime.transport zmq (torch.distributed stops at a lost link)"),
        # the restart would wait for a round the others never reach
        (all(k.get("restart", 0) < rounds for k in kills), "runtime.faults.kill",
         f"restart rounds must be < rounds = {rounds} (the others finish first)"),
        # a kill at or past the last round never fires: the run would not test what it says
        (all(k["round"] < rounds for k in kills), "runtime.faults.kill",
         f"kill rounds must be < rounds = {rounds} (a later one never fires)"),
    ]  # fmt: skip


def _is_kill(entry) -> bool:
    def count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(entry, dict) or set(entry) - {"id", "round", "restart"}:
        return False
    restart = entry.get("restart")
    # round >= 1: a process killed at round 0 may die before it announced itself, and
    # whether the others wait for it (or its restart for them) is then a race
    return (
        count(entry.get("id"))
        and count(entry.get("round"))
        and entry["round"] >= 1
        and (restart is None or (count(restart) and restart > entry["round"]))
    )


def _pefll_checks(p: PeFLLConfig) -> list[tuple[bool, str, str]]:
    return [
        (p.embed in ("lenet", "labels"), "pefll.embed", "must be lenet|labels"),
        (p.embed_dim is None or p.embed_dim >= 1, "pefll.embed_dim",
         "must be >= 1 (the descriptor length; unset: n / 4)"),
        (p.hidden >= 1, "pefll.hidden", "must be >= 1"),
        (p.hidden_layers >= 1, "pefll.hidden_layers", "must be >= 1"),
        (p.local_steps >= 1, "pefll.local_steps", "must be >= 1"),
        (p.batch_size >= 1, "pefll.batch_size", "must be >= 1"),
        (p.descriptor_batch >= 1, "pefll.descriptor_batch", "must be >= 1"),
        (p.client_lr > 0, "pefll.client_lr", "must be > 0"),
        (0 <= p.momentum < 1, "pefll.momentum", "must be in [0, 1)"),
        (p.lr > 0, "pefll.lr", "must be > 0"),
        (p.clip >= 0, "pefll.clip", "must be >= 0 (0: no clipping)"),
        (p.lambda_h >= 0, "pefll.lambda_h", "must be >= 0"),
        (p.lambda_v >= 0, "pefll.lambda_v", "must be >= 0"),
        (p.lambda_theta >= 0, "pefll.lambda_theta", "must be >= 0"),
    ]  # fmt: skip


def _expfam_checks(cfg: RunConfig) -> list[tuple[bool, str, str]]:
    e = cfg.expfam
    dim = {"gmm2d": 2, "fashion_mnist": e.pca}.get(e.data, e.dim)
    models = ("gmm_shared", "gmm_diag", "imputation")
    return [
        (e.data in ("gmm2d", "fashion_mnist", "lowrank"), "expfam.data",
         "must be gmm2d|fashion_mnist|lowrank"),
        (e.clients >= 1, "expfam.clients", "must be >= 1"),
        (e.samples >= 1 or (e.samples == 0 and e.data == "fashion_mnist"), "expfam.samples",
         "must be >= 1 (0: all images, fashion_mnist only)"),
        (e.sizes in ("equal", "unequal"), "expfam.sizes", "must be equal|unequal"),
        (e.split in ("iid", "mixed", "sorted"), "expfam.split", "must be iid|mixed|sorted"),
        (e.dim >= 2, "expfam.dim", "must be >= 2"),
        (0 <= e.missing < 1, "expfam.missing", "must be in [0, 1)"),
        (e.missing > 0 or e.model != "imputation", "expfam.missing",
         "must be > 0 for imputation (with nothing hidden there is nothing to impute)"),
        (1 <= e.pca <= 784, "expfam.pca", "must be in 1..784"),
        (e.model in models, "expfam.model", "must be " + "|".join(models)),
        (e.model == "imputation" or e.data != "lowrank", "expfam.model",
         "must be imputation for data lowrank (it has missing entries)"),
        (e.components >= 1, "expfam.components", "must be >= 1 (G, the mixture components)"),
        (e.model != "imputation" or 1 <= e.rank < dim, "expfam.rank",
         f"must be in 1..{dim - 1} (below the data's dimension {dim})"),
        (e.compressor in ("identity", "dithering", "block"), "expfam.compressor",
         "must be identity|dithering|block"),
        (e.levels >= 1, "expfam.levels", "must be >= 1 (s, the dithering levels)"),
        (e.norm >= 1, "expfam.norm", "must be >= 1"),
        (e.block >= 1, "expfam.block", "must be >= 1"),
        (e.block_norm >= 1, "expfam.block_norm", "must be >= 1"),
        (0 < e.p <= 1, "expfam.p", "must be in (0, 1]"),
        (e.p == 1 or "vr_fedem" not in cfg.algorithm.name, "expfam.p",
         "must be 1 for VR-FedEM (full participation)"),
        (e.gamma > 0, "expfam.gamma", "must be > 0"),
        (0 < e.alpha <= 1, "expfam.alpha", "must be in (0, 1]"),
        (e.batch >= 0, "expfam.batch", "must be >= 0 (0: all samples)"),
        (e.k_in >= 1, "expfam.k_in", "must be >= 1"),
        (e.init_memory in ("h", "zero"), "expfam.init_memory", "must be h|zero"),
    ]  # fmt: skip


#: the compressors' norms, where .inf is the max norm (the usual choice for dithering)
_INF_NORMS = ("expfam.norm", "expfam.block_norm")
_FLOAT32_SECTIONS = ("algorithm.", "rule.", "line_search.")
_F32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max


def _floats(cfg, prefix: str = ""):
    """(dotted key, value) of every float in the config's typed sections."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from _floats(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            yield f"{prefix}{f.name}", value


def _is_participation(value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 1
    return isinstance(value, float) and 0 < value <= 1


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg
