"""Baselines with a private personal model beside the shared one (M = 1): pFedMe and APFL.

Both are surrogates in the sense of ``base.Surrogate``: the shared model u is what is mixed; the
personal model (and APFL's mixing weight alpha) never leave the peer and are updated inside the
local steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gossip_pfl.algorithms.base import weighted_loss_grad
from gossip_pfl.algorithms.losses import probabilities
from gossip_pfl.runtime.stack import PersonalSteps


@dataclass(frozen=True)
class _PersonalModelBase:
    components: int
    task: str
    batch_size: int
    step_reads_personal = True  # shared_grad reads and updates the personal models' rows

    def begin_round(self, ctx, theta, personal, mask):
        return personal, None

    def predict(self, logits: torch.Tensor, personal: dict) -> torch.Tensor:
        return probabilities(logits[:, 0], self.task)


@dataclass(frozen=True)
class PFedMeSurrogate(_PersonalModelBase):
    """pFedMe (Dinh et al. 2020; FedEM paper App. F.3): the surrogate in w is
    f_i(theta(w)) + lam/2 ||theta(w) - w||^2 with theta(w) = prox_{f_i/lam}(w), solved
    approximately by ``inner_steps`` gradient steps; its gradient in w is lam (w - theta).
    The server step is plain averaging (beta = 1). Peers predict with their personal theta."""

    lam: float = 15.0
    inner_steps: int = 5
    personal_lr: float = 0.01

    def init_personal(self, peers: np.ndarray, theta0: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"model": theta0.expand(len(peers), *theta0.shape).clone()}

    def shared_grad(self, ctx, theta, personal, rows, x, y, sw):
        model = personal["model"][rows]
        for _ in range(self.inner_steps):  # approximate prox: min f(th) + lam/2 ||th - w||^2
            g, loss = weighted_loss_grad(ctx, model, x, y, sw, self.batch_size)
            model = model - self.personal_lr * (g + self.lam * (model - theta))
        personal["model"][rows] = model
        return self.lam * (theta - model), loss

    def compiled_steps(self, personal: dict) -> PersonalSteps:
        """:meth:`shared_grad`'s steps for the binary linear model's fused round."""
        return PersonalSteps(
            "pfedme", personal["model"], lam=self.lam, inner_steps=self.inner_steps,
            personal_lr=self.personal_lr,
        )  # fmt: skip

    def eval_state(self, theta: torch.Tensor, personal: dict) -> torch.Tensor:
        return personal["model"]


@dataclass(frozen=True)
class APFLSurrogate(_PersonalModelBase):
    """APFL (Deng et al. 2020): a shared model w trained on the local loss, a private model v,
    and a learned weight alpha; the peer predicts with alpha v + (1 - alpha) w, and v and alpha
    descend the loss of that mixed model."""

    alpha: float = 0.5
    personal_lr: float = 0.1
    alpha_lr: float = 0.1

    def init_personal(self, peers: np.ndarray, theta0: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "model": theta0.expand(len(peers), *theta0.shape).clone(),
            "alpha": torch.full((len(peers),), self.alpha, device=theta0.device),
        }

    def shared_grad(self, ctx, theta, personal, rows, x, y, sw):
        v, alpha = personal["model"][rows], personal["alpha"][rows][:, None, None]
        mixed = alpha * v + (1 - alpha) * theta
        g_mixed, _ = weighted_loss_grad(ctx, mixed, x, y, sw, self.batch_size)
        # (v and alpha are views where rows is a slice: each read before it is written)
        g_alpha = ((v - theta) * g_mixed).sum(dim=(1, 2))
        personal["model"][rows] = v - self.personal_lr * alpha * g_mixed
        personal["alpha"][rows] = (alpha[:, 0, 0] - self.alpha_lr * g_alpha).clamp(0.0, 1.0)
        return weighted_loss_grad(ctx, theta, x, y, sw, self.batch_size)

    def compiled_steps(self, personal: dict) -> PersonalSteps:
        """:meth:`shared_grad`'s steps for the binary linear model's fused round."""
        return PersonalSteps(
            "apfl", personal["model"], personal["alpha"], personal_lr=self.personal_lr,
            alpha_lr=self.alpha_lr,
        )  # fmt: skip

    def eval_state(self, theta: torch.Tensor, personal: dict) -> torch.Tensor:
        alpha = personal["alpha"][:, None, None]
        return alpha * personal["model"] + (1 - alpha) * theta
