"""Algorithms as compositions: a surrogate (personal-variable update + loss for the shared
variables), the local solver's options, and where the shared variables are mixed.

FedEM and D-FedEM are the same composition on different schedules; FedAvg, decentralized SGD
and Local are the mixture surrogate with one component.
"""

from __future__ import annotations

from dataclasses import dataclass

from gossip_pfl.errors import GossipError

#: the aggregation rules (gossip_pfl.algorithms.rules.build_rule) and the ``rule.*`` keys
#: each reads (one set but not read is refused); here, without torch, for the config's checks
RULE_KEYS = {
    "average": (),
    "server_sgd": ("lr",),
    "fedavgm": ("lr", "momentum"),
    "fedadam": ("lr", "beta1", "beta2", "tau"),
    "fedyogi": ("lr", "beta1", "beta2", "tau"),
    "fedadagrad": ("lr", "beta1", "tau"),
    "fedexp": ("eps",),
    "fedli_lu": ("lam", "eta"),
    "fedli_ls": ("step",),
    "scaffold": ("lr",),
    "clustered": ("tol1", "tol2"),
}
RULE_NAMES = tuple(RULE_KEYS)
#: the clients' private variables build_surrogate knows: FedEM's mixture (no private
#: variables for M = 1), pFedMe's and APFL's personal models
SURROGATES = ("mixture", "pfedme", "apfl")


@dataclass(frozen=True)
class AlgorithmSpec:
    """How a named algorithm is composed: a surrogate, a local solver, a rule and a topology."""

    single_model: bool  #: M is forced to 1
    #: "server" (the star: a hub aggregates the participants), "given" (the config's gossip
    #: schedule), "none" (W = I)
    topology: str
    rule: str = "average"  #: the default aggregation rule (gossip_pfl.algorithms.rules)
    prox: bool = False  #: FedProx's proximal term toward the round's starting model
    finetune_epochs: int = 0  #: default of eval.finetune_epochs (FedAvg+: 1)
    solver: str = "sgd"  #: local solver: sgd | armijo (FedLi-LS's line search)
    summary: str = ""
    #: the RoundLoop that runs it (gossip_pfl.train.WORKLOADS): "model" trains networks
    workload: str = "model"
    surrogate: str = "mixture"  #: the clients' private variables: one of SURROGATES

    def __post_init__(self) -> None:  # a typo in a new entry would run something else
        for field, value, known in (
            ("topology", self.topology, ("server", "given", "none")),
            ("solver", self.solver, ("sgd", "armijo")),
            ("surrogate", self.surrogate, SURROGATES),
            ("rule", self.rule, (*RULE_NAMES, "em_memory", "em_naive")),
        ):
            if value not in known:
                raise GossipError(f"AlgorithmSpec {field}={value!r}; known: {', '.join(known)}")


def _server(rule: str, summary: str, **kw) -> AlgorithmSpec:
    return AlgorithmSpec(True, "server", rule=rule, summary=summary, **kw)


def _em(topology: str, rule: str, summary: str) -> AlgorithmSpec:
    return AlgorithmSpec(True, topology, rule=rule, summary=summary, workload="expfam")


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "fedem": AlgorithmSpec(False, "server", summary="FedEM (Alg. 2) over the server schedule"),
    "dfedem": AlgorithmSpec(False, "given", summary="D-FedEM (Alg. 4) over any schedule"),
    "fedavg": _server("average", "FedAvg: one model over the server schedule"),
    "dsgd": AlgorithmSpec(True, "given", summary="decentralized SGD: one model, any schedule"),
    "local": AlgorithmSpec(True, "none", summary="Local: each peer alone (W = I)"),
    "fedprox": _server("average", "FedProx: FedAvg + mu/2 prox", prox=True),
    "fedavg_plus": _server("average", "FedAvg+: one local epoch at evaluation", finetune_epochs=1),
    "pfedme": _server("average", "pFedMe: personal models, prox to shared", surrogate="pfedme"),
    "apfl": _server("average", "APFL: personal + shared, learned alpha", surrogate="apfl"),
    "clustered": _server("clustered", "Clustered FL (Sattler et al.)"),
    "fedavgm": _server("fedavgm", "FedAvgM: server momentum on the pseudo-gradient"),
    "fedadam": _server("fedadam", "FedAdam (Reddi et al. 2021)"),
    "fedyogi": _server("fedyogi", "FedYogi (Reddi et al. 2021)"),
    "fedadagrad": _server("fedadagrad", "FedAdagrad (Reddi et al. 2021)"),
    "fedexp": _server("fedexp", "FedExP: extrapolated server step (Jhunjhunwala et al. 2023)"),
    "fedli_lu": _server("fedli_lu", "FedLi-LU: SGD clients, capped Polyak server step"),
    "fedli_ls": _server("fedli_ls", "FedLi-LS: Armijo line search on clients", solver="armijo"),
    "scaffold": _server("scaffold", "SCAFFOLD (option II control variates)"),
    # EM in sufficient-statistic space (Dieuleveut et al. 2021; gossip_pfl.expfam)
    "fedem_em": _em("server", "em_memory", "FedEM in statistic space: memories, compression"),
    "naive_em": _em("server", "em_naive", "compressed federated EM without memories"),
    "vr_fedem": _em("server", "em_memory", "VR-FedEM: FedEM with the SPIDER estimator"),
    "gossip_fedem_em": _em("given", "em_memory", "FedEM in statistic space over gossip (new)"),
    "gossip_vr_fedem": _em("given", "em_memory", "VR-FedEM over gossip (new)"),
    # PeFLL (Scott et al. 2024; gossip_pfl.algorithms.pefll): a hub's hypernetwork
    "pefll": AlgorithmSpec(
        True, "server", workload="pefll", summary="PeFLL: a hypernetwork writes each model"
    ),
}


def build_surrogate(cfg, spec: AlgorithmSpec, components: int, task: str):
    """The surrogate a named algorithm uses (see ``base.Surrogate``)."""
    from gossip_pfl.algorithms.mixture import MixtureSurrogate
    from gossip_pfl.algorithms.personal import APFLSurrogate, PFedMeSurrogate

    a = cfg.algorithm
    personal_lr = a.personal_lr if a.personal_lr is not None else a.lr
    if spec.surrogate == "pfedme":
        return PFedMeSurrogate(1, task, a.batch_size, a.mu or 15.0, a.inner_steps, personal_lr)
    if spec.surrogate == "apfl":
        alpha_lr = a.alpha_lr if a.alpha_lr is not None else personal_lr
        return APFLSurrogate(1, task, a.batch_size, a.alpha, personal_lr, alpha_lr)
    return MixtureSurrogate(components, task, a.batch_size, a.pi_init, cfg.seed, a.q_smoothing)


def build_solver(cfg, spec: AlgorithmSpec, rule):
    """The local solver an algorithm uses, with the config's step sizes; a rule may ask for
    its own client solver (FedLi-LS's line search, also in its gossip form)."""
    from gossip_pfl.runtime.solver import LocalArmijo, LocalSGD

    a = cfg.algorithm
    mu = a.mu if spec.prox else 0.0
    decay = tuple(a.lr_decay)
    if spec.solver == "armijo" or rule.client_solver == "armijo":
        ls = cfg.line_search
        return LocalArmijo(a.lr, 0.0, a.weight_decay, mu, decay, ls.c, ls.beta, ls.eta_max,
                           ls.max_trials, ls.reset)  # fmt: skip
    return LocalSGD(a.lr, a.momentum, a.weight_decay, mu, decay)


def get_algorithm(name: str) -> AlgorithmSpec:
    if name not in ALGORITHMS:
        raise GossipError(
            f"unknown algorithm.name {name!r}; known: {', '.join(sorted(ALGORITHMS))}"
        )
    return ALGORITHMS[name]
