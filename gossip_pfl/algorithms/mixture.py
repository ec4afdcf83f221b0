"""FedEM's surrogate: M shared components u = Theta, private mixture weights v = pi.

With M = 1 the responsibilities are all 1 and the surrogate is plain empirical risk, so FedAvg,
decentralized SGD and Local are this same piece with one component.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gossip_pfl.algorithms.base import weighted_loss, weighted_loss_grad
from gossip_pfl.algorithms.losses import probabilities
from gossip_pfl.runtime.stack import PendingEStep

PI_STREAM = 7  #: keeps the pi draws apart from the minibatch streams (0, 1) of the same peer


@dataclass(frozen=True)
class MixtureSurrogate:
    """Federated surrogate of Alg. 3/5 for a mixture of ``components`` models."""

    components: int
    task: str
    batch_size: int
    pi_init: str = "uniform"  #: uniform (the released code) | random (the paper's Alg. 2/4)
    seed: int = 0
    q_smoothing: float = 0.0  #: eps: loss weights (1 - eps) q + eps / M; pi from the plain q
    #: shared_grad reads neither the personal state nor the peers' rows (the trainer leaves
    #: the mixture weights in the peers' order during the steps)
    step_reads_personal = False

    def init_personal(self, peers: np.ndarray, theta0: torch.Tensor) -> dict[str, torch.Tensor]:
        """Mixture weights pi (L, M) of the peers with ids ``peers``: uniform, as the released
        code starts, or drawn uniformly from the simplex (Dirichlet(1)) per peer, as the paper's
        "randomly initialize pi" reads. Random weights break the symmetry between components
        from the first round: each component starts out trained on a different reweighting of
        the peers, instead of every component seeing every sample with weight 1/M."""
        m, dev = self.components, theta0.device
        if self.pi_init == "uniform" or m == 1:
            return {"pi": torch.full((len(peers), m), 1.0 / m, device=dev)}
        draws = [np.random.default_rng([self.seed, int(i), PI_STREAM]).dirichlet(np.ones(m))
                 for i in peers]  # fmt: skip
        return {"pi": torch.as_tensor(np.array(draws), dtype=torch.float32, device=dev)}

    def begin_round(self, ctx, theta: torch.Tensor, personal: dict, mask: torch.Tensor):
        """E-step with the components held before the local update, then the pi update (on
        a runtime that fuses it into the round's loop, left to it: the returned q and pi
        are filled during the local steps)."""
        if self.components == 1:
            return personal, None
        if getattr(ctx, "fuses_e_step", False):
            pending = PendingEStep.of(personal["pi"], mask.shape[1], self.q_smoothing)
            return {**personal, "pi": pending.pi}, pending
        # the others' rows 0, or (the binary linear model's closed form) theirs as well
        losses = ctx.train_losses(theta, active=ctx.participants)
        return self.update_personal(personal, losses, mask)

    def shared_grad(self, ctx, theta, personal, rows, x, y, sw):
        """q-weighted local loss: each component sees the samples it is responsible for."""
        return weighted_loss_grad(ctx, theta, x, y, sw, self.batch_size)

    @torch.no_grad()
    def shared_loss(self, ctx, theta, x, y, sw) -> torch.Tensor:
        """The loss whose gradient ``shared_grad`` gives, at other parameters (line search)."""
        return weighted_loss(ctx, theta, x, y, sw, self.batch_size)

    def eval_state(self, theta: torch.Tensor, personal: dict) -> torch.Tensor:
        return theta

    @torch.no_grad()
    def update_personal(
        self, personal: dict, losses: torch.Tensor, mask: torch.Tensor
    ) -> tuple[dict, torch.Tensor]:
        """E-step and pi update (the argmin of the surrogate in v).

        ``losses`` (L, M, N) is every training sample's loss under each component held before
        the local update; ``mask`` (L, N) marks real samples. Returns the new personal state and
        the responsibilities q (L, M, N) that weight the local solver's loss, smoothed towards
        1 / M by ``q_smoothing``: a pure EM step lets a component learn nothing from samples
        another explains better, so on inputs it rarely won it stays confidently wrong, which
        costs clients whose pi spreads over several components (docs/results.md, Fashion-MNIST).
        """
        pi = personal["pi"]
        # q = softmax_m(log pi_m - loss_m): log-sum-exp keeps huge losses finite (no NaN).
        q = torch.softmax(torch.log(pi.clamp_min(1e-30))[:, :, None] - losses, dim=1)
        q = q * mask[:, None, :]
        counts = mask.sum(-1, keepdim=True)
        new_pi = torch.where(counts > 0, q.sum(-1) / counts.clamp_min(1), pi)
        if self.q_smoothing:
            q = (1 - self.q_smoothing) * q + (self.q_smoothing / self.components) * mask[:, None, :]
        return {**personal, "pi": new_pi}, q

    def predict(self, logits: torch.Tensor, personal: dict) -> torch.Tensor:
        """Personalized prediction sum_m pi_m p_m(y|x): logits (L, M, B, C) -> (L, B, K)."""
        probs = probabilities(logits, self.task)
        return torch.einsum("lm,lmbk->lbk", personal["pi"].to(probs.dtype), probs)


@torch.no_grad()
def fit_mixture_weights(
    losses: torch.Tensor, mask: torch.Tensor, iters: int, tol: float = 1e-6
) -> torch.Tensor:
    """EM on the mixture weights alone, components fixed: pi (L, M) from uniform.

    ``losses`` (L, M, N) per-sample losses, ``mask`` (L, N). The likelihoods are computed once
    (shifted by the per-sample minimum loss, so huge losses cannot underflow everything); each
    iteration is then q = pi * lik / sum_m, pi = mean q. Each client stops when its pi moves
    less than ``tol`` (on its own: its pi does not depend on the clients beside it in the
    call, a rank's share), or after ``iters`` iterations. Clients without samples keep
    uniform weights.

    The host reads whether every client stopped every ``CHECK_EVERY`` iterations, not every
    one (on a GPU each read waits for the device); each client's pi is kept from the
    iteration that stopped it, so the result is the same.
    """
    lik = torch.exp(-(losses - losses.min(dim=1, keepdim=True).values)).double()  # (L, M, N)
    weight = mask.double() / mask.sum(-1, keepdim=True).clamp_min(1)  # 1/n_i on real samples
    pi = torch.full(lik.shape[:2], 1.0 / lik.shape[1], dtype=torch.float64, device=lik.device)
    has = mask.sum(-1, keepdim=True) > 0
    stopped = ~has  # (L, 1)
    for k in range(iters):
        # pi_m <- pi_m * mean_i lik_im / sum_k pi_k lik_ik  (two batched products per sweep)
        denom = torch.einsum("lmn,lm->ln", lik, pi).clamp_min(1e-300)
        new = pi * torch.einsum("lmn,ln->lm", lik, weight / denom)
        done = (new - pi).abs().amax(-1, keepdim=True) < tol
        pi = torch.where(stopped, pi, new)
        stopped = stopped | done
        if (k + 1) % CHECK_EVERY == 0 and bool(stopped.all()):
            break
    return pi.to(losses.dtype)


#: iterations of :func:`fit_mixture_weights` between the host's reads of whether it stopped
CHECK_EVERY = 16
