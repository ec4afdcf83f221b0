"""Compiled CPU loops (numba) for the binary linear model: a round of SGD (plain, or with
momentum, FedProx's proximal term, weight decay or SCAFFOLD's correction; with FedEM's
E-step, peer by peer, before the peer's steps; :func:`personal_round`: with pFedMe's or APFL's
personal models), the E-step's losses and the mixture's scores, each one pass over a peer's
samples; and the round plan's shuffles (:func:`permutations`).

Why: with M = 3 components the linear model's products have three output columns, which
torch runs as small batched GEMMs far below this CPU's memory speed, and a step first gathers
its minibatch into a buffer, then reads it twice more (forward, backward). Here a peer is one
loop on one thread: its rows come from memory once a round (the E-step's pass) and stay in
the core's cache for its steps, its parameters too, a step's update is added four samples a
pass, and a round of every step is one call. On the synthetic D-FedEM (300 peers, M = 3) a
round's loop takes about a fifth of the torch operations' time (docs/speed-notes.md).

Each peer's numbers come from one thread in a fixed order, so they do not depend on the
thread count nor on which peers share the rank. They round differently from the torch path
(other summation orders; ``fastmath`` lets LLVM reassociate sums to vectorize them), which
``runtime.cpu_kernels: false`` runs instead (tests/test_speed.py checks the two against each
other). Compiled once per machine and cached beside this file (numba's ``cache=True``).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

# reassociation and fused multiply-adds: the dot products vectorize (16 lanes on AVX-512)
_FAST = {"reassoc", "contract", "nsz"}
_OPTS = {"cache": True, "fastmath": _FAST, "nogil": True}


@njit(inline="always", fastmath=_FAST)
def _dots(th, row, n, z):
    """z[m] = th[m, :n] . row[:n] for every component m. With three components the three
    sums share one pass over the row: their scalar remainders (n is not a multiple of the
    vector width) then overlap instead of running one after another."""
    M = z.shape[0]
    if M == 3:
        z0 = z1 = z2 = np.float32(0.0)
        for i in range(n):
            xi = row[i]
            z0 += th[0, i] * xi
            z1 += th[1, i] * xi
            z2 += th[2, i] * xi
        z[0], z[1], z[2] = z0, z1, z2
    else:
        for m in range(M):
            acc = np.float32(0.0)
            for i in range(n):
                acc += th[m, i] * row[i]
            z[m] = acc


_TINY = np.float32(1e-30)


@njit(inline="always")
def _log_loss(z, y):
    """The log-loss of logit ``z`` and label ``y``: max(z, 0) - z y + log(1 + e^-|z|) (torch's
    binary_cross_entropy_with_logits in exact form), in float64."""
    return max(z, 0.0) - z * y + math.log1p(math.exp(-abs(z)))


@njit(inline="always", fastmath=_FAST)
def _e_step(th, x, base, n_p, labels, pi, eps, q, new_pi, z, w, zs):
    """One peer's E-step (FedEM): q_mn = pi_m p_m(y_n | x_n) / sum_k pi_k p_k(y_n | x_n), the
    likelihood p_m = sigmoid(+-z_mn) at the components ``th`` (M, P); ``q`` (M, N) gets the
    responsibilities smoothed towards 1 / M by ``eps`` (0 on padding), ``new_pi`` (M,) their
    plain mean (pi's update; ``pi`` (M,) floored at 1e-30, as the torch path floors it).

    One exp per likelihood, no log (the torch path's softmax of log pi - loss is the same
    number): where every pi_m p_m underflows (a far-off sample, a diverging run) the sample
    falls back to that log-domain softmax (:func:`_log_domain`), so q never turns 0 / 0.
    With M = 3 the per-sample values are scalars, as in :func:`_dots`: 0.86x the round's
    loop on one thread against loads and stores of small arrays, with the same operations
    (the same numbers)."""
    M = th.shape[0]
    one = np.float32(1.0)
    keep, share = one - eps, eps / M
    acc = np.zeros(M, dtype=np.float64)
    if M == 3:
        f0, f1, f2 = max(pi[0], _TINY), max(pi[1], _TINY), max(pi[2], _TINY)
        a0 = a1 = a2 = 0.0
        for n in range(n_p):
            _dots(th, x[base + n], th.shape[1], z)
            zs[0, n], zs[1, n], zs[2, n] = z[0], z[1], z[2]
            sign = one if labels[n] == 1 else -one
            w0 = f0 / (one + np.exp(-sign * z[0]))
            w1 = f1 / (one + np.exp(-sign * z[1]))
            w2 = f2 / (one + np.exp(-sign * z[2]))
            total = w0 + w1 + w2
            if total >= _TINY:
                w0, w1, w2 = w0 / total, w1 / total, w2 / total
            else:
                _log_domain(z, sign, pi, w)
                w0, w1, w2 = w[0], w[1], w[2]
            a0 += w0
            a1 += w1
            a2 += w2
            q[0, n], q[1, n], q[2, n] = keep * w0 + share, keep * w1 + share, keep * w2 + share
        acc[0], acc[1], acc[2] = a0, a1, a2
    else:
        for n in range(n_p):
            _dots(th, x[base + n], th.shape[1], z)
            for m in range(M):
                zs[m, n] = z[m]
            sign = one if labels[n] == 1 else -one
            total = np.float32(0.0)
            for m in range(M):
                w[m] = max(pi[m], _TINY) / (one + np.exp(-sign * z[m]))
                total += w[m]
            if total >= _TINY:
                for m in range(M):
                    w[m] /= total
            else:
                _log_domain(z, sign, pi, w)
            for m in range(M):
                acc[m] += w[m]
                q[m, n] = keep * w[m] + share
    for m in range(M):
        q[m, n_p:] = 0
        new_pi[m] = acc[m] / n_p if n_p > 0 else pi[m]


@njit(inline="always", fastmath=_FAST)
def _log_domain(z, sign, pi, w):
    """w_m = softmax over m of log pi_m - log(1 + e^(-sign z_m)), shifted by its maximum: the
    responsibilities of a sample where every pi_m sigmoid(sign z_m) underflows."""
    M = z.shape[0]
    top = -np.inf
    for m in range(M):
        sz = sign * z[m]
        w[m] = math.log(max(pi[m], _TINY)) + min(sz, 0) - math.log1p(math.exp(-abs(sz)))
        top = max(top, w[m])
    total = np.float32(0.0)
    for m in range(M):
        w[m] = math.exp(w[m] - top)
        total += w[m]
    for m in range(M):
        w[m] /= total


@njit(fastmath={"contract"}, nogil=True, cache=True)
def _accumulate(g, x, base, order, r, k):
    """g[m] += r[j, m] x[base + order[j]] for j = 0..k-1, a step's gradient sum.

    Four samples a pass over g (M = 3): g is loaded and stored a quarter as often, which was
    the steps' bound (one 16-lane store per 16-lane multiply-add). Every element still adds its
    terms one sample at a time in j's order, each a fused multiply-add, and ``fastmath`` here
    omits ``reassoc``: the same numbers as one sample a pass."""
    M, P = g.shape
    j = 0
    if M == 3:
        g0, g1, g2 = g[0], g[1], g[2]
        while j + 4 <= k:
            xa, xb = x[base + order[j]], x[base + order[j + 1]]
            xc, xd = x[base + order[j + 2]], x[base + order[j + 3]]
            a0, a1, a2 = r[j, 0], r[j, 1], r[j, 2]
            b0, b1, b2 = r[j + 1, 0], r[j + 1, 1], r[j + 1, 2]
            c0, c1, c2 = r[j + 2, 0], r[j + 2, 1], r[j + 2, 2]
            d0, d1, d2 = r[j + 3, 0], r[j + 3, 1], r[j + 3, 2]
            for i in range(P):
                u, v, s, t = xa[i], xb[i], xc[i], xd[i]
                g0[i] = g0[i] + a0 * u + b0 * v + c0 * s + d0 * t
                g1[i] = g1[i] + a1 * u + b1 * v + c1 * s + d1 * t
                g2[i] = g2[i] + a2 * u + b2 * v + c2 * s + d2 * t
            j += 4
    for t in range(j, k):
        row = x[base + order[t]]
        for m in range(M):
            rm = r[t, m]
            for i in range(P):
                g[m, i] += rm * row[i]


@njit(**_OPTS)
def sgd_round(
    lo, hi, theta, x, offsets, counts, labels, idx, weight, step, q, pi, eps, new_pi, affine, shift,
    losses, velocity, heavy,
):  # fmt: skip
    """A round of SGD on sum_b w_b q_bm log-loss(z_bm), in place on theta (L, M, P).

    ``x`` (N, P): the samples with a ones column (so z = theta . x includes the bias), peer
    by peer from ``offsets`` (L,); ``labels`` (L, N_max). ``idx``, ``weight`` (L, S, B): the
    round's plan (:func:`gossip_pfl.runtime.data.round_batches`, peer axis first): at step s
    peer p takes the samples idx[p, s, b] of weight[p, s, b] > 0. ``step`` (L,) is each
    peer's -lr / B, ``q`` (L, M, N_max) the responsibilities (shape (0, 0, 0): weight 1).
    With ``pi`` (L, M) (not shape (0, 0)), each peer's E-step (:func:`_e_step`, smoothing
    ``eps``) first writes its ``q`` and ``new_pi`` from theta as the round starts: its
    samples are then in the core's cache for its steps (a separate pass over every peer
    leaves them in memory, and the steps' scattered reads wait on it), and keeps the logits:
    the peer's first step, still at the round's start, reads them instead of its dot products
    (the same numbers; 0.9x the round's time on one thread). A step is

        theta_m += sum_b c_bm (sigmoid(z_bm) - y_b) x_b,   c_bm = step * w_b * q_bm,

    every z_bm at the step's starting theta: first every r_bm = c_bm (sigmoid(z_bm) - y_b),
    then their sum into g (:func:`_accumulate`). With ``affine`` (L, 2) (not shape (0, 2)) a
    step adds ``affine[p, 0] (theta - theta_start) + affine[p, 1] theta`` (FedProx's proximal
    term and weight decay, each times -lr), and with ``shift`` (L, M, P) (not shape
    (0, 0, 0)) ``shift[p]`` (SCAFFOLD's correction times -lr). A batch's samples are taken
    in the order they are stored, so that the CPU prefetches their rows (``in_batch[n]``:
    sample n's summed weight in the batch, 0 if not in it; a sample drawn twice, as fixed
    local steps may draw it across two permutations, counts twice). With ``losses`` (L,)
    float64 (not shape (0,)), a peer that steps gets its last step's objective there (FedLi's:
    sum_b w_b q_bm log-loss(z_bm) / max(sum_b w_b, 1), at the step's starting theta).

    With ``velocity`` (L, M, P) (not shape (0, 0, 0)) the steps take momentum, as
    ``torch.optim.SGD`` (dampening 0): ``step`` is then each peer's 1 / B and ``affine`` and
    ``shift`` are not times -lr (the step's direction d in the gradient's units), and
    ``heavy`` (L, 2) holds each peer's momentum and -lr: velocity = momentum velocity + d,
    theta += -lr velocity (:func:`_add_step`)."""
    L, M, P = theta.shape
    S = idx.shape[1]
    weighted = q.shape[0] > 0
    g = np.zeros((M, P), dtype=np.float32)
    z = np.zeros(M, dtype=np.float32)
    w = np.zeros(M, dtype=np.float32)
    in_batch, order, wts, r = _batch_buffers(labels.shape[1], M)
    e_step = pi.shape[0] > 0
    zs = np.zeros((M, labels.shape[1] if e_step else 0), dtype=np.float32)
    affine_on, shift_on = affine.shape[0] > 0, shift.shape[0] > 0
    start = np.zeros((M, P), dtype=np.float32)  # the peer's theta as the round starts
    tracking = losses.shape[0] > 0
    momentum = velocity.shape[0] > 0
    for p in range(lo, hi):
        last = -1  # the peer's last step, whose objective it keeps
        if tracking:
            for s in range(S):
                for b in range(idx.shape[2]):
                    if weight[p, s, b] > 0:
                        last = s
        th = theta[p]
        prox = affine[p, 0] if affine_on else np.float32(0.0)
        decay = affine[p, 1] if affine_on else np.float32(0.0)
        if prox != 0:
            start[:] = th
        if e_step:
            _e_step(th, x, offsets[p], counts[p], labels[p], pi[p], eps, q[p], new_pi[p], z, w,
                    zs)  # fmt: skip
        stepped = False
        for s in range(S):
            k = _batch(idx[p, s], weight[p, s], counts[p], in_batch, order, wts)
            if k == 0:
                continue
            first = not stepped
            stepped = True
            keep = s == last
            total = summed = 0.0
            for j in range(k):
                n = order[j]
                wn = wts[j]
                if e_step and first:  # theta is the round's start: the E-step's logits
                    for m in range(M):
                        z[m] = zs[m, n]
                else:
                    _dots(th, x[offsets[p] + n], P, z)
                wc = wn * step[p]
                yn = np.float32(labels[p, n])
                for m in range(M):
                    c = wc * q[p, m, n] if weighted else wc
                    r[j, m] = c / (np.float32(1.0) + np.exp(-z[m])) - yn * c
                if keep:
                    summed += wn
                    for m in range(M):
                        total += wn * (q[p, m, n] if weighted else 1.0) * _log_loss(z[m], yn)
            if keep:
                losses[p] = total / max(summed, 1.0)
            _accumulate(g, x, offsets[p], order, r, k)
            _add_step(th, g, prox, decay, start, shift, p, affine_on, shift_on, velocity, heavy,
                      momentum)  # fmt: skip


@njit(inline="always")
def _batch_buffers(n, M):
    """:func:`_batch`'s buffers for peers of up to ``n`` samples: ``in_batch``, ``order``,
    ``wts``, and a step's residuals ``r`` (n, M)."""
    return (np.zeros(n, dtype=np.float32), np.zeros(n, dtype=np.int64),
            np.zeros(n, dtype=np.float32), np.zeros((n, M), dtype=np.float32))  # fmt: skip


@njit(inline="always")
def _batch(idx, weight, n_p, in_batch, order, wts):
    """One step's batch (``idx``, ``weight`` (B,) of the round's plan, a peer with ``n_p``
    samples): its samples in the order they are stored into ``order``, each one's summed
    weight into ``wts``; the number of them (0: no step). ``in_batch`` (all zero) is left
    zero."""
    taken = False
    for b in range(idx.shape[0]):
        if weight[b] > 0:
            in_batch[idx[b]] += weight[b]
            taken = True
    if not taken:  # (a peer sitting out, a short peer's last steps: no pass over its samples)
        return 0
    k = 0  # without a branch per sample
    for n in range(n_p):
        order[k] = n
        k += in_batch[n] != 0
    for j in range(k):
        wts[j] = in_batch[order[j]]
        in_batch[order[j]] = 0
    return k


@njit(inline="always", fastmath=_FAST)
def _add_step(th, g, prox, decay, start, shift, p, affine_on, shift_on, velocity, heavy,
              momentum):  # fmt: skip
    """th += g, with ``affine_on`` plus ``prox (th - start) + decay th``, with ``shift_on``
    plus ``shift[p]`` (the kernels' coefficients hold -lr); g is left zero. With
    ``momentum``, as ``torch.optim.SGD`` takes it (dampening 0, the velocity in the
    gradient's units, zero before the first step): d = g (+ the terms, not times -lr), then
    ``velocity[p]`` = mu velocity + d and th += -lr velocity, ``heavy[p]`` = (mu, -lr)."""
    M, P = th.shape
    if momentum:
        vel, mu, neg_lr = velocity[p], heavy[p, 0], heavy[p, 1]
        for m in range(M):
            for i in range(P):
                v = th[m, i]
                d = g[m, i]
                if affine_on:
                    d = d + prox * (v - start[m, i]) + decay * v
                if shift_on:
                    d = d + shift[p, m, i]
                b = mu * vel[m, i] + d
                vel[m, i] = b
                th[m, i] = v + neg_lr * b
                g[m, i] = 0
    elif affine_on or shift_on:
        for m in range(M):
            for i in range(P):
                v = th[m, i]
                u = g[m, i] + prox * (v - start[m, i]) + decay * v
                th[m, i] = v + (u + shift[p, m, i] if shift_on else u)
                g[m, i] = 0
    else:
        for m in range(M):
            for i in range(P):
                th[m, i] += g[m, i]
                g[m, i] = 0


@njit(inline="always", fastmath=_FAST)
def _weighted_pass(th, x, base, labels, order, wts, k, q, p, weighted, scale, r, z, g, grad,
                   loss=True):  # fmt: skip
    """One pass over a step's batch (n = order[j], j < k) at parameters ``th`` (M, P), as the
    round's steps take it (:func:`_accumulate`): with ``loss`` the return value sum_j wts[j]
    sum_m q_mn log-loss(z_mn) in float64 (q 1 unless ``weighted``; else 0), with ``grad``
    g += scale sum_j wts[j] q_mn (sigmoid(z_mn) - y_n) x_n."""
    M, P = th.shape
    total = 0.0
    for j in range(k):
        n = order[j]
        _dots(th, x[base + n], P, z)
        yn = np.float32(labels[n])
        for m in range(M):
            zm = z[m]
            qm = q[p, m, n] if weighted else np.float32(1.0)
            if loss:
                total += wts[j] * qm * _log_loss(zm, yn)
            if grad:
                c = wts[j] * qm * scale
                r[j, m] = c / (np.float32(1.0) + np.exp(-zm)) - yn * c
    if grad:
        _accumulate(g, x, base, order, r, k)
    return total


RESET_GROW, RESET_KEEP, RESET_MAX = 0, 1, 2  # armijo_round's resets


@njit(**_OPTS)
def armijo_round(
    lo, hi, theta, x, offsets, counts, labels, idx, weight, q, eta, losses, batches, batch_size,
    decay, prox, c, beta, eta_max, max_trials, reset,
):  # fmt: skip
    """A round of SGD with a stochastic Armijo line search on each minibatch (FedLi-LS's
    client: :class:`gossip_pfl.runtime.solver.LocalArmijo`, whose torch form this follows
    step for step), in place on theta (L, M, P), each peer's step size ``eta`` (L, float64)
    and its last minibatch objective ``losses`` (L, float64). The plan and ``q`` as in
    :func:`sgd_round`; the objective of a batch is its weighted log-loss over
    max(sum of its weights, 1) plus ``decay`` / 2 ||theta||^2 and ``prox`` / 2 ||theta -
    theta at the round's start||^2, the direction its gradient. From eta (``reset``: grown by
    2^(1 / ``batches[p]``) up to ``eta_max``, kept, or ``eta_max``) the trials go down by
    ``beta`` until the objective falls by ``c`` eta ||d||^2 (at most ``max_trials``, the last
    taken); no step where ||d|| < 1e-8. Each trial's loss is a pass over the batch's rows,
    which stay in the core's cache."""
    L, M, P = theta.shape
    S = idx.shape[1]
    weighted = q.shape[0] > 0
    g = np.zeros((M, P), dtype=np.float32)
    d = np.zeros((M, P), dtype=np.float32)
    cand = np.zeros((M, P), dtype=np.float32)
    start = np.zeros((M, P), dtype=np.float32)
    z = np.zeros(M, dtype=np.float32)
    in_batch, order, wts, r = _batch_buffers(labels.shape[1], M)
    inv_b = np.float32(1.0) / np.float32(batch_size)
    decay32, prox32 = np.float32(decay), np.float32(prox)  # (the direction's, in float32)
    for p in range(lo, hi):
        th, base = theta[p], offsets[p]
        if prox != 0:
            start[:] = th
        for s in range(S):
            k = _batch(idx[p, s], weight[p, s], counts[p], in_batch, order, wts)
            if k == 0:
                continue
            summed = np.float32(0.0)
            for j in range(k):
                summed += wts[j]
            # the torch form's factor: the batch's mean over its weights, not over B
            mean = np.float32(batch_size) / max(summed, np.float32(1.0))
            total = _weighted_pass(th, x, base, labels[p], order, wts, k, q, p, weighted, inv_b,
                                   r, z, g, True)  # fmt: skip
            losses[p] = total * inv_b * mean
            f0, g2 = losses[p], 0.0
            for m in range(M):
                for i in range(P):
                    v = th[m, i]
                    u = decay32 * v + g[m, i] * mean
                    if prox != 0:
                        u += prox32 * (v - start[m, i])
                    d[m, i] = u
                    g[m, i] = 0
                    f0 += 0.5 * decay * (np.float64(v) * v)
                    if prox != 0:  # (FedProx's term is the searched objective's too)
                        a = np.float64(v) - start[m, i]
                        f0 += 0.5 * prox * (a * a)
                    g2 += np.float64(u) * u
            if not g2 >= 1e-16:  # (||d|| < 1e-8: no step, eta as it was)
                continue
            tried = eta[p]
            if reset == RESET_GROW:
                tried = min(tried * 2.0 ** (1.0 / batches[p]), eta_max)
            elif reset == RESET_MAX:
                tried = eta_max
            for trial in range(max_trials):
                t32 = np.float32(tried)
                f1 = 0.0
                for m in range(M):
                    for i in range(P):
                        cand[m, i] = th[m, i] - t32 * d[m, i]
                        f1 += 0.5 * decay * (np.float64(cand[m, i]) * cand[m, i])
                        if prox != 0:
                            a = np.float64(cand[m, i]) - start[m, i]
                            f1 += 0.5 * prox * (a * a)
                loss = _weighted_pass(cand, x, base, labels[p], order, wts, k, q, p, weighted,
                                      inv_b, r, z, g, False)  # fmt: skip
                f1 += loss * inv_b * mean
                if f1 <= f0 - c * tried * g2 or trial == max_trials - 1:
                    break
                tried = tried * beta
            eta[p] = tried
            t32 = np.float32(tried)
            for m in range(M):
                for i in range(P):
                    th[m, i] -= t32 * d[m, i]


PFEDME, APFL = 1, 2  # personal_round's kinds


@njit(**_OPTS)
def personal_round(
    lo, hi, theta, x, offsets, counts, labels, idx, weight, step, affine, shift, model, alpha,
    kind, inv_b, lam, inner_steps, personal_lr, alpha_lr, velocity, heavy,
):  # fmt: skip
    """A round of SGD on the shared model theta (L, M, P) of pFedMe or APFL (``kind``), with
    each peer's personal model ``model`` (L, M, P) and APFL's weight ``alpha`` (L,) updated
    in each step, as their torch forms do (:mod:`gossip_pfl.algorithms.personal`), all in
    place. The plan, ``step`` (each peer's -lr, not divided by B; with momentum 1),
    ``affine``, ``shift``, ``velocity`` and ``heavy`` as in :func:`sgd_round`; a gradient is
    of the log-loss summed with the plan's weights times ``inv_b`` (1 / B). A step of

    - pFedMe: ``inner_steps`` times v -= personal_lr (grad f(v) + lam (v - theta)), then
      theta += step lam (theta - v);
    - APFL: at w = alpha v + (1 - alpha) theta, v -= personal_lr alpha grad f(w) and alpha
      -= alpha_lr (v - theta) . grad f(w) (clamped to [0, 1], from v before its update),
      then theta += step grad f(theta).

    The batch's rows are read once from memory and stay in the core's cache for the step's
    gradients (pFedMe: six passes over them, APFL two)."""
    L, M, P = theta.shape
    S = idx.shape[1]
    g = np.zeros((M, P), dtype=np.float32)
    z = np.zeros(M, dtype=np.float32)
    mixed = np.zeros((M, P), dtype=np.float32)
    q = np.zeros((0, 0, 0), dtype=np.float32)  # (unweighted: q is not read)
    in_batch, order, wts, r = _batch_buffers(labels.shape[1], M)
    affine_on, shift_on = affine.shape[0] > 0, shift.shape[0] > 0
    start = np.zeros((M, P), dtype=np.float32)
    one = np.float32(1.0)
    momentum = velocity.shape[0] > 0
    for p in range(lo, hi):
        th, v, base = theta[p], model[p], offsets[p]
        prox = affine[p, 0] if affine_on else np.float32(0.0)
        decay = affine[p, 1] if affine_on else np.float32(0.0)
        if prox != 0:
            start[:] = th
        for s in range(S):
            k = _batch(idx[p, s], weight[p, s], counts[p], in_batch, order, wts)
            if k == 0:
                continue
            if kind == PFEDME:
                for _ in range(inner_steps):
                    _weighted_pass(v, x, base, labels[p], order, wts, k, q, p, False, inv_b,
                                   r, z, g, True, False)  # fmt: skip
                    for m in range(M):
                        for i in range(P):
                            u = v[m, i]
                            v[m, i] = u - personal_lr * (g[m, i] + lam * (u - th[m, i]))
                            g[m, i] = 0
                for m in range(M):
                    for i in range(P):
                        g[m, i] = step[p] * (lam * (th[m, i] - v[m, i]))
            else:
                a = alpha[p]
                for m in range(M):
                    for i in range(P):
                        mixed[m, i] = a * v[m, i] + (one - a) * th[m, i]
                _weighted_pass(mixed, x, base, labels[p], order, wts, k, q, p, False, inv_b, r,
                               z, g, True, False)  # fmt: skip
                g_alpha = np.float32(0.0)
                for m in range(M):
                    for i in range(P):
                        g_alpha += (v[m, i] - th[m, i]) * g[m, i]
                        v[m, i] -= personal_lr * a * g[m, i]
                        g[m, i] = 0
                alpha[p] = min(max(a - alpha_lr * g_alpha, np.float32(0.0)), one)
                _weighted_pass(th, x, base, labels[p], order, wts, k, q, p, False,
                               step[p] * inv_b, r, z, g, True, False)  # fmt: skip
            _add_step(th, g, prox, decay, start, shift, p, affine_on, shift_on, velocity, heavy,
                      momentum)  # fmt: skip


@njit(**_OPTS)
def bce_losses(lo, hi, theta, x, offsets, counts, y, out):
    """out[p, m, n] = log-loss of peer p's sample n under component m (the binary linear
    model; logits theta[p, m] . x[offsets[p] + n], ``x`` with its ones column), for n below
    ``counts[p]``; the rest of ``out`` is left as it is. ``y`` (L, N) labels."""
    L, M, P = theta.shape
    z = np.zeros(M, dtype=np.float32)
    for p in range(lo, hi):
        th = theta[p]
        for n in range(counts[p]):
            _dots(th, x[offsets[p] + n], P, z)
            for m in range(M):
                out[p, m, n] = _log_loss(z[m], y[p, n])


@njit(**_OPTS)
def mixture_scores(lo, hi, theta, pi, x, y, counts, nll, correct):
    """Per peer, the summed log-loss ``nll`` and number correct ``correct`` (L,) float64 of
    the mixture prediction p(y = 1) = sum_m pi_m sigmoid(w_m . x + b_m) over its ``counts[p]``
    samples ``x`` (L, N, F), labels ``y`` (L, N); theta (L, M, F + 1) = [w, b]. A
    probability below 1e-12 counts as 1e-12, and p > 0.5 predicts class 1.

    The log-loss takes one log per 16 samples, of their probabilities' product in float64
    (at least 1e-192: no underflow), not one per sample: the logs were a fifth of the time,
    and the sum is no less exact than float32 logs summed."""
    L, M, P = theta.shape
    F = P - 1
    z = np.zeros(M, dtype=np.float32)
    for p in range(lo, hi):
        th = theta[p]
        loss = 0.0
        hits = 0.0
        product = 1.0
        for n in range(counts[p]):
            _dots(th, x[p, n], F, z)
            p1 = np.float32(0.0)
            for m in range(M):
                p1 += pi[p, m] / (np.float32(1.0) + np.exp(-(z[m] + th[m, F])))
            one = y[p, n] == 1
            p_true = p1 if one else np.float32(1.0) - p1
            product *= np.float64(max(p_true, np.float32(1e-12)))
            if n % 16 == 15:
                loss -= math.log(product)
                product = 1.0
            hits += (p1 > 0.5) == one
        nll[p] = loss - math.log(product)
        correct[p] = hits


#: the loops a run of the binary linear model on a CPU calls whatever its algorithm (its
#: forward loads them); pFedMe's and APFL's ``personal_round`` and FedLi-LS's
#: ``armijo_round`` are loaded by the runs that take them
COMMON = ("sgd_round", "bce_losses", "mixture_scores")
LOOPS = (*COMMON, "armijo_round", "personal_round")


def warm_up(
    names: Iterable[str] = LOOPS, notice: Callable[[], None] | None = None, after: float = 1.0
) -> None:
    """Load (or compile) the loops ``names`` for the arrays the runtime passes (float32
    parameters and samples, int64 indices and labels, all C-contiguous), on empty ranges: a
    run's setup loads those it calls, not its first round, and a process that forks workers
    (the tests' fork server) loads them once, not each worker (numba's start and the loads
    take about 0.5 s a process). Without numba's cache each one compiles (0.3 to 9 s on a
    2-core machine, 15 s all five): a run loads only its own, and ``notice()`` is called
    (from another thread) once loading has taken ``after`` seconds, so that a first run can
    say why it is silent. tests/test_speed.py checks that a run after it loads no other
    signature."""
    f32, i64 = np.float32, np.int64
    theta, x, labels = np.zeros((1, 1, 2), f32), np.zeros((1, 2), f32), np.zeros((1, 1), i64)
    ints, floats = np.zeros(1, i64), np.zeros(1, f32)  # per peer: offsets, counts; step
    pi, cube_i, cube_f = np.zeros((1, 1), f32), np.zeros((1, 1, 1), i64), np.zeros((1, 1, 1), f32)
    calls = {
        "sgd_round": lambda: sgd_round(
            0, 0, theta, x, ints, ints, labels, cube_i, cube_f, floats, cube_f, pi, f32(0), pi,
            np.zeros((0, 2), f32), cube_f, np.zeros(0), cube_f, pi),
        "armijo_round": lambda: armijo_round(
            0, 0, theta, x, ints, ints, labels, cube_i, cube_f, cube_f, np.zeros(1),
            np.zeros(1), ints, 1, 0.0, 0.0, 0.1, 0.9, 1.0, 1, RESET_GROW),
        "personal_round": lambda: personal_round(
            0, 0, theta, x, ints, ints, labels, cube_i, cube_f, floats, np.zeros((0, 2), f32),
            cube_f, theta, floats, PFEDME, f32(1), f32(0), 1, f32(0), f32(0), cube_f, pi),
        "bce_losses": lambda: bce_losses(0, 0, theta, x, ints, ints, labels, cube_f),
        "mixture_scores": lambda: mixture_scores(0, 0, theta, pi, cube_f, labels, ints,
                                                 np.zeros(1), np.zeros(1)),
    }  # fmt: skip
    timer = None
    if notice is not None:
        timer = threading.Timer(after, notice)
        timer.daemon = True
        timer.start()
    try:
        for name in names:
            calls[name]()
    finally:
        if timer is not None:  # (a notice under way is over before this returns)
            timer.cancel()
            timer.join()


_pool: ThreadPoolExecutor | None = None
_pool_size = _pool_pid = 0
# enough ranges that the last one, which one thread finishes while the others wait, is short
_RANGES_PER_THREAD = 16


def run(kernel, threads: int, work: np.ndarray, *args) -> None:
    """``kernel(lo, hi, *args)`` over the peers 0..L-1 in contiguous ranges of about equal
    ``work`` (L,) (samples each), on ``threads`` threads (the run's torch threads). With
    several, the ranges are 16 per thread, taken by whichever thread is free (another busy
    thread, such as the round planner, then slows no range down for all); the calling thread
    takes part. The kernels release the GIL, and each peer is one thread's, so no number
    depends on the split."""
    global _pool, _pool_size, _pool_pid
    L = len(work)
    parts = min(threads * _RANGES_PER_THREAD, L)
    if threads <= 1 or parts <= 1:
        kernel(0, L, *args)
        return
    cum = np.cumsum(work, dtype=np.float64)
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, parts) / parts)
    bounds = [0, *np.maximum.accumulate(cuts).tolist(), L]
    # a peer with more than a range's share of the samples leaves empty ranges: dropped here,
    # not taken for the end of the work (a thread that drew one stopped, and the ranges after
    # it were never run: those peers took no step and kept garbage q and pi)
    ranges = iter([(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if lo < hi])
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                span = next(ranges, None)
            if span is None:
                return
            kernel(*span, *args)

    if _pool_size < threads - 1 or _pool_pid != os.getpid():  # a forked child has no threads
        _pool = ThreadPoolExecutor(threads - 1, "gossip-kernel")
        _pool_size, _pool_pid = threads - 1, os.getpid()
    futures = [_pool.submit(worker) for _ in range(threads - 1)]
    worker()
    for f in futures:
        f.result()


# ---- the round plan's shuffles: NumPy's Generator(PCG64).shuffle, many peers in one call ----
_U = np.uint64
_M32 = _U(0xFFFFFFFF)
_MULT_HI, _MULT_LO = _U(0x2360ED051FC65DA4), _U(0x4385DF649FCCF645)  # PCG64's multiplier


@njit(inline="always")
def _mul64(a, b):
    """The 128-bit product of two uint64 as (high, low) words."""
    a_lo, a_hi, b_lo, b_hi = a & _M32, a >> _U(32), b & _M32, b >> _U(32)
    p0, p1, p2 = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo
    mid = (p0 >> _U(32)) + (p1 & _M32) + (p2 & _M32)
    return a_hi * b_hi + (p1 >> _U(32)) + (p2 >> _U(32)) + (mid >> _U(32)), (mid << _U(32)) | (
        p0 & _M32
    )


@njit(inline="always")
def _pcg64_next(s):
    """PCG64 (XSL-RR 128/64): advance ``s`` = [state_hi, state_lo, inc_hi, inc_lo] and
    return the next uint64 (pcg_setseq_128_xsl_rr_64_random_r)."""
    hi, lo = _mul64(s[1], _MULT_LO)
    hi += s[0] * _MULT_LO + s[1] * _MULT_HI
    lo2 = lo + s[3]
    hi += s[2] + (_U(1) if lo2 < lo else _U(0))
    s[0], s[1] = hi, lo2
    x, rot = hi ^ lo2, hi >> _U(58)
    return (x >> rot) | (x << ((_U(64) - rot) & _U(63)))


@njit(inline="always")
def _add128(a_hi, a_lo, b_hi, b_lo):
    """(a + b) mod 2**128, each as (high, low) uint64 words."""
    lo = a_lo + b_lo
    return a_hi + b_hi + (_U(1) if lo < a_lo else _U(0)), lo


@njit(inline="always")
def _hashmix(v, h):
    """SeedSequence's hashmix of the uint32 ``v`` with the running hash ``h``: (value, next h)."""
    v = (v ^ h) & _M32
    h = (h * _U(0x931E8875)) & _M32
    v = (v * h) & _M32
    return v ^ (v >> _U(16)), h


@njit(cache=True, nogil=True)
def pcg64_seeds(words, out):
    """out[k] = (state_hi, state_lo, inc_hi, inc_lo) uint64 of ``PCG64(SeedSequence(words[k]))``
    for each row of 4 uint32 ``words``: NumPy's SeedSequence (its hash of the entropy into a
    pool of 4 words, then 8 output words; numpy/random/bit_generator.pyx, after M. O'Neill's
    seed_seq), then PCG64's seeding (pcg_setseq_128_srandom_r), in 32-bit words kept in
    uint64. The same numbers as :func:`gossip_pfl.runtime.data._pcg64_states`, without the
    GIL (tests/test_speed.py checks both against NumPy)."""
    pool = np.empty(4, dtype=np.uint64)
    o = np.empty(8, dtype=np.uint64)
    for k in range(words.shape[0]):
        h = _U(0x43B0D7E5)
        for i in range(4):
            pool[i], h = _hashmix(_U(words[k, i]), h)
        for src in range(4):
            for dst in range(4):
                if src != dst:
                    v, h = _hashmix(pool[src], h)
                    r = (_U(0xCA01F9DD) * pool[dst] - _U(0x4973F715) * v) & _M32
                    pool[dst] = r ^ (r >> _U(16))
        h = _U(0x8B51F9DD)  # generate_state(4, uint64): 8 words, little-endian pairs
        for i in range(8):
            v = (pool[i % 4] ^ h) & _M32
            h = (h * _U(0x58F38DED)) & _M32
            v = (v * h) & _M32
            o[i] = v ^ (v >> _U(16))
        a, b = o[0] | (o[1] << _U(32)), o[2] | (o[3] << _U(32))  # the initial state
        c, d = o[4] | (o[5] << _U(32)), o[6] | (o[7] << _U(32))  # the stream
        inc_hi, inc_lo = (c << _U(1)) | (d >> _U(63)), (d << _U(1)) | _U(1)
        # srandom_r: state = ((inc + initstate) * MULT + inc) mod 2**128
        t_hi, t_lo = _add128(inc_hi, inc_lo, a, b)
        hi, lo = _mul64(t_lo, _MULT_LO)
        hi += t_hi * _MULT_LO + t_lo * _MULT_HI
        out[k, 0], out[k, 1] = _add128(hi, lo, inc_hi, inc_lo)
        out[k, 2], out[k, 3] = inc_hi, inc_lo


@njit(cache=True, nogil=True)
def permutations(states, counts, reps, stride, out, filled):
    """Peer l's ``reps`` permutations of 0..counts[l]-1, drawn one after another from its
    PCG64 stream ``states[l]`` = (state_hi, state_lo, inc_hi, inc_lo) uint64, at
    out[l, r * stride[l] : r * stride[l] + counts[l]]: the numbers of ``rng.shuffle`` on
    ``np.arange(counts[l])``, ``reps`` times, of ``np.random.Generator(PCG64)`` in that state
    (NumPy's Fisher-Yates with ``random_interval``'s masked 32-bit draws, the second half of
    each 64-bit output kept for the next draw; tests/test_speed.py checks it against NumPy).
    ``filled`` (shaped as ``out``) gets 1 where a permutation was written. Only NumPy's
    32-bit branch is here: counts below 2**32 (round_batches checks)."""
    s = np.empty(4, dtype=np.uint64)
    for p in range(len(counts)):
        n = counts[p]
        s[:] = states[p]
        spare, has_spare = _U(0), False
        for r in range(reps):
            row = out[p, r * stride[p] : r * stride[p] + n]
            filled[p, r * stride[p] : r * stride[p] + n] = 1
            for k in range(n):
                row[k] = k
            for i in range(n - 1, 0, -1):
                mask = _U(i)
                mask |= mask >> _U(1)
                mask |= mask >> _U(2)
                mask |= mask >> _U(4)
                mask |= mask >> _U(8)
                mask |= mask >> _U(16)
                while True:  # a uint32: the spare half, else the low half of a new uint64
                    if has_spare:
                        v, has_spare = spare, False
                    else:
                        w = _pcg64_next(s)
                        v, spare, has_spare = w & _M32, w >> _U(32), True
                    v &= mask
                    if v <= _U(i):
                        break
                j = np.int64(v)
                row[i], row[j] = row[j], row[i]


# ---- the fused linear round's host side (data.linear_host), on the planner's thread ----
# One signature each, of any layout ('A'): the plan's (S, L, B) views are C-ordered with one
# peer or one step, F-ordered with B = 1, neither otherwise; numba takes each as this one
# (loaded at import, with no compiling or loading of another in a round).
@njit("void(float32[:, :, :], boolean[:, :])", cache=True, nogil=True)
def step_peers(weight, out):
    """out[s, l] = whether peer l has a real sample (weight > 0) in step s; weight (S, L, B)."""
    S, L, B = weight.shape
    for s in range(S):
        for p in range(L):
            out[s, p] = False
            for b in range(B):
                if weight[s, p, b] > 0:
                    out[s, p] = True
                    break


@njit(
    "void(int64[:, :, :], float32[:, :, :], int64[:], boolean[:, :], boolean, float32, "
    "int32[:], int32[:, :], float32[:, :])",
    cache=True,
    nogil=True,
)
def linear_host_fill(idx, weight, steps, taking, dense, inv_b, rows, ix, w):
    """:func:`gossip_pfl.runtime.data.linear_host`'s layout, step after step of ``steps``:
    every peer (``dense``) or those ``taking`` (S, L) the step, each row's peer in ``rows``,
    its sample indices in ``ix`` and weight * inv_b in ``w`` (float32: NumPy's numbers). It
    holds no GIL, where NumPy's gathers and copies took and gave it back many times a round,
    slowing the round's own thread."""
    B = idx.shape[2]
    k = 0
    for s in steps:
        for p in range(idx.shape[1]):
            if not (dense or taking[s, p]):
                continue
            if k == len(rows):  # (numba checks no bounds: a write past them corrupts memory)
                raise IndexError("linear_host_fill: more rows than its outputs hold")
            rows[k] = p
            for b in range(B):
                ix[k, b] = idx[s, p, b]
                w[k, b] = weight[s, p, b] * inv_b
            k += 1
