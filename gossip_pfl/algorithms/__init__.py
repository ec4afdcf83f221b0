"""Algorithms as compositions: a surrogate (personal-variable update + loss for the shared
variables), the local solver's options, and where the shared variables are mixed.

FedEM and D-FedEM are the same composition on different schedules; FedAvg, decentralized SGD
and Local are the mixture surrogate with one component.
"""

from __future__ import annotations

from dataclasses import dataclass

from gossip_pfl.errors import GossipError


@dataclass(frozen=True)
class AlgorithmSpec:
    """How a named algorithm is composed."""

    single_model: bool  #: M is forced to 1
    #: "server" (the hub schedule), "given" (the config's schedule), "none" (W = I),
    #: "clusters" (Clustered FL's server rule: averaging within learned clusters)
    topology: str
    prox: bool = False  #: FedProx's proximal term toward the round's starting model
    finetune_epochs: int = 0  #: FedAvg+: local epochs on a copy before evaluation
    summary: str = ""


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "fedem": AlgorithmSpec(False, "server", summary="FedEM (Alg. 2) over the server schedule"),
    "dfedem": AlgorithmSpec(False, "given", summary="D-FedEM (Alg. 4) over any schedule"),
    "fedavg": AlgorithmSpec(True, "server", summary="FedAvg: one model over the server schedule"),
    "dsgd": AlgorithmSpec(True, "given", summary="decentralized SGD: one model, any schedule"),
    "local": AlgorithmSpec(True, "none", summary="Local: each peer alone (W = I)"),
    "fedprox": AlgorithmSpec(True, "server", prox=True, summary="FedProx: FedAvg + mu/2 prox"),
    "fedavg_plus": AlgorithmSpec(
        True, "server", finetune_epochs=1, summary="FedAvg+: one local epoch at evaluation"
    ),
    "pfedme": AlgorithmSpec(True, "server", summary="pFedMe: personal models, prox to shared"),
    "apfl": AlgorithmSpec(True, "server", summary="APFL: personal + shared, learned alpha"),
    "clustered": AlgorithmSpec(True, "clusters", summary="Clustered FL (Sattler et al.)"),
}


def build_surrogate(cfg, spec: AlgorithmSpec, components: int, task: str):
    """The surrogate a named algorithm uses (see ``base.Surrogate``)."""
    from gossip_pfl.algorithms.mixture import MixtureSurrogate
    from gossip_pfl.algorithms.personal import APFLSurrogate, PFedMeSurrogate

    a = cfg.algorithm
    personal_lr = a.personal_lr if a.personal_lr is not None else a.lr
    if cfg.algorithm.name == "pfedme":
        return PFedMeSurrogate(1, task, a.batch_size, a.mu or 15.0, a.inner_steps, personal_lr)
    if cfg.algorithm.name == "apfl":
        alpha_lr = a.alpha_lr if a.alpha_lr is not None else personal_lr
        return APFLSurrogate(1, task, a.batch_size, a.alpha, personal_lr, alpha_lr)
    return MixtureSurrogate(components, task, a.batch_size, a.pi_init, cfg.seed, a.q_smoothing)


def get_algorithm(name: str) -> AlgorithmSpec:
    if name not in ALGORITHMS:
        raise GossipError(
            f"unknown algorithm.name {name!r}; known: {', '.join(sorted(ALGORITHMS))}"
        )
    return ALGORITHMS[name]
