"""The baselines beside FedEM against independent truths: Clustered FL's split (complete
linkage as scipy computes it, its criteria, new labels, the cosines of the clients' updates,
its labels across a resume), FedAvg+'s fine-tune at evaluation, the model pFedMe and APFL are
scored with, and pFedMe's and APFL's local updates against hand-written references in plain
torch (float64, the binary linear model: mean log-loss of the whole local data per step)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _helpers import stop_after_checkpoint, toy_dataset
from scipy.cluster.hierarchy import fcluster, linkage  # (scipy: the test extra's cvxpy needs it)
from scipy.spatial.distance import squareform

from gossip_pfl.algorithms.clustered import ClusteredRule, bipartition
from gossip_pfl.config import load_config
from gossip_pfl.data.base import ClientData, FederatedDataset
from gossip_pfl.runtime.data import round_batches
from gossip_pfl.train import Trainer

SIZES = [10, 17, 25, 31]  # unequal clients: the hub's weights n_i / n_S matter


def quiet(*_args, **_kw):
    pass


def cfg_for(out, name, rounds=2, algo=None, runtime=None, **over):
    """A small CPU config, one thread, seeded (tests/test_rules.py's, with full batches:
    batch_size 64 is above every client's size, so an epoch is one step on all its data);
    ``runtime`` adds runtime keys."""
    base = {
        "seed": 3,
        "rounds": rounds,
        "algorithm": {"name": name, "lr": 0.3, "batch_size": 64, **(algo or {})},
        "eval": {"every": rounds},
        "out": str(out),
        "runtime": {"device": "cpu", "threads": 1, **(runtime or {})},
        **over,
    }
    return load_config(base=base)


def run_rounds(trainer: Trainer, rounds: int) -> list[np.ndarray]:
    """The rounds' steps as Trainer.run takes them; returns each round's participants."""
    drawn = []
    for t in range(rounds):
        active = trainer.sample(t)
        trainer.local_work(t, active)
        trainer.communicate(t, active)
        drawn.append(active)
    return drawn


def xy(data: FederatedDataset, i: int, split: str = "train"):
    x, y = data.clients[i].split(split)
    return torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)


def bce(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean log-loss of the linear model theta = (w, b) on (x, y)."""
    return torch.nn.functional.binary_cross_entropy_with_logits(x @ theta[:-1] + theta[-1], y)


def grad(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    th = theta.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(bce(th, x, y), th)
    return g


def shared(trainer: Trainer) -> torch.Tensor:
    """Each client's shared model (L, P) in float64."""
    return trainer.nodes[: len(trainer.peers), 0].double()


def partition(labels) -> list[int]:
    """Labels renamed in order of first appearance: equal for equal partitions."""
    first: dict = {}
    return [first.setdefault(int(v), len(first)) for v in labels]


# ---- Clustered FL: the split ---------------------------------------------------------------


def scipy_split(similarity: np.ndarray, method: str = "complete") -> list[int]:
    """Two groups by scipy's agglomeration on the distance 1 - similarity."""
    dist = 1.0 - similarity
    np.fill_diagonal(dist, 0.0)
    z = linkage(squareform(dist, checks=False), method=method)
    return partition(fcluster(z, 2, criterion="maxclust"))


def test_bipartition_is_complete_linkage_as_scipy_computes_it():
    """bipartition equals scipy's complete linkage (the released CFL code's choice) on four
    updates in the plane where single linkage (Sattler et al.'s argmin-max bipartition)
    splits otherwise, and on random cosine matrices of 4 to 8 clients. Catches a linkage that
    keeps the most similar pair (np.maximum: single linkage) or any other merge order."""
    ang = np.radians([55.0, -175.0, 90.0, -60.0])
    u = np.stack([np.cos(ang), np.sin(ang)], 1)
    s = u @ u.T
    want = scipy_split(s)
    assert want != scipy_split(s, "single")  # the two linkages disagree here
    assert partition(bipartition(s)) == want
    rng = np.random.default_rng(0)
    differ = 0
    for n in [4, 5, 6, 7, 8] * 4:
        u = rng.normal(size=(n, 3))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        s = u @ u.T
        assert partition(bipartition(s)) == scipy_split(s), s.round(3)
        differ += scipy_split(s) != scipy_split(s, "single")
    assert differ > 0


def test_a_cluster_of_two_never_splits():
    """Clusters {0, 1} and {2, 3, 4} both have a mean update 0 (< tol1) and updates of norm 2
    (> tol2): the three split ({2, 3} from {4}), the two stay together (only a cluster of
    more than two members splits). Catches `len(members) > 1`."""
    rule = ClusteredRule(5, tol1=0.4, tol2=0.5)
    state = {"labels": torch.tensor([0, 0, 1, 1, 1])}
    updates = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.0], [0.1, 2.0], [-0.1, -4.0]])
    got = rule.split(state, updates)["labels"].tolist()
    assert partition(got) == [0, 0, 1, 1, 2]


@pytest.mark.parametrize(
    "tol1, tol2, splits",
    [(0.5, 0.5, False), (0.51, 0.5, True), (0.51, 1.0, False), (0.51, 0.99, True)],
    ids=["mean_norm_at_tol1", "mean_norm_below_tol1", "max_norm_at_tol2", "max_norm_above_tol2"],
)
def test_a_cluster_splits_only_when_its_mean_update_is_small_and_one_update_large(
    tol1, tol2, splits
):
    """Three updates of norms 1, 1, 0.5, their mean of norm 0.5 exactly: the cluster splits
    iff ||mean dW|| < tol1 and max ||dW_i|| > tol2 (both strict). Catches a rule without the
    mean-norm condition (it splits at tol1 = 0.5) or with either comparison loosened."""
    rule = ClusteredRule(3, tol1=tol1, tol2=tol2)
    updates = np.array([[1.0, 0.0], [1.0, 0.0], [-0.5, 0.0]])
    assert np.linalg.norm(updates.mean(0)) == 0.5
    got = rule.split(rule.init(), updates)["labels"].tolist()
    assert partition(got) == ([0, 0, 1] if splits else [0, 0, 0])


@pytest.mark.parametrize(
    "labels, updates, want",
    [
        # two clusters split in the same round: four groups
        ([0, 0, 0, 1, 1, 1],
         [[2, 0], [2, 0.2], [-4, -0.2], [0, 2], [0.2, 2], [-0.2, -4]],
         [0, 0, 1, 2, 2, 3]),
        # a split in a later round (cluster 1 of two members, from an earlier split, stays)
        ([0, 0, 0, 1, 1], [[2, 0], [2, 0.2], [-4, -0.2], [0, 2], [0, -2]], [0, 0, 1, 2, 2]),
        # the same with the labels' roles swapped: the splitting cluster is the higher label
        ([1, 1, 0, 0, 0], [[0, 2], [0, -2], [2, 0], [2, 0.2], [-4, -0.2]], [0, 0, 1, 1, 2]),
    ],
    ids=["two_in_one_round", "later_round", "later_round_high_label"],
)  # fmt: skip
def test_split_off_groups_get_labels_of_their_own(labels, updates, want):
    """Every group split off takes a label no other peer has (the largest so far + 1), so a
    split never merges it into another cluster. Catches a new label `c + 1`, which is the
    next cluster's label."""
    rule = ClusteredRule(len(labels), tol1=0.4, tol2=0.5)
    state = {"labels": torch.tensor(labels)}
    got = rule.split(state, np.array(updates, dtype=float))["labels"].tolist()
    assert partition(got) == want


# ---- Clustered FL through the Trainer --------------------------------------------------------


def opposed(sizes, dim=3, seed=7) -> FederatedDataset:
    """Clients labelled by one linear rule, every other one with the labels flipped: two
    groups whose updates point apart."""
    rng = np.random.default_rng(seed)
    rule = rng.normal(size=dim)
    clients = []
    for i, m in enumerate(sizes):
        x = rng.normal(size=(m + 20, dim)).astype(np.float32)
        y = (x @ rule > 0).astype(np.int64)
        y = 1 - y if i % 2 else y
        clients.append(ClientData(x[:m], y[:m], x[:0], y[:0], x[m:], y[m:]))
    return FederatedDataset("opposed", clients, (dim,), 2, "binary", {}, [])


def clustered_reference(data, w0, lr, tol1, tol2, rounds, measure="updates"):
    """Sattler et al.'s CFL, one full-batch step a round: dW_i = -lr grad f_i(w_i); a cluster
    of more than two whose ||mean dW|| < tol1 and max ||dW_i|| > tol2 is split in two by
    scipy's complete linkage on the cosines of the dW_i (``measure`` "models": of w_i + dW_i
    instead, the wrong quantity), the part without the cluster's first member under a new
    label; then each cluster's members take the n-weighted average of w_j + dW_j."""
    n = np.array([len(c.y_train) for c in data.clients], dtype=float)
    w = [w0.clone() for _ in n]
    labels = np.zeros(len(n), dtype=int)
    history = []
    for _ in range(rounds):
        dw = torch.stack([-lr * grad(w[i], *xy(data, i)) for i in range(len(n))])
        vec = (dw if measure == "updates" else torch.stack(w) + dw).numpy()
        norms = np.linalg.norm(vec, axis=1)
        new = labels.copy()
        for c in np.unique(labels):
            members = np.flatnonzero(labels == c)
            mean_norm = np.linalg.norm(vec[members].mean(0))
            if len(members) > 2 and mean_norm < tol1 and norms[members].max() > tol2:
                u = vec[members] / norms[members, None]
                side = np.array(scipy_split(u @ u.T)) == 0
                new[members[~side]] = new.max() + 1
        labels = new
        after = [w[i] + dw[i] for i in range(len(n))]
        for c in np.unique(labels):
            members = np.flatnonzero(labels == c)
            avg = sum(n[j] * after[j] for j in members) / n[members].sum()
            for j in members:
                w[j] = avg.clone()
        history.append((partition(labels), torch.stack(w)))
    return history


OPPOSED = [10, 17, 25, 31, 14, 22]


@pytest.mark.parametrize(
    "tol1, tol2",
    [(0.12, 0.1), (100.0, 0.0)],
    ids=["norms_decide", "cosines_decide"],
)
def test_clustered_splits_by_the_clients_updates_not_their_models(tol1, tol2, tmp_path):
    """Two rounds of Clustered FL on two groups of clients with opposite labels (full batch,
    one step): every round's labels and models equal the hand-written CFL on the updates
    dW_i = w_i' - w_i (round-start model subtracted). Measured on the models w_i' instead,
    the splits differ: with tol1 = 0.12 (||mean dW|| 0.09 then 0.17 and 0.26) the models'
    mean norm (~0.75) stops the first split; with tol1 large (every cluster of three or more
    splits) their cosines split the second round's clusters otherwise. Catches a rule fed
    the models."""
    data = opposed(OPPOSED)
    lr, rounds = 0.5, 2
    rule = {"name": "clustered", "tol1": tol1, "tol2": tol2}
    cfg = cfg_for(tmp_path, "clustered", rounds, algo={"lr": lr}, rule=rule)
    tr = Trainer(cfg, dataset=data, log=quiet)
    w0 = shared(tr)[0].clone()
    want = clustered_reference(data, w0, lr, tol1, tol2, rounds)
    wrong = clustered_reference(data, w0, lr, tol1, tol2, rounds, measure="models")
    assert want[0][0] == [0, 1, 0, 1, 0, 1]  # the first split finds the two groups
    if tol1 < 1:  # and they stay: each group's mean update is above tol1
        assert want[1][0] == [0, 1, 0, 1, 0, 1]
    assert [h[0] for h in wrong] != [h[0] for h in want]  # the models would not
    for t in range(rounds):
        tr.local_work(t)
        tr.communicate(t)
        labels, models = want[t]
        assert partition(tr.rule_state["labels"]) == labels, t
        torch.testing.assert_close(shared(tr), models, rtol=0, atol=2e-6)


def test_clustered_labels_survive_a_checkpoint_and_resume(tmp_path):
    """A Clustered FL run (momentum 0.5) stopped after round 2's checkpoint and resumed ends
    with the uninterrupted run's labels, models, momentum and metrics; its clusters split in
    round 1, before the checkpoint. Catches a resume that leaves the labels at their initial
    single cluster (the next round then averages across the groups)."""
    data = opposed(OPPOSED)

    def trainer(out):
        cfg = cfg_for(out, "clustered", 4, algo={"lr": 0.5, "momentum": 0.5},
                      rule={"name": "clustered", "tol1": 0.12, "tol2": 0.1},
                      eval={"every": 2}, checkpoint_every=2)  # fmt: skip
        return Trainer(cfg, dataset=data, log=quiet)

    split_early = trainer(tmp_path / "probe")
    run_rounds(split_early, 1)
    assert partition(split_early.rule_state["labels"]) == [0, 1, 0, 1, 0, 1]
    full = trainer(tmp_path / "full")
    full.run()
    stop_after_checkpoint(trainer(tmp_path / "cut"), 2)
    cut = trainer(tmp_path / "cut")
    cut.run(resume=True)
    assert torch.equal(cut.rule_state["labels"], full.rule_state["labels"])
    assert torch.equal(cut.nodes, full.nodes)
    assert torch.equal(cut.opt_state.momentum, full.opt_state.momentum)
    rows = {k: [json.loads(r) for r in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
            for k in ("full", "cut")}  # fmt: skip
    assert [r["round"] for r in rows["cut"]] == [2, 4]
    for a, b in zip(rows["full"], rows["cut"]):
        assert a["test_loss"] == b["test_loss"] and a["test_accuracy"] == b["test_accuracy"]


# ---- FedAvg+: the evaluation's fine-tune -------------------------------------------------------


@pytest.mark.parametrize("name", ["fedavg_plus", "dsgd"])
def test_fedavg_plus_scores_seen_clients_after_one_plain_sgd_epoch_on_a_copy(name, tmp_path):
    """FedAvg+ with momentum 0.9 in its rounds: each seen client's test loss and accuracy are
    those of the global model after one epoch of plain SGD (no momentum) at algorithm.lr on
    its own training data, in minibatches of 8 (the batch's mean loss, the plan's order:
    round_batches, stream 1), written out in torch; the stored models, personal and solver
    state are left as they were. Catches an evaluation without the fine-tune, one with
    momentum (several steps an epoch: momentum changes the second step on) and one that
    writes the tuned models back. The same on a gossip ring (decentralized SGD, each client
    its own model), whose training steps are scaled by T n_i / n (client_weighting: step):
    its fine-tune took them too."""
    B, lr = 8, 0.3
    data = toy_dataset(4, dim=3, sizes=SIZES)
    algo = {"lr": lr, "batch_size": B, "momentum": 0.9}
    ring = {"schedule": {"graph": "ring"}, "eval": {"every": 2, "finetune_epochs": 1}}
    over = {} if name == "fedavg_plus" else ring
    tr = Trainer(cfg_for(tmp_path, name, 2, algo=algo, **over), dataset=data, log=quiet)
    cfg = tr.cfg
    run_rounds(tr, 2)
    models = shared(tr).clone()
    if name == "fedavg_plus":  # every client holds the global model
        assert torch.equal(models, models[0].expand(4, -1))
    else:
        assert not torch.allclose(tr.lr_scale, torch.ones(4))
    before = (tr.nodes.clone(), {k: v.clone() for k, v in tr.personal.items()},
              tr.opt_state.momentum.clone())  # fmt: skip
    assert before[2].abs().max() > 0  # the rounds' momentum is there, and stays unused
    nll, acc, _ = tr.evaluate(tr.test)
    idx, real = round_batches(np.array(SIZES), np.arange(4), cfg.seed, tr.round, B, stream=1)
    for i in range(4):
        x, y = xy(data, i)
        w = models[i]
        theta = w.clone()
        steps = 0
        for s in range(idx.shape[0]):
            rows = idx[s, i][real[s, i] > 0]
            if len(rows):
                theta = theta - lr * grad(theta, x[rows], y[rows])
                steps += 1
        assert steps == -(-SIZES[i] // B)  # one epoch
        xt, yt = xy(data, i, "test")
        assert nll[i] == pytest.approx(bce(theta, xt, yt).item(), rel=1e-5)
        hits = ((xt @ theta[:-1] + theta[-1]) > 0) == yt
        assert acc[i] == pytest.approx(hits.double().mean().item())
        assert abs(nll[i] - bce(w, xt, yt).item()) > 1e-4  # the fine-tune changed the score
    assert torch.equal(tr.nodes, before[0])
    assert all(torch.equal(tr.personal[k], v) for k, v in before[1].items())
    assert torch.equal(tr.opt_state.momentum, before[2])


@pytest.mark.parametrize("kernels, model", [(True, "linear"), (False, "linear"), (True, "mlp")])
def test_a_fine_tuned_evaluation_leaves_the_training_as_it_was(kernels, model, tmp_path):
    """Decentralized SGD on a ring (steps scaled by T n_i / n) with a fine-tune before each
    evaluation: evaluated every round or only at the end, the models are the same to the bit
    (a fine-tune that left the step scale at 1 moved them by 0.37 in 4 rounds). The linear
    model's CPU steps read the scale's host copy, the others the tensor: both are checked."""
    data = toy_dataset(4, dim=3, sizes=SIZES)
    models = []
    for every in (1, 4):
        spec = {"name": model, **({"hidden": [4]} if model == "mlp" else {})}
        over = {"schedule": {"graph": "ring"}, "eval": {"every": every, "finetune_epochs": 1},
                "model": spec}  # fmt: skip
        cfg = cfg_for(tmp_path / str(every), "dsgd", 4, algo={"batch_size": 8},
                      runtime={"cpu_kernels": kernels}, **over)  # fmt: skip
        tr = Trainer(cfg, dataset=data, log=quiet)
        tr.run()
        models.append(shared(tr))
    assert torch.equal(models[0], models[1])


# ---- pFedMe and APFL: the model scored -----------------------------------------------------


PFEDME = {"mu": 2.0, "inner_steps": 3, "personal_lr": 0.05}
#: the three code paths of a personal-model round on the linear model: the compiled CPU loops
#: (runtime/kernels.py personal_round), the fused round in torch operations, and autograd
#: through the surrogate's shared_grad (as for any other model)
PATHS = {"kernels": {}, "torch_ops": {"cpu_kernels": False}, "autograd": {"batching": "vmap"}}
APFL = {"alpha": 0.4, "personal_lr": 0.2, "alpha_lr": 0.05}


@pytest.mark.parametrize("path", ["kernels", "autograd"])
@pytest.mark.parametrize("name", ["pfedme", "apfl"])
def test_personal_baselines_are_scored_with_their_personal_model(name, path, tmp_path):
    """After two rounds, each client's test loss and accuracy are those of pFedMe's personal
    model theta_i, or of APFL's alpha_i v_i + (1 - alpha_i) w, computed in torch from the
    stored state (with theta_i != w, v_i != w and 0 < alpha_i < 1, so the shared model, v
    alone or the mixture's weights swapped all score otherwise). Catches eval_state returning
    the shared model or v alone."""
    data = toy_dataset(4, dim=3, sizes=SIZES)
    cfg = cfg_for(tmp_path, name, algo=PFEDME if name == "pfedme" else APFL, runtime=PATHS[path])
    tr = Trainer(cfg, dataset=data, log=quiet)
    run_rounds(tr, 2)
    w = shared(tr)
    v = tr.personal["model"][:, 0].double()
    if name == "pfedme":
        model = v
    else:
        alpha = tr.personal["alpha"].double()
        assert ((alpha > 0.05) & (alpha < 0.95)).all() and (alpha != 0.5).all(), alpha
        model = alpha[:, None] * v + (1 - alpha[:, None]) * w
    assert ((v - w).abs().amax(1) > 1e-2).all()  # the personal models moved off w
    nll, acc, _ = tr.evaluate(tr.test)
    for i in range(4):
        xt, yt = xy(data, i, "test")
        assert nll[i] == pytest.approx(bce(model[i], xt, yt).item(), rel=1e-5, abs=1e-6), i
        hits = ((xt @ model[i, :-1] + model[i, -1]) > 0) == yt
        assert acc[i] == pytest.approx(hits.double().mean().item()), i


# ---- pFedMe and APFL: the local updates ----------------------------------------------------


def pfedme_reference(data, w0, drawn, lam, inner, plr, lr, epochs):
    """pFedMe (Dinh et al. 2020, Alg. 1, beta = 1) with full batches: per local step, K steps
    theta <- theta - plr (grad f(theta) + lam (theta - w)), then w <- w - lr lam (w - theta);
    theta carries over from round to round (and stays with a client sitting out); the hub
    averages the participants' w weighted by their sample counts. Yields (w, theta) a round."""
    n = [len(c.y_train) for c in data.clients]
    w, theta = w0.clone(), [w0.clone() for _ in n]
    for active in drawn:
        sent = []
        for i in np.flatnonzero(active):
            x, y = xy(data, i)
            wi = w.clone()
            for _ in range(epochs):
                for _ in range(inner):
                    theta[i] = theta[i] - plr * (grad(theta[i], x, y) + lam * (theta[i] - wi))
                wi = wi - lr * lam * (wi - theta[i])
            sent.append((n[i], wi))
        w = sum(m * wi for m, wi in sent) / sum(m for m, _ in sent)
        yield w, torch.stack(theta)


@pytest.mark.parametrize(
    "algo, lam, participation",
    [({"mu": 2.0, "personal_lr": 0.05}, 2.0, 1.0),
     ({"lr": 0.05, "personal_lr": 0.02}, 15.0, 3)],
    ids=["mu_2_all_clients", "default_lambda_15_three_of_four"],
)  # fmt: skip
@pytest.mark.parametrize("path", list(PATHS))
def test_pfedme_rounds_match_the_hand_written_algorithm(algo, lam, participation, path, tmp_path):
    """Two rounds of pFedMe (3 inner steps, 2 local epochs of one full batch) equal the
    reference: the shared model on every client and every client's theta, after each round.
    Without algorithm.mu the prox weight is lambda = 15. Catches a wrong prox gradient or
    shared step, an unweighted hub, theta reset to w at a round's start (a client drawn in
    both rounds carries it), and another default lambda."""
    algo = {"inner_steps": 3, "local_epochs": 2, **algo}
    cfg = cfg_for(tmp_path, "pfedme", algo=algo, runtime=PATHS[path], participation=participation)
    data = toy_dataset(4, dim=3, sizes=SIZES)
    tr = Trainer(cfg, dataset=data, log=quiet)
    lr = cfg.algorithm.lr
    w0 = shared(tr)[0].clone()
    drawn = [tr.sample(t) for t in range(2)]
    assert (drawn[0] & drawn[1]).any()  # someone carries theta into round 2
    if participation != 1.0:
        assert not drawn[0].all() and not drawn[1].all()
    want = pfedme_reference(data, w0, drawn, lam, 3, cfg.algorithm.personal_lr, lr, 2)
    for t, (w, theta) in enumerate(want):
        tr.local_work(t, drawn[t])
        tr.communicate(t, drawn[t])
        torch.testing.assert_close(shared(tr), w.expand(4, -1), rtol=0, atol=1e-6)
        torch.testing.assert_close(tr.personal["model"][:, 0].double(), theta, rtol=0, atol=1e-6)
    assert ((theta - w).abs().amax(1) > 5e-3).all()  # theta is not w: carrying it matters


def apfl_reference(data, w0, drawn, alpha0, plr, alr, lr, epochs):
    """APFL (Deng et al. 2020) with full batches: per local step, with vbar = a v + (1 - a) w
    and g = grad f(vbar): v <- v - plr a g, a <- clip(a - alr <v - w, g>, 0, 1) (old v and a
    on the right), w <- w - lr grad f(w); v and a stay with the client; the hub averages the
    participants' w weighted by their sample counts. Returns (w, v, a)."""
    n = [len(c.y_train) for c in data.clients]
    w, v, a = w0.clone(), [w0.clone() for _ in n], [alpha0] * len(n)
    for active in drawn:
        sent = []
        for i in np.flatnonzero(active):
            x, y = xy(data, i)
            wi = w.clone()
            for _ in range(epochs):
                g = grad(a[i] * v[i] + (1 - a[i]) * wi, x, y)
                ga = float(((v[i] - wi) * g).sum())
                v[i] = v[i] - plr * a[i] * g
                a[i] = min(max(a[i] - alr * ga, 0.0), 1.0)
                wi = wi - lr * grad(wi, x, y)
            sent.append((n[i], wi))
        w = sum(m * wi for m, wi in sent) / sum(m for m, _ in sent)
    return w, torch.stack(v), torch.tensor(a, dtype=torch.float64)


@pytest.mark.parametrize("alpha_lr, clipped", [(0.05, False), (0.5, True)])
@pytest.mark.parametrize("path", list(PATHS))
def test_apfl_rounds_match_the_hand_written_algorithm(alpha_lr, clipped, path, tmp_path):
    """Three rounds of APFL (3 local epochs of one full batch, 3 of 4 clients a round) equal
    the reference: the shared model, every client's v and alpha, those sitting out keeping
    theirs. With alpha_lr 0.05 every alpha stays inside (0, 1), with 0.5 two reach 0.
    Catches a v step without alpha, a missing clip, an alpha step on the wrong sign or
    model, and an unweighted hub."""
    alpha0, plr, lr = 0.4, 0.2, 0.3
    algo = {"alpha": alpha0, "personal_lr": plr, "alpha_lr": alpha_lr, "local_epochs": 3}
    cfg = cfg_for(tmp_path, "apfl", 3, algo=algo, runtime=PATHS[path], participation=3)
    data = toy_dataset(4, dim=3, sizes=SIZES)
    tr = Trainer(cfg, dataset=data, log=quiet)
    w0 = shared(tr)[0].clone()
    drawn = run_rounds(tr, 3)
    w, v, a = apfl_reference(data, w0, drawn, alpha0, plr, alpha_lr, lr, 3)
    torch.testing.assert_close(shared(tr), w.expand(4, -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(tr.personal["model"][:, 0].double(), v, rtol=0, atol=1e-6)
    torch.testing.assert_close(tr.personal["alpha"].double(), a, rtol=0, atol=1e-6)
    assert np.logical_or.reduce(drawn).all()  # every client trained at least once
    inside = (a > 1e-3) & (a < 1 - 1e-3) & ((a - alpha0).abs() > 1e-3)
    if clipped:
        assert ((a == 0) | (a == 1)).any() and inside.any(), a
    else:
        assert inside.all(), a
