"""PeFLL: a hub whose hypernetwork writes each client's model from the client's descriptor.

Scott, Zakerinia, Lampert, "PeFLL: Personalized Federated Learning by Learning to Learn"
(ICLR 2024). A client's descriptor is the mean embedding of its labelled data,
``v(S) = mean_{(x, y) in S} phi(x, y; eta_v)``; the hub's hypernetwork turns it into a whole
model, ``theta = h(v; eta_h)``. A round of PeFLL-train on the star, with its six message kinds::

    hub -> client   embed_params     eta_v
    client -> hub   descriptor       v_i = v(B_i; eta_v) on one batch B_i
    hub -> client   client_model     theta_i = h(v_i; eta_h)
    client -> hub   model_delta      dtheta_i after k local SGD steps from theta_i
    hub -> client   descriptor_grad  g_v_i = (d theta_i / d v_i)^T (-dtheta_i)
    client -> hub   embed_grad       (d v_i / d eta_v)^T g_v_i
    hub             Adam on (eta_h, eta_v) with the participants' mean gradients

``-dtheta_i`` stands in for the client's loss gradient at theta_i (for k = 1 plain step of
size lr it is exactly lr times it), so the hub's step is first-order backpropagation through
``h(v(B_i))`` split between the hub and the client. Clients keep nothing between rounds; the
hub keeps both networks and their Adam state (:class:`PeFLLHub`, in checkpoints).
PeFLL-predict (any client, unseen ones included) is the first half: descriptor from all the
client's training data, one forward pass of h, no fine-tuning.

Every step is batched over the round's clients: one forward and one vector-Jacobian product
of h for all of them (``torch.func.vjp``), one call of the embedding network over all their
batches, one vectorised VJP of it (each client's message is its own), and the k
local steps through the client model's batched layers. Clients are spread over ranks
(:class:`~gossip_pfl.runtime.placement.Placement`); the hub lives on rank 0, and what it sends
or receives travels by ``all_reduce_sum`` (the other ranks add zeros).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, vjp
from torch.optim.adam import adam

from gossip_pfl.algorithms.rules import Inbox, Rule, State
from gossip_pfl.errors import GossipError
from gossip_pfl.runtime.stack import ParamLayout

#: the message kinds of a training round, in protocol order
KINDS = ("embed_params", "descriptor", "client_model", "model_delta", "descriptor_grad",
         "embed_grad")  # fmt: skip


@functools.cache
def fused_adam(device_type: str) -> bool | None:
    """Whether torch.optim's fused Adam kernel runs on ``device_type`` (one pass over the
    8.7M-entry hypernetwork; CPUs from PyTorch 2.4, GPUs earlier): True, else None (torch's
    default form). Found by trying it on one entry, not from the version string."""
    one = torch.zeros(1, device=device_type)
    try:
        adam([one], [one + 1], [one.clone()], [one.clone()], [], [one[0].clone()], fused=True,
             amsgrad=False, beta1=0.9, beta2=0.999, lr=0.1, weight_decay=0.0, eps=1e-8,
             maximize=False)  # fmt: skip
    except (RuntimeError, TypeError):  # (no kernel here; a build whose adam takes no fused)
        return None
    return True


# ---- networks ------------------------------------------------------------------------------
def check_emittable(model: nn.Module, model_name: str) -> None:
    """The hypernetwork writes Linear and Conv2d weights and biases; anything else (a
    recurrent cell, an embedding table, BatchNorm statistics) is a one-line error."""
    for module_name, module in model.named_modules():
        own = [n for n, _ in module.named_parameters(recurse=False)]
        own += [n for n, _ in module.named_buffers(recurse=False)]
        if not own:
            continue
        kind = type(module).__name__
        if not isinstance(module, (nn.Linear, nn.Conv2d)) or set(own) - {"weight", "bias"}:
            tensor = f"{module_name}.{own[0]}" if module_name else own[0]
            raise GossipError(
                f"config key 'model.name': the PeFLL hypernetwork cannot emit tensor "
                f"'{tensor}' of model '{model_name}' (unknown tensor kind: {kind}); it writes "
                "Linear and Conv2d weights and biases (e.g. model.name: lenet)"
            )


class HyperNetwork(nn.Module):
    """h(v): an MLP ``l -> hidden -> ... -> hidden`` (ReLU), then one linear head per tensor
    of the client model; ``forward(v (S, l)) -> (S, P)``, the flat parameters in the order of
    the client model's :class:`ParamLayout`."""

    def __init__(self, dim: int, layout: ParamLayout, hidden: int = 100, layers: int = 3):
        super().__init__()
        sizes = [dim] + [hidden] * layers
        body: list[nn.Module] = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            body += [nn.Linear(a, b), nn.ReLU()]
        self.body = nn.Sequential(*body)
        self.heads = nn.ModuleList(nn.Linear(hidden, size) for size in layout.sizes)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        z = self.body(v)
        return torch.cat([head(z) for head in self.heads], dim=-1)


class Functional:
    """A module evaluated at a flat parameter vector (so the hub's state, its messages and
    its Adam moments are all plain vectors)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.layout = ParamLayout(module)

    def initial(self) -> torch.Tensor:
        return self.layout.flatten(self.module)

    def __call__(self, params, *args: torch.Tensor) -> torch.Tensor:
        """The module at ``params``: a flat vector, or a dict of tensors by name."""
        if isinstance(params, torch.Tensor):
            params = self.layout.unflatten(params)
        return functional_call(self.module, params, args)

    def vjp(self, fn, flat: torch.Tensor, *args: torch.Tensor):
        """``torch.func.vjp`` of ``fn(params, *args)`` with the parameters as separate
        tensors, the gradient returned flat: differentiating the flat vector's views would
        build a full-size zero buffer per tensor (slow for the hypernetwork's heads)."""
        params = {k: v.contiguous() for k, v in self.layout.unflatten(flat).items()}
        _, pull = vjp(fn, params, *args)

        def pull_flat(cotangent: torch.Tensor) -> tuple:
            grads = pull(cotangent)
            flat_grad = torch.cat([grads[0][k].reshape(-1) for k in self.layout.names])
            return (flat_grad, *grads[1:])

        return pull_flat


def descriptors(embed: Functional, eta_v, x, y, w) -> torch.Tensor:
    """v for A clients at once: x (A, B, *in), y (A, B), w (A, B) sample weights (0 on
    padding) -> (A, l), the weighted mean embedding of each client's samples."""
    A, B = y.shape
    phi = embed(eta_v, x.flatten(0, 1), y.flatten()).view(A, B, -1)
    return (phi * w[..., None]).sum(1) / w.sum(1, keepdim=True).clamp_min(1)


# ---- the hub's state and update ------------------------------------------------------------
@dataclass(frozen=True)
class PeFLLHub(Rule):
    """The hub's rule, optax-style: ``state = init(eta_h, eta_v)``, ``state = update(inbox,
    state)``. ``inbox.mean`` holds the participants' mean gradients ``hyper_grad`` and
    ``embed_grad``; each is clipped to norm ``clip``, gets the objective's
    ``2 lambda ||eta||^2`` term and takes an Adam step (``torch.optim.Adam``'s, with
    ``weight_decay = 2 lambda``). The state also holds the descriptor normalization."""

    lr: float = 2e-4
    clip: float = 50.0
    lambda_h: float = 1e-3
    lambda_v: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    name = "pefll"

    def init(self, eta_h: torch.Tensor, eta_v: torch.Tensor) -> State:
        z = eta_h.new_zeros(())
        return {
            "eta_h": eta_h.clone(), "m_h": torch.zeros_like(eta_h), "s_h": torch.zeros_like(eta_h),
            "eta_v": eta_v.clone(), "m_v": torch.zeros_like(eta_v), "s_v": torch.zeros_like(eta_v),
            "step": z.clone(),
            # v -> (v - shift) / scale, set from the first descriptor the hub receives
            "desc_shift": z.clone(), "desc_scale": z + 1, "desc_set": z.clone(),
        }  # fmt: skip

    def update(self, inbox: Inbox, state: State) -> State:
        new = dict(state)
        for net, lam in (("h", self.lambda_h), ("v", self.lambda_v)):
            g = inbox.mean["hyper_grad" if net == "h" else "embed_grad"]
            if self.clip:  # as clip_grad_norm_: scale by clip / (norm + 1e-6) when above
                g = g * (self.clip / (g.norm() + 1e-6)).clamp(max=1.0)
            # torch.optim.Adam's step on copies (it works in place; the state is explicit),
            # its step count on the device: the host does not wait to read it (the default
            # form reads it unless capturable, which only GPUs take)
            eta, m, s, step = (state[k].clone() for k in (f"eta_{net}", f"m_{net}", f"s_{net}",
                                                          "step"))  # fmt: skip
            fused = fused_adam(eta.device.type)
            adam([eta], [g], [m], [s], [], [step], fused=fused, amsgrad=False,
                 capturable=not fused and eta.is_cuda, beta1=self.beta1, beta2=self.beta2,
                 lr=self.lr, weight_decay=2 * lam, eps=self.eps, maximize=False)  # fmt: skip
            new.update({f"eta_{net}": eta, f"m_{net}": m, f"s_{net}": s, "step": step})
        return new

    @staticmethod
    def normalize(state: State, v: torch.Tensor) -> State:
        """Fix the descriptor normalization from ``v[0]`` (the first descriptor the hub
        receives: the public code's choice) unless it is already set (chosen on the device,
        so the host does not wait to read the flag)."""
        std = v[0].std() if v.shape[1] > 1 else v.new_ones(())
        std = torch.where(std > 0, std, torch.ones_like(std))
        done = state["desc_set"] > 0
        return {**state, "desc_shift": torch.where(done, state["desc_shift"], v[0].mean()),
                "desc_scale": torch.where(done, state["desc_scale"], std),
                "desc_set": torch.ones_like(state["desc_set"])}  # fmt: skip


def hub_models(hyper: Functional, state: State, v: torch.Tensor, eta_h=None) -> torch.Tensor:
    """theta = h((v - shift) / scale; eta_h) for every row of v (S, l) -> (S, P)."""
    eta_h = state["eta_h"] if eta_h is None else eta_h
    return hyper(eta_h, (v - state["desc_shift"]) / state["desc_scale"])


__all__ = ["PeFLLHub", "HyperNetwork", "Functional", "KINDS", "check_emittable", "descriptors",
           "hub_models", "fused_adam"]  # fmt: skip
