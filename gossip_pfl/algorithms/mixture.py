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
    losses: torch.Tensor, mask: torch.Tensor, steps: int, tol: float = 1e-10
) -> torch.Tensor:
    """Maximum-likelihood mixture weights, components fixed: pi (L, M) from uniform.

    ``losses`` (L, M, N) per-sample losses, ``mask`` (L, N). A client's objective, the mean
    over its samples of log sum_m pi_m lik_m (lik = exp(-loss), shifted by the per-sample
    minimum loss so huge losses cannot underflow everything), is concave in pi, with gradient
    g. ``steps = 1`` takes EM's step pi_m <- pi_m g_m once (the paper's experiments).
    Otherwise: Newton steps on the objective plus mu sum_m log pi_m over the simplex (an
    interior-point method, as Koenker and Mizera, "Convex optimization, shape constraints,
    compound decisions, and empirical Bayes rules", 2014, use for the same problem, where EM
    is slow), each at most 0.99 of the way to the simplex's edge, halved until the barrier
    objective rises enough (Armijo: a safeguard; on every case tried the first length rose),
    mu cut 10x each time a step's Newton decrement is small.
    Plain EM creeps near a weight going to 0: 300 steps left the synthetic study's unseen
    clients' pi up to 0.12 from the optimum; this certifies it within 16 steps there.

    A client stops when log max_m g_m < ``tol`` (in float64, before pi is cast to the losses'
    dtype): that bounds how far its objective is below the maximum (at the maximum
    max_m g_m = 1), whatever the solver. Each client stops on its
    own (its pi does not depend on the clients beside it in the call, a rank's share), or
    after ``steps``; clients without samples keep uniform weights. The host reads whether
    every client stopped every ``CHECK_EVERY`` steps, not every one (on a GPU each read waits
    for the device); each client's pi is kept from the step that stopped it, so the result is
    the same.
    """
    lik = torch.exp(-(losses - losses.min(dim=1, keepdim=True).values)).double()  # (L, M, N)
    weight = mask.double() / mask.sum(-1, keepdim=True).clamp_min(1)  # 1/n_i on real samples
    n_clients, m = lik.shape[:2]
    pi = torch.full((n_clients, m), 1.0 / m, dtype=torch.float64, device=lik.device)
    has = mask.sum(-1, keepdim=True) > 0

    def gradient(pi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each sample's mixture likelihood (L, N), the objective's gradient g (L, M))."""
        denom = torch.einsum("lmn,lm->ln", lik, pi).clamp_min(1e-300)
        return denom, torch.einsum("lmn,ln->lm", lik, weight / denom)

    if steps == 1:
        return torch.where(has, pi * gradient(pi)[1], pi).to(losses.dtype)
    mu = torch.full((n_clients, 1), 0.1, dtype=torch.float64, device=lik.device)
    shrink = 0.5 ** torch.arange(BACKTRACKS, dtype=torch.float64, device=lik.device)
    rows = torch.arange(n_clients, device=lik.device)

    def barrier(p: torch.Tensor) -> torch.Tensor:
        """The objective plus mu sum log p at points p (L, K, M): (L, K)."""
        dens = torch.bmm(p, lik).clamp_min(1e-300)  # (L, K, N)
        return (weight[:, None] * torch.log(dens)).sum(-1) + mu * torch.log(p).sum(-1)

    stopped = ~has
    for k in range(steps):
        denom, g = gradient(pi)
        stopped = stopped | (torch.log(g.amax(-1, keepdim=True)) < tol)
        grad = g + mu / pi
        curv = torch.bmm(lik * (weight / denom**2)[:, None], lik.transpose(1, 2))
        curv = curv + torch.diag_embed(mu / pi**2)  # minus the Hessian: positive definite
        # (solve_ex: no check of the result, which on a GPU would wait for the device)
        x = torch.linalg.solve_ex(curv, torch.stack([grad, torch.ones_like(pi)], -1))[0]
        nu = x[..., 0].sum(-1, keepdim=True) / x[..., 1].sum(-1, keepdim=True)
        step = x[..., 0] - nu * x[..., 1]  # Newton's ascent step, along the simplex (sums to 0)
        decrement = (step * grad).sum(-1, keepdim=True)  # step' curv step
        room = torch.where(step < 0, 0.99 * pi / (-step).clamp_min(1e-300), 1.0)
        t = room.amin(-1, keepdim=True).clamp_max(1.0) * shrink  # (L, K) trial lengths
        trials = pi[:, None] + t[..., None] * step[:, None]  # (L, K, M)
        at_pi = (weight * torch.log(denom)).sum(-1, keepdim=True)  # (barrier(pi), from denom)
        now = at_pi + mu * torch.log(pi).sum(-1, keepdim=True)
        rises = barrier(trials) >= now + 0.25 * t * decrement
        first = torch.where(rises.any(-1), rises.int().argmax(-1), BACKTRACKS - 1)
        new = trials[rows, first]
        new = new / new.sum(-1, keepdim=True)
        # (a singular system, e.g. two equal components with mu near 0, leaves pi as it is)
        pi = torch.where(stopped | ~torch.isfinite(new).all(-1, keepdim=True), pi, new)
        mu = torch.where(decrement < 0.5, (mu * 0.1).clamp_min(max(tol, 1e-12) / (10 * m)), mu)
        if (k + 1) % CHECK_EVERY == 0 and bool(stopped.all()):
            break
    return pi.to(losses.dtype)


#: steps of :func:`fit_mixture_weights` between the host's reads of whether it stopped
CHECK_EVERY = 8
#: halvings of a Newton step :func:`fit_mixture_weights` tries (all at once, the first kept)
BACKTRACKS = 12
