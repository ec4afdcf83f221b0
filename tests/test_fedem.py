"""FedEM / D-FedEM as federated surrogate optimization: against a direct EM computation,
against each other, and the numerical edge cases."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _helpers import toy_dataset

from gossip_pfl.algorithms.mixture import MixtureSurrogate
from gossip_pfl.config import load_config
from gossip_pfl.data.base import ClientData, FederatedDataset
from gossip_pfl.errors import GossipError
from gossip_pfl.models import Linear
from gossip_pfl.runtime.stack import ParamLayout, init_components
from gossip_pfl.train import Trainer, fit_mixture_weights


def quiet(*_args, **_kw):
    pass


def cfg_for(tmp, algorithm="fedem", rounds=4, schedule=None, **algo):
    base = {
        "seed": 3,
        "rounds": rounds,
        "algorithm": {"name": algorithm, "components": 3, "lr": 0.3, "batch_size": 16, **algo},
        "schedule": schedule,
        "eval": {"every": rounds},
        "out": str(tmp),
    }
    return load_config(base=base)


@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_one_client_full_batch_equals_direct_em(eps, tmp_path):
    """One client, full batches, J gradient steps per round: FedEM is plain EM with gradient
    M-steps (with ``q_smoothing`` eps, on the loss weights (1 - eps) q + eps / M). Recompute
    it directly with torch.nn.functional on the whole dataset."""
    data = toy_dataset(1)
    client = data.clients[0]
    n = len(client.y_train)
    cfg = cfg_for(tmp_path, batch_size=n, local_steps=3, rounds=5, q_smoothing=eps)
    trainer = Trainer(cfg, dataset=data, log=quiet)
    for t in range(cfg.rounds):
        trainer.local_work(t)
        trainer.communicate(t)

    # Direct computation: same initial components, full-batch EM.
    layout = ParamLayout(Linear((5,), 1))
    theta = init_components(lambda: Linear((5,), 1), layout, 3, cfg.seed).double()  # (M, P)
    x = torch.as_tensor(client.x_train, dtype=torch.float64)
    y = torch.as_tensor(client.y_train, dtype=torch.float64)
    pi = torch.full((3,), 1 / 3, dtype=torch.float64)

    def losses(th):  # (M, n)
        logits = x @ th[:, :5].T + th[:, 5]
        return F.binary_cross_entropy_with_logits(logits.T, y.expand(3, n), reduction="none")

    for _ in range(cfg.rounds):
        q = torch.softmax(torch.log(pi)[:, None] - losses(theta), dim=0)  # E-step
        pi = q.mean(1)
        w = (1 - eps) * q + eps / 3
        for _ in range(3):  # gradient M-steps on sum_i w_i loss_i / n
            th = theta.clone().requires_grad_(True)
            (g,) = torch.autograd.grad((w * losses(th)).sum() / n, th)
            theta = theta - cfg.algorithm.lr * g
    np.testing.assert_allclose(
        trainer.shared_parameters()[0], theta.cpu().numpy(), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(
        trainer.personal["pi"][0].cpu().numpy(), pi.cpu().numpy(), rtol=1e-4, atol=1e-6
    )


def equal_size_dataset(n=6, m=40, dim=5, seed=1):
    rng = np.random.default_rng(seed)
    rules = rng.normal(size=(2, dim))
    clients = []
    for i in range(n):
        x = rng.normal(size=(m, dim)).astype(np.float32)
        y = (x @ rules[i % 2] > 0).astype(np.int64)
        clients.append(ClientData(x, y, x[:0], y[:0], x[:10], y[:10]))
    return FederatedDataset("equal", clients, (dim,), 2, "binary")


def test_dfedem_on_complete_graph_equals_fedem(tmp_path):
    """Complete graph with uniform weights 1/n is the server average when clients have equal
    sizes (n_t / n = 1 / T, and D-FedEM's step weight T n_t / n = 1)."""
    data = equal_size_dataset()
    complete = {"graph": "complete", "weights": "max_degree"}
    runs = {}
    for algo, schedule in (("fedem", None), ("dfedem", complete)):
        trainer = Trainer(cfg_for(tmp_path / algo, algo, schedule=schedule), data, log=quiet)
        trainer.run()
        runs[algo] = trainer.shared_parameters()
    np.testing.assert_allclose(runs["dfedem"], runs["fedem"], rtol=1e-5, atol=1e-6)


def test_step_client_weighting_on_complete_graph_equals_fedem(tmp_path):
    """D-FedEM's default weighting multiplies client t's step by T n_t / n (Alg. 4). With one
    full-batch step a round and W = J / T, the mix of the steps is then the server's n_t / n
    average of them, by linearity: FedEM's numbers on clients of unequal sizes. The plain
    step (client_weighting: none) differs."""
    data = toy_dataset(8)  # sizes 20, 33, ..., 111
    sizes = [len(c.y_train) for c in data.clients]
    assert len(set(sizes)) == 8
    complete = {"graph": "complete", "weights": "max_degree"}
    runs = {}
    for algo, schedule, weighting in (("fedem", None, "step"), ("dfedem", complete, "step"),
                                      ("dfedem", complete, "none")):  # fmt: skip
        cfg = cfg_for(tmp_path / f"{algo}_{weighting}", algo, schedule=schedule, rounds=3,
                      batch_size=max(sizes), local_steps=1, client_weighting=weighting)  # fmt: skip
        trainer = Trainer(cfg, data, log=quiet)
        step = np.array(sizes) * 8 / sum(sizes) if (algo, weighting) == ("dfedem", "step") else 1
        np.testing.assert_allclose(trainer.lr_scale.cpu().numpy(), step, rtol=1e-6)
        trainer.run()
        runs[algo, weighting] = trainer.shared_parameters()
    fedem = runs["fedem", "step"]
    np.testing.assert_allclose(runs["dfedem", "step"], fedem, rtol=1e-5, atol=1e-6)
    assert np.abs(runs["dfedem", "none"] - fedem).max() > 1e-3


def test_gossip_client_weighting_on_complete_graph_equals_fedem(tmp_path):
    """client_weighting: gossip mixes sum_j W_ij n_j theta_j / sum_j W_ij n_j; with W = J / T
    that is the server's n_t / n average, so D-FedEM equals FedEM on clients of unequal sizes.
    Without the weighting the uniform average differs."""
    data = toy_dataset(8)  # sizes 20, 33, ..., 111
    complete = {"graph": "complete", "weights": "max_degree"}
    runs = {}
    for algo, schedule, weighting in (
        ("fedem", None, "step"),
        ("dfedem", complete, "gossip"),
        ("dfedem", complete, "none"),
    ):
        cfg = cfg_for(tmp_path / f"{algo}_{weighting}", algo, schedule=schedule,
                      client_weighting=weighting)  # fmt: skip
        trainer = Trainer(cfg, data, log=quiet)
        trainer.run()
        runs[algo, weighting] = trainer.shared_parameters()
    fedem = runs["fedem", "step"]
    np.testing.assert_allclose(runs["dfedem", "gossip"], fedem, rtol=1e-5, atol=1e-6)
    assert np.abs(runs["dfedem", "none"] - fedem).max() > 1e-3


def test_gossip_client_weighting_mixes_with_the_size_weighted_matrix(tmp_path):
    """One mix on a ring: theta_new = D^-1 W N theta with N = diag(n), D = diag(W n), the
    dense matrix product in float64 (a row-stochastic W_ij n_j / sum_k W_ik n_k)."""
    cfg = cfg_for(tmp_path, "dfedem", schedule={"graph": "ring", "weights": "metropolis"},
                  client_weighting="gossip")  # fmt: skip
    trainer = Trainer(cfg, dataset=toy_dataset(8), log=quiet)
    gen = torch.Generator().manual_seed(0)
    trainer.nodes.copy_(torch.randn(trainer.nodes.shape, generator=gen))
    theta = trainer.nodes.double().cpu().numpy().reshape(8, -1)
    W, n = trainer.schedule.matrix(0), trainer.sizes.astype(np.float64)
    want = (W * n[None, :]) @ theta / (W @ n)[:, None]
    for t in range(2):
        trainer.communicate(t)
        got = trainer.nodes.double().cpu().numpy().reshape(8, -1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        want = (W * n[None, :]) @ want / (W @ n)[:, None]


def test_pi_stays_on_simplex_and_consensus_falls(tmp_path):
    schedule = {"graph": "ring", "weights": "metropolis"}
    cfg = cfg_for(tmp_path, "dfedem", schedule=schedule, lr=0.01)
    trainer = Trainer(cfg, dataset=toy_dataset(8), log=quiet)
    gen = torch.Generator().manual_seed(0)
    trainer.nodes += torch.randn(trainer.nodes.shape, generator=gen)  # peers disagree
    distances = [sum(trainer.consensus_distance())]
    for t in range(6):
        trainer.local_work(t)
        trainer.communicate(t)
        pi = trainer.personal["pi"]
        assert torch.all(pi >= 0)
        torch.testing.assert_close(pi.sum(1), torch.ones(8), rtol=0, atol=1e-6)
        distances.append(sum(trainer.consensus_distance()))
    assert all(b < a for a, b in zip(distances, distances[1:])), distances


def test_random_initial_pi_is_per_peer_and_on_the_simplex():
    """pi_init: random draws each peer's weights from its own seeded stream: on the simplex,
    different between peers, and the same row whichever subset of peers a rank holds."""
    theta0 = torch.zeros(3, 5)
    surrogate = MixtureSurrogate(3, "binary", 16, pi_init="random", seed=11)
    full = surrogate.init_personal(np.arange(8), theta0)["pi"]
    assert torch.all(full > 0)
    torch.testing.assert_close(full.sum(1), torch.ones(8), rtol=0, atol=1e-6)
    assert len({tuple(row.tolist()) for row in full}) == 8
    part = surrogate.init_personal(np.array([5, 2]), theta0)["pi"]
    torch.testing.assert_close(part, full[[5, 2]], rtol=0, atol=0)
    other_seed = MixtureSurrogate(3, "binary", 16, pi_init="random", seed=12)
    assert not torch.equal(other_seed.init_personal(np.arange(8), theta0)["pi"], full)
    uniform = MixtureSurrogate(3, "binary", 16).init_personal(np.arange(8), theta0)["pi"]
    torch.testing.assert_close(uniform, torch.full((8, 3), 1 / 3))


def test_e_step_stable_for_huge_losses():
    surrogate = MixtureSurrogate(3, "binary", 16)
    personal = {"pi": torch.full((2, 3), 1 / 3)}
    losses = torch.tensor([[[1e4, 2e4], [1e4 + 5, 3e4], [9e3, 2e4 - 1]]] * 2)  # (L, M, N)
    new, q = surrogate.update_personal(personal, losses, torch.ones(2, 2))
    assert torch.isfinite(q).all() and torch.isfinite(new["pi"]).all()
    # each sample goes to its smallest-loss component
    assert q[0, :, 0].argmax() == 2 and q[0, :, 1].argmax() == 2
    pi = fit_mixture_weights(losses, torch.ones(2, 2), 100)
    assert torch.isfinite(pi).all()
    torch.testing.assert_close(pi.sum(1), torch.ones(2), rtol=0, atol=1e-6)


def test_unseen_em_matches_closed_form():
    """Two components, likelihoods known: the fit is the maximum-likelihood pi."""
    lik = torch.tensor([[0.9, 0.2], [0.1, 0.8]])  # (M, N): sample 0 likes m0, sample 1 m1
    losses = -torch.log(lik)[None].repeat(1, 1, 50)  # 100 samples, half of each kind
    pi = fit_mixture_weights(losses, torch.ones(1, 100), 100)
    # d/dpi [0.5 log(0.9 p + 0.1 (1-p)) + 0.5 log(0.2 p + 0.8 (1-p))] = 0
    p = np.linspace(0, 1, 200001)
    f = 0.5 * np.log(0.9 * p + 0.1 * (1 - p)) + 0.5 * np.log(0.2 * p + 0.8 * (1 - p))
    assert pi[0, 0].item() == pytest.approx(p[np.argmax(f)], abs=1e-5)


def _plain_em(losses, mask, iters):
    """EM on pi alone (each step pi_m <- pi_m g_m), a fixed number of steps."""
    lik = torch.exp(-(losses - losses.min(dim=1, keepdim=True).values)).double()
    weight = mask.double() / mask.sum(-1, keepdim=True).clamp_min(1)
    pi = torch.full(lik.shape[:2], 1.0 / lik.shape[1], dtype=torch.float64)
    for _ in range(iters):
        pi = pi * torch.einsum("lmn,ln->lm", lik, weight / torch.einsum("lmn,lm->ln", lik, pi))
    return pi


def _unseen_case():
    """Five clients, three components, 40 samples each at most: components 0 and 1 nearly
    alike, 2 worse, so some optimal weights are 0 and EM creeps; client 3 has no samples."""
    gen = torch.Generator().manual_seed(4)
    base = torch.rand(5, 1, 40, generator=gen) * 3
    losses = base * torch.tensor([1.0, 1.02, 1.5])[:, None] + 0.3 * torch.rand(
        5, 3, 40, generator=gen
    )
    mask = (torch.rand(5, 40, generator=gen) < 0.8).float()
    mask[3] = 0
    return losses, mask


def test_unseen_em_reaches_the_maximum_likelihood_where_em_creeps():
    """Against an independent convex solver (cvxpy) on every client: pi within 1e-5 of the
    optimum, zero weights included, where 300 steps of plain EM are still 0.01 away; one step
    is EM's step from uniform; a client without samples keeps uniform weights."""
    cp = pytest.importorskip("cvxpy")
    losses, mask = _unseen_case()
    got, seen = fit_mixture_weights(losses, mask, 100), [0, 1, 2, 4]
    lik = torch.exp(-losses).double().numpy()
    for i in seen:
        pi, n = cp.Variable(3), mask[i].bool().numpy()
        cp.Problem(
            cp.Maximize(cp.sum(cp.log(lik[i][:, n].T @ pi))), [pi >= 0, cp.sum(pi) == 1]
        ).solve()
        np.testing.assert_allclose(got[i].numpy(), pi.value, atol=1e-5)
    assert (got[seen].min(1).values < 1e-6).sum() >= 2  # weights that go to 0
    assert (_plain_em(losses, mask, 300)[seen] - got[seen]).abs().max() > 0.01
    one = fit_mixture_weights(losses, mask, 1)
    torch.testing.assert_close(one[seen], _plain_em(losses, mask, 1)[seen].float())
    torch.testing.assert_close(got[3], torch.full((3,), 1 / 3))
    torch.testing.assert_close(one[3], torch.full((3,), 1 / 3))


@pytest.mark.parametrize("tol", [1e-10, 0.0])
def test_unseen_em_with_equal_components(tol):
    """Equal components make the Newton system singular along their difference (a run's
    components at their common start): all equal, pi stays uniform (any pi is optimal);
    two equal, their weights split evenly and their sum is the optimum of the merged pair."""
    losses = torch.rand(3, 3, 30, generator=torch.Generator().manual_seed(0))
    losses[0, 1:] = losses[0, 0]
    losses[1:, 1] = losses[1:, 0]
    pi = fit_mixture_weights(losses, torch.ones(3, 30), 100, tol)
    torch.testing.assert_close(pi[0], torch.full((3,), 1 / 3))
    torch.testing.assert_close(pi[1:, 0], pi[1:, 1], rtol=0, atol=1e-3)
    pair = fit_mixture_weights(losses[1:, 1:], torch.ones(2, 30), 100, tol)
    torch.testing.assert_close(pi[1:, 0] + pi[1:, 1], pair[:, 0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("tol", [1e-3, 1e-10, 0.0])
def test_unseen_em_stops_each_client_on_its_own_and_reads_its_stop_rarely(tol, monkeypatch):
    """Each client's pi is the one of fitting it alone (up to float rounding: the clients
    beside it are a rank's share; a common stop moved a client's pi by 2e-5), stopped where
    its own certificate holds: early, later, or at the step cap (tol 0). The host reads
    whether all stopped once every CHECK_EVERY steps (a wait for a GPU each), so a call reads
    as often as its slowest client alone."""
    from gossip_pfl.algorithms import mixture

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_ops

    losses, mask = _unseen_case()
    reads = []
    for i in range(5):
        with bench_ops.Waits() as mode:
            fit_mixture_weights(losses[i : i + 1], mask[i : i + 1], 40, tol)
        reads.append(len(mode.seen))
    want = torch.cat([fit_mixture_weights(losses[i : i + 1], mask[i : i + 1], 40, tol)
                      for i in range(5)])  # fmt: skip
    with bench_ops.Waits() as mode:
        got = fit_mixture_weights(losses, mask, 40, tol)
    assert torch.equal(got, want)  # (to the bit for these shapes on a CPU)
    assert len(mode.seen) == max(reads)
    assert reads[3] == 1  # the client without samples stops at once
    assert {1e-3: max(reads) == 1, 1e-10: 1 < max(reads) < 40 // mixture.CHECK_EVERY,
            0.0: max(reads) == 40 // mixture.CHECK_EVERY}[tol]  # fmt: skip
    if tol:  # the clients do stop at different steps (a read after every step, alone)
        monkeypatch.setattr(mixture, "CHECK_EVERY", 1)
        steps = set()
        for i in (0, 1, 2, 4):
            with bench_ops.Waits() as mode:
                fit_mixture_weights(losses[i : i + 1], mask[i : i + 1], 40, tol)
            steps.add(len(mode.seen))
        assert len(steps) > 1, steps


def test_unseen_em_keeps_a_client_whose_solve_failed_as_it_was(monkeypatch):
    """A singular system (a GPU's solver returns inf or NaN for it) leaves that client's pi
    where it was, the others' results as they are."""
    losses, mask = _unseen_case()
    want = fit_mixture_weights(losses, mask, 40)
    solve = torch.linalg.solve_ex

    def failing_for_client_0(a, b):
        x, info = solve(a, b)
        return x.index_fill(0, torch.tensor([0]), float("nan")), info

    monkeypatch.setattr(torch.linalg, "solve_ex", failing_for_client_0)
    got = fit_mixture_weights(losses, mask, 40)
    torch.testing.assert_close(got[0], torch.full((3,), 1 / 3))
    assert torch.equal(got[1:], want[1:])


def test_nan_learning_rate_names_round_and_peer(tmp_path):
    cfg = cfg_for(tmp_path, "dfedem", schedule={"graph": "ring"}, lr=3e38)
    with pytest.raises(GossipError, match=r"round \d+: .*peer \d+.*lower the steps: "
                                          r"algorithm.lr \(now 3e\+38\)$"):  # fmt: skip
        Trainer(cfg, dataset=toy_dataset(8), log=quiet).run()
    # a weight decay that blows up is named (it was blamed on algorithm.lr)
    cfg = cfg_for(tmp_path, "dfedem", schedule={"graph": "ring"}, weight_decay=1e10)
    with pytest.raises(GossipError, match=r"algorithm.lr \(now 0.3\), algorithm.weight_decay "
                                          r"\(now 1e\+10\)$"):  # fmt: skip
        Trainer(cfg, dataset=toy_dataset(8), log=quiet).run()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_bad_round_is_neither_logged_nor_saved(device, tmp_path):
    """On a GPU the finite check is read a round late (at the next round's start, or before a
    log or checkpoint): the error still names the round that went bad, and neither the metrics
    nor a checkpoint holds it."""
    cfg = cfg_for(tmp_path, "dfedem", schedule={"graph": "ring"}, lr=3e38)
    cfg.eval.every, cfg.checkpoint_every, cfg.runtime.device = 1, 1, device
    with pytest.raises(GossipError, match=r"round 1: .*\(first: peer \d+ on rank 0\)"):
        Trainer(cfg, dataset=toy_dataset(8), log=quiet).run()
    assert not (tmp_path / "checkpoint.pt").exists()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


@pytest.mark.parametrize("every, save", [(1, 0), (2, 0), (5, 0), (1, 1), (5, 2), (3, 4)])
def test_a_queued_finite_check_stops_before_the_bad_round_is_kept(every, save, monkeypatch,
                                                                   tmp_path):  # fmt: skip
    """The GPU's queued check (read at the next round's check, or before a log or
    checkpoint), forced on the CPU: a peer that goes bad in round 4 stops the run naming round
    4 and that peer, whatever the log and checkpoint intervals, and nothing of round 4 is
    logged or saved."""
    import json

    import gossip_pfl.train as train
    from gossip_pfl import checkpoint

    monkeypatch.setattr(train, "QUEUE_CHECK_ON", ("cpu",))
    steps = Trainer.local_steps

    def spoiled(self, theta, *args, **kw):  # peer 2 goes bad in round 4 (t = 3)
        steps(self, theta, *args, **kw)
        if args[2] == 3:
            theta[2, 1, 0] = float("nan")

    monkeypatch.setattr(Trainer, "local_steps", spoiled)
    cfg = cfg_for(tmp_path, "dfedem", rounds=8, schedule={"graph": "ring"})
    cfg.eval.every, cfg.checkpoint_every = every, save
    tr = Trainer(cfg, dataset=toy_dataset(8), log=quiet)
    with pytest.raises(GossipError, match=r"round 4: .*\(first: peer 2 on rank 0\)"):
        tr.run()
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(every, 4, every))
    saved = (tmp_path / "checkpoint.pt").exists()
    assert saved == (0 < save <= 3)
    if saved:
        assert checkpoint.load(tmp_path)["rounds_done"] == 3 // save * save


def test_peers_without_collectives_check_at_once(monkeypatch, tmp_path):
    """Peers that exchange point to point are not stopped together: each checks before it
    sends, even where the check is queued (on a GPU)."""
    import gossip_pfl.train as train

    monkeypatch.setattr(train, "QUEUE_CHECK_ON", ("cpu",))
    tr = Trainer(cfg_for(tmp_path, "dfedem", schedule={"graph": "ring"}), dataset=toy_dataset(8),
                 log=quiet)  # fmt: skip
    tr.comm, tr.collectives = _TwoRanks(0), False
    theta = tr.nodes[: len(tr.peers)].clone()
    theta[5, 0, 0] = float("inf")
    with pytest.raises(GossipError, match=r"round 2: .*\(first: peer 5 on rank 0\)"):
        tr._check_finite(1, theta)


@pytest.mark.parametrize("queued", [False, True])
def test_finite_check_reads_the_peers_private_state(queued, monkeypatch, tmp_path):
    """Mixture weights that went bad while the shared models stayed finite stop the run too
    (an APFL run whose private models went NaN ended with exit 0, its losses NaN)."""
    import gossip_pfl.train as train

    if queued:
        monkeypatch.setattr(train, "QUEUE_CHECK_ON", ("cpu",))
    tr = Trainer(cfg_for(tmp_path, "dfedem", schedule={"graph": "ring"}), dataset=toy_dataset(8),
                 log=quiet)  # fmt: skip
    theta = tr.nodes[: len(tr.peers)].clone()
    tr.personal["pi"][6, 2] = float("nan")
    with pytest.raises(GossipError, match=r"round 3: .*\(first: peer 6 on rank 0\)"):
        tr._check_finite(2, theta)
        tr.settle()
    theta[7, 0, 0] = float("inf")  # the first bad peer over every part, at once or queued
    tr.personal["pi"][2, 0] = float("nan")
    with pytest.raises(GossipError, match=r"round 3: .*\(first: peer 2 on rank 0\)"):
        tr._check_finite(2, theta)
        tr.settle()


@pytest.mark.parametrize("queued", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_finite_check_names_the_first_bad_peer(bad, queued, monkeypatch, tmp_path):
    """At once (a CPU), and queued as on a GPU (each peer's smallest and largest value read
    at the next check or the settle): the first bad peer is named, whichever kind of bad."""
    import gossip_pfl.train as train

    if queued:
        monkeypatch.setattr(train, "QUEUE_CHECK_ON", ("cpu",))
    tr = Trainer(cfg_for(tmp_path, "dfedem", schedule={"graph": "ring"}), dataset=toy_dataset(8),
                 log=quiet)  # fmt: skip
    theta = tr.nodes[: len(tr.peers)].clone()
    tr._check_finite(0, theta)  # finite: no error
    tr.settle()
    theta[5, 1, -1], theta[3, 0, 2] = bad, bad
    with pytest.raises(GossipError, match=r"round 1: .*\(first: peer 3 on rank 0\)"):
        tr._check_finite(0, theta)
        tr.settle()


class _TwoRanks:
    """A comm as rank 0 of two: the other rank's first bad peer + 1 (0: none) joins each sum."""

    rank, world_size, collectives = 0, 2, True

    def __init__(self, other: int) -> None:
        self.other = other

    def all_reduce_sum(self, tensor):
        return tensor.add_(self.other)


@pytest.mark.parametrize("other", [0, 7])
def test_finite_check_across_ranks_names_this_ranks_first_bad_peer(other, tmp_path):
    """With ranks the flag is worked out on the device and summed: no bad peer anywhere
    passes; one on another rank stops this one too (its peer unknown here); one here is named
    by its peer id."""
    tr = Trainer(cfg_for(tmp_path, "dfedem", schedule={"graph": "ring"}), dataset=toy_dataset(8),
                 log=quiet)  # fmt: skip
    tr.comm = _TwoRanks(other)
    tr.peers = np.arange(10, 18)  # this rank's peers are not 0..L-1
    theta = tr.nodes[: len(tr.peers)].clone()
    if other:
        with pytest.raises(GossipError, match=r"round 3: .*\(first: peer \? on rank 0\)"):
            tr._check_finite(2, theta)
    else:
        tr._check_finite(2, theta)
    theta[6, 2, 0], theta[4, 1, -1] = float("-inf"), float("nan")
    with pytest.raises(GossipError, match=r"round 3: .*\(first: peer 14 on rank 0\)"):
        tr._check_finite(2, theta)


def test_bad_components_and_shape(tmp_path):
    with pytest.raises(GossipError, match="algorithm.components"):
        cfg_for(tmp_path, components=0)
    with pytest.raises(GossipError, match="algorithm.pi_init.*uniform.random"):
        cfg_for(tmp_path, pi_init="dirichlet")
    with pytest.raises(GossipError, match=r"algorithm.q_smoothing.*\[0, 1\]"):
        cfg_for(tmp_path, q_smoothing=1.5)
    with pytest.raises(GossipError, match="algorithm.client_weighting.*step.gossip.none"):
        cfg_for(tmp_path, client_weighting="paper")
    cfg = cfg_for(tmp_path)
    cfg.model.name = "cnn"
    with pytest.raises(GossipError, match="cnn.*image"):
        Trainer(cfg, dataset=toy_dataset(4), log=quiet)


def test_clustered_fl_bipartition_and_phase():
    from gossip_pfl.algorithms.clustered import ClusteredRule

    rule = ClusteredRule(4, tol1=0.5, tol2=1.0)
    updates = np.array([[2.0, 0], [1.9, 0.1], [-2.0, 0], [-2.1, 0.1]])  # mean ~0, norms ~2
    state = rule.split(rule.init(), updates)
    labels = state["labels"].cpu().numpy()
    assert labels[0] == labels[1] != labels[2] == labels[3]
    w = rule.phase(state, np.array([1.0, 3.0, 1.0, 1.0])).dense()
    np.testing.assert_allclose(w[0], [0.25, 0.75, 0, 0])
    np.testing.assert_allclose(w.sum(1), 1)


def test_an_unseen_client_under_clustered_fl_takes_its_clusters_model(tmp_path):
    """toy_dataset's clients alternate between two labelling rules. With the clusters {even}
    and {odd} each holding a model fitted to its rule, a held-out client is scored with the
    model of least loss on its training data, its own rule's (accuracy by hand), not with the
    two models' average as before (which fits neither as well)."""
    ds = toy_dataset(10)
    ds.unseen = [8, 9]
    trainer = Trainer(cfg_for(tmp_path, "clustered", components=1), ds, log=quiet)
    assert trainer.layout.names == ["fc.weight", "fc.bias"]
    group = np.arange(8) % 2
    trainer.rule_state["labels"] = torch.as_tensor(group)
    fits = []  # per rule: the mean of (2y - 1) x over its clients, bias 0
    for z in (0, 1):
        xs = [(2 * c.y_train[:, None] - 1) * c.x_train for c in ds.clients[z:8:2]]
        fits.append(np.append(np.concatenate(xs).mean(0), 0.0).astype(np.float32))
    trainer.nodes[:8, 0] = torch.as_tensor(np.stack(fits)[group])

    def accuracy(w, client):
        return np.mean((client.x_test @ w[:-1] + w[-1] > 0) == client.y_test)

    _, acc, _ = trainer.evaluate_unseen()
    want = [accuracy(fits[z], ds.clients[8 + z]) for z in (0, 1)]
    np.testing.assert_allclose(acc, want, rtol=1e-6)
    average = [accuracy((fits[0] + fits[1]) / 2, ds.clients[8 + z]) for z in (0, 1)]
    assert min(want) > 0.85 and max(average) < min(want)  # (the old scoring's)


def test_mixture_usage_in_metrics(tmp_path):
    """metrics.jsonl and summary.json report each component's mean mixture weight and how
    many clients lead with it, computed from the peers' own pi."""
    import json

    trainer = Trainer(cfg_for(tmp_path, pi_init="random"), toy_dataset(6), log=quiet)
    summary = trainer.run()
    pi = trainer.personal["pi"].cpu().numpy()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    np.testing.assert_allclose(row["mixture_weights"], pi.mean(0), atol=1e-5)
    assert row["mixture_leaders"] == np.bincount(pi.argmax(1), minlength=3).tolist()
    assert sum(row["mixture_leaders"]) == 6 and sum(row["mixture_weights"]) == pytest.approx(1)
    assert summary["mixture_weights"] == row["mixture_weights"]
    fedavg = Trainer(cfg_for(tmp_path / "avg", "fedavg", components=1), toy_dataset(6), log=quiet)
    assert "mixture_weights" not in fedavg.run()


def test_a_peer_without_test_samples_has_no_test_accuracy():
    """Test figures are means over the peers that have test samples: one without (a small
    client under data.split) counted as 0% before, dragging the mean and the decile down."""
    from gossip_pfl.metrics import score_entries

    train = (np.array([0.5, 0.7, 0.6]), np.array([0.8, 0.6, 0.7]), np.array([10, 20, 30]))
    test = (np.array([0.4, 9.9, 0.6]), np.array([0.9, 0.0, 0.7]), np.array([5, 0, 15]))
    got = score_entries(train, test)
    assert got["test_accuracy"] == pytest.approx(0.8) and got["test_loss"] == pytest.approx(0.5)
    assert got["test_accuracy_p10"] == pytest.approx(np.percentile([0.9, 0.7], 10))
    assert got["test_accuracy_weighted"] == pytest.approx((0.9 * 5 + 0.7 * 15) / 20)
    assert got["train_accuracy"] == pytest.approx((8 + 12 + 21) / 60)


def test_an_unseen_client_without_test_samples_is_left_out_of_their_mean(tmp_path):
    """The unseen clients' mean accuracy counted one without test samples as 0 (seen
    clients' left such a client out): its accuracy is missing, not 0."""
    ds = toy_dataset(8)
    ds.unseen = [6, 7]
    c = ds.clients[7]
    ds.clients[7] = ClientData(c.x_train, c.y_train, c.x_val, c.y_val, c.x_test[:0], c.y_test[:0])
    tr = Trainer(cfg_for(tmp_path, "fedem", rounds=1), dataset=ds, log=quiet)
    tr.run()
    _, acc, n = tr.evaluate_unseen()
    assert n.tolist() == [30, 0] and acc[0] > 0
    assert tr.metrics_row(0)["unseen_test_accuracy"] == acc[0]


def test_a_client_without_test_samples_has_no_accuracy_not_zero(tmp_path):
    """Its 0.0 stood in client_test_accuracy (the histogram) while the mean left it out."""
    ds = toy_dataset(6)
    c = ds.clients[2]
    ds.clients[2] = ClientData(c.x_train, c.y_train, c.x_val, c.y_val, c.x_test[:0], c.y_test[:0])
    summary = Trainer(cfg_for(tmp_path, rounds=1), dataset=ds, log=quiet).run()
    acc = summary["client_test_accuracy"]
    assert acc[2] is None and all(isinstance(a, float) for i, a in enumerate(acc) if i != 2)
    mean = np.mean([a for a in acc if a is not None])  # (of accuracies rounded to 5 digits)
    assert summary["test_accuracy"] == pytest.approx(mean, abs=1e-5)
