"""PeFLL (gossip_pfl.algorithms.pefll, gossip_pfl.pefll_run): the split protocol against
autograd through h(v(S)), stateless clients, the hub's Adam against torch.optim.Adam,
checkpoints and resume, message bytes, 1 process against 2 Gloo ranks, and bad input through
the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import check_ranks_refuse_other_checkpoints, run_ranks
from torch.func import functional_call

from gossip_pfl import checkpoint, pefll_run
from gossip_pfl.algorithms import pefll
from gossip_pfl.algorithms.pefll import PeFLLHub
from gossip_pfl.algorithms.rules import Inbox
from gossip_pfl.cli import main
from gossip_pfl.config import load_config
from gossip_pfl.data.base import ClientData, FederatedDataset
from gossip_pfl.errors import GossipError
from gossip_pfl.models import LabelEmbedding, LeNet, LeNetEmbedding, build_model
from gossip_pfl.pefll_run import PeFLLRun
from gossip_pfl.train import run

torch.set_num_threads(1)


def images(n: int = 8, classes: int = 4, side: int = 16, seed: int = 0) -> FederatedDataset:
    """``n`` clients of 16x16 images, two classes each (class means plus noise), clients 6 and
    7 unseen."""
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(classes, 1, side, side)).astype(np.float32)
    clients = []
    for i in range(n):
        own = [i % classes, (i + 1) % classes]

        def draw(k, own=own):
            y = rng.choice(own, size=k)
            x = means[y] + 0.8 * rng.normal(size=(k, 1, side, side))
            return x.astype(np.float32), y.astype(np.int64)

        x, y = draw(20 + 3 * i)
        xt, yt = draw(10)
        clients.append(ClientData(x, y, x[:0], y[:0], xt, yt))
    return FederatedDataset("imgs", clients, (1, side, side), classes, "multiclass", {}, [6, 7])


def config(out, rounds=3, pefll=None, **over):
    base = {
        "seed": 5,
        "rounds": rounds,
        "algorithm": {"name": "pefll"},
        "model": {"name": "lenet"},
        "participation": 3,
        "eval": {"every": rounds},
        "out": str(out),
        "runtime": {"device": "cpu"},
        "pefll": {"local_steps": 3, "batch_size": 8, "descriptor_batch": 8, "embed_dim": 3,
                  "lr": 1e-3, "client_lr": 0.05, **(pefll or {})},
    }  # fmt: skip
    return load_config(base={**base, **over})


def quiet(*_a, **_k):
    pass


def one_round(r: PeFLLRun, t: int) -> None:
    active = r.sample(t)
    r.local_work(t, active)
    r.communicate(t, active)


class Recorder:
    """The hub's rule, recording the inbox of every update."""

    def __init__(self, hub):
        self.hub, self.inboxes = hub, []
        self.normalize = hub.normalize

    def update(self, inbox, state):
        self.inboxes.append(inbox)
        return self.hub.update(inbox, state)


@pytest.mark.parametrize("embed", ["lenet", "labels"])
def test_hub_gradients_equal_autograd_through_h_of_v(embed, tmp_path):
    """One plain SGD step (k = 1, no momentum, no lambda_theta): the model delta is -lr times
    the client's loss gradient, so the split protocol's mean gradients must be lr times the
    autograd gradient of mean_i f_i(h(v(B_i))) with respect to (eta_h, eta_v)."""
    lr = 0.05
    cfg = config(tmp_path, pefll={"local_steps": 1, "momentum": 0.0, "lambda_theta": 0.0,
                                  "client_lr": lr, "embed": embed})  # fmt: skip
    r = PeFLLRun(cfg, images(), log=quiet)
    state0 = {k: v.clone() for k, v in r.hub_state.items()}
    r.hub = Recorder(r.hub)
    active = r.sample(0)
    one_round(r, 0)
    (inbox,) = r.hub.inboxes

    # the truth: the networks as plain modules, composed and differentiated by autograd
    hyper, emb = r.hyper.module, r.embed.module
    eta_h = state0["eta_h"].clone().requires_grad_()
    eta_v = state0["eta_v"].clone().requires_grad_()
    shift, scale = r.hub_state["desc_shift"], r.hub_state["desc_scale"]
    model = LeNet((1, 16, 16), 4)
    rows = np.flatnonzero(active)
    idx_d, w_d = r.batches(rows, 0, 1, 1, 8)
    idx_s, w_s = r.batches(rows, 0, 0, 1, 8)
    losses = []
    for a, i in enumerate(rows):
        x, y = r.train.x[i, idx_d[0, a]], r.train.y[i, idx_d[0, a]]
        phi = functional_call(emb, r.embed.layout.unflatten(eta_v), (x, y))
        v = phi.mean(0)  # the descriptor batch is full (8 <= every client's size)
        theta = functional_call(hyper, r.hyper.layout.unflatten(eta_h), ((v - shift) / scale,))
        params = r.layout.unflatten(theta)
        xs, ys = r.train.x[i, idx_s[0, a]], r.train.y[i, idx_s[0, a]]
        logits = functional_call(model, params, (xs,))
        losses.append(torch.nn.functional.cross_entropy(logits, ys))
    g_h, g_v = torch.autograd.grad(torch.stack(losses).mean(), (eta_h, eta_v))
    torch.testing.assert_close(inbox.mean["hyper_grad"], lr * g_h, rtol=2e-4, atol=1e-7)
    torch.testing.assert_close(inbox.mean["embed_grad"], lr * g_v, rtol=2e-4, atol=1e-7)
    assert g_v.abs().sum() > 0 and g_h.abs().sum() > 0


@pytest.mark.parametrize("fused", [True, None])
def test_hub_update_is_clipped_adam_with_l2(fused, monkeypatch):
    """The hub's step is torch.optim.Adam(weight_decay = 2 lambda) after clip_grad_norm_, in
    the fused kernel and in torch's default form (builds without the fused CPU kernel); the
    state it was given stays as it was."""
    monkeypatch.setattr(pefll, "fused_adam", lambda device_type: fused)
    gen = torch.Generator().manual_seed(0)
    eta_h, eta_v = torch.randn(7, generator=gen), torch.randn(4, generator=gen)
    hub = PeFLLHub(lr=0.01, clip=1.5, lambda_h=0.1, lambda_v=0.02)
    state = hub.init(eta_h, eta_v)
    ref_h, ref_v = eta_h.clone().requires_grad_(), eta_v.clone().requires_grad_()
    opts = [torch.optim.Adam([ref_h], lr=0.01, weight_decay=0.2),
            torch.optim.Adam([ref_v], lr=0.01, weight_decay=0.04)]  # fmt: skip
    for _ in range(4):
        gh, gv = 3 * torch.randn(7, generator=gen), 0.1 * torch.randn(4, generator=gen)
        before = {k: v.clone() for k, v in state.items()}
        new = hub.update(Inbox({"hyper_grad": gh, "embed_grad": gv}), state)
        assert all(torch.equal(state[k], v) for k, v in before.items())
        assert new["step"] == state["step"] + 1
        state = new
        for p, g, opt in ((ref_h, gh, opts[0]), (ref_v, gv, opts[1])):
            p.grad = g.clone()
            torch.nn.utils.clip_grad_norm_([p], 1.5)
            opt.step()
    torch.testing.assert_close(state["eta_h"], ref_h.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["eta_v"], ref_v.detach(), rtol=1e-5, atol=1e-6)


def test_clients_keep_no_state_between_rounds(tmp_path):
    """Clients re-created every round (a fresh run object holding only the hub's state) give
    the same hub state, bit for bit, as clients that live through all rounds."""
    ds = images()
    r = PeFLLRun(config(tmp_path), ds, log=quiet)
    for t in range(3):
        one_round(r, t)
        assert r.scratch == {}  # nothing of the round outlives it
    hub = PeFLLRun(config(tmp_path), ds, log=quiet).hub_state
    for t in range(3):
        fresh = PeFLLRun(config(tmp_path), ds, log=quiet)
        fresh.hub_state = hub
        one_round(fresh, t)
        hub = fresh.hub_state
    for k, v in r.hub_state.items():
        assert torch.equal(v, hub[k]), k


def test_message_bytes_match_tensor_sizes(tmp_path):
    """Per round, S messages of each kind; each the size of the tensor it carries (float32)."""
    rounds, S, l = 2, 3, 3
    r = PeFLLRun(config(tmp_path, rounds=rounds), images(), log=quiet)
    for t in range(rounds):
        one_round(r, t)
    P = sum(p.numel() for p in build_model("lenet", (1, 16, 16), 4).parameters())
    Pv = sum(p.numel() for p in LeNetEmbedding((1, 16, 16), 4, l).parameters())
    assert Pv == r.hub_state["eta_v"].numel() and P == r.layout.numel
    per_message = {"embed_params": Pv, "descriptor": l, "client_model": P, "model_delta": P,
                   "descriptor_grad": l, "embed_grad": Pv}  # fmt: skip
    assert r.kind_bytes == {k: rounds * S * 4 * n for k, n in per_message.items()}
    assert sum(p.numel() for p in LabelEmbedding((1,), 4, l).parameters()) == 4 * l + l


def test_checkpoint_round_trip_and_resume(tmp_path):
    """The hub's state round-trips the checkpoint; 2 rounds + resume to 4 ends with the
    summary of 4 rounds straight."""
    ds = images()
    every = {"every": 2}
    straight = run(config(tmp_path / "a", rounds=4, eval=every), ds, log=quiet)
    cut = PeFLLRun(config(tmp_path / "b", rounds=2, eval=every), ds, log=quiet)
    cut.run()
    saved = checkpoint.load(tmp_path / "b")
    assert saved["rounds_done"] == 2
    for k, v in cut.hub_state.items():
        assert torch.equal(saved["hub"][k], v), k
    other = images(seed=1)  # the same config over other data: refused, as for the model runs
    with pytest.raises(GossipError, match="the checkpoint was trained on other data"):
        run(config(tmp_path / "b", rounds=4, eval=every), other, log=quiet, resume=True)
    checkpoint.save({**saved, "kind_bytes": {"x": 1}}, tmp_path / "b")  # (a KeyError's trace)
    with pytest.raises(GossipError, match=r"checkpoint key 'kind_bytes' is a dict of \['x'\]"):
        run(config(tmp_path / "b", rounds=4, eval=every), ds, log=quiet, resume=True)
    checkpoint.save(saved, tmp_path / "b")
    resumed = run(config(tmp_path / "b", rounds=4, eval=every), ds, log=quiet, resume=True)
    for key in ("test_accuracy", "train_loss", "unseen_test_accuracy", "model_bytes",
                "client_test_accuracy"):  # fmt: skip
        assert resumed[key] == straight[key], key
    rows = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in rows] == [2, 4]


def _summary(out: str, participation: int) -> dict:
    from gossip_pfl.runtime.comm import init_comm

    cfg = config(out, rounds=3, eval={"every": 3}, participation=participation)
    return run(cfg, images(), comm=init_comm("cpu", "gloo"), log=quiet)


@pytest.mark.parametrize("participation", [3, 1])
def test_one_process_and_two_ranks_agree(tmp_path, participation):
    """participation 1: a rank has no participant each round (its descriptors' reshape of
    0 clients raised, and the other rank said a peer died)."""
    one = run(config(tmp_path / "w1", rounds=3, participation=participation), images(), log=quiet)
    ranks = run_ranks(2, _summary, str(tmp_path / "w2"), participation)
    for status, value in ranks:
        assert status == "ok", value
    two = ranks[0][1]
    assert two["world_size"] == 2 and ranks[1][1]["test_accuracy"] == two["test_accuracy"]
    for key in ("test_accuracy", "train_loss", "unseen_test_accuracy", "train_accuracy"):
        assert two[key] == pytest.approx(one[key], rel=1e-6, abs=1e-7), key  # float32 rounding
    np.testing.assert_allclose(two["client_test_accuracy"], one["client_test_accuracy"], atol=1e-7)
    assert two["model_bytes"] == one["model_bytes"]


def _resume_own(dirs: list) -> None:
    """Rank r resumes from its own folder dirs[r] (a node's copy of the run folder)."""
    import os

    from gossip_pfl.runtime.comm import init_comm

    cfg = config(dirs[int(os.environ["RANK"])], rounds=4, eval={"every": 2})
    run(cfg, images(), comm=init_comm("cpu", "gloo", 30.0), log=quiet, resume=True)


def test_ranks_that_read_different_checkpoints_stop_before_training(tmp_path):
    """PeFLL's ranks at rounds 2 and 1 stop at once, naming the rounds; nothing written."""
    run(config(tmp_path / "a", rounds=2, eval={"every": 2}), images(), log=quiet)
    run(config(tmp_path / "b", rounds=1, eval={"every": 1}), images(), log=quiet)
    check_ranks_refuse_other_checkpoints(_resume_own, tmp_path / "a", tmp_path / "b",
                                         "rank 1 read a checkpoint of round 1, rank 0 one of "
                                         "round 2")  # fmt: skip


# ---- bad input: one line naming the key, exit 2 ---------------------------------------------
FMNIST = """algorithm: {name: pefll}
model: {name: lenet}
data: {name: fashion_mnist, n_clients: 10, fraction: 0.02, unseen_fraction: 0.1,
       partition: {kind: pathological, classes_per_client: 2}}
runtime: {device: cpu}
"""


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["pefll.embed_dim=0"], ["pefll.embed_dim", ">= 1"]),
        (["data.unseen_fraction=1.5"], ["data.unseen_fraction", "[0, 1)"]),
        (["pefll.descriptor_batch=500"], ["pefll.descriptor_batch", "client"]),
        (["model.name=lstm"], ["model.name 'lstm' reads token ids", "fashion_mnist"]),
        # (it reported accuracies of 0 / 0 as 0.0, where the model runs refused it)
        (["data.split=[1.0,0.0,0.0]"], ["no test samples"]),
    ],
)
def test_bad_input_is_one_line_exit_2(overrides, needles, tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(FMNIST)
    sets = [a for o in overrides for a in ("--set", o)]
    code = main(["run", str(tmp_path / "c.yaml"), *sets, "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert all(n in err[0] for n in needles), err[0]


@pytest.mark.parametrize("threads", [2, 3])
def test_local_steps_in_pieces_at_once_equal_all_clients_at_once(threads, tmp_path):
    """The participants' local steps in ``threads`` even pieces run at once (a CPU with that
    many threads; each piece its clients' every step) give the models of all of them in one
    piece on one thread, bit for bit: the clients are independent, and so is each one's
    arithmetic."""
    r = PeFLLRun(config(tmp_path, participation=5), images(), log=quiet)
    theta = torch.randn(5, r.layout.numel, generator=torch.Generator().manual_seed(0)) * 0.1
    rows = np.arange(5)
    calls = []
    real = pefll_run.map_pieces

    def counted(fn, pieces, k):
        calls.append([p.stop - p.start for p in pieces])
        return real(fn, pieces, k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pefll_run, "map_pieces", counted)
        r.forward.piece_threads = lambda device: 1
        one = r.local_steps(theta, rows, 0)
        r.forward.piece_threads = lambda device: threads
        at_once = r.local_steps(theta, rows, 0)
    assert calls == [[5], {2: [2, 3], 3: [1, 2, 2]}[threads]]
    assert torch.equal(at_once, one)
    assert not torch.equal(one, theta)  # the steps moved the models


@pytest.mark.parametrize("embed", ["lenet", "labels"])
def test_each_clients_embed_message_is_its_own_vjp(embed, tmp_path):
    """The rank's embedding messages, all in one vectorised call, are each client's own
    gradient of <v(B_i; eta_v), g_i> (autograd on that client alone), the same bits whichever
    clients share the call (a lone client's too)."""
    r = PeFLLRun(config(tmp_path, pefll={"embed": embed}, participation=5), images(), log=quiet)
    gen = torch.Generator().manual_seed(1)
    eta_v = r.hub_state["eta_v"]
    rows = np.arange(5)
    idx, w = r.batches(rows, 0, 1, 1, 8)
    x, y = r.train.take(torch.as_tensor(rows), idx[0])
    w = w[0].clone()
    w[2, 5:] = 0  # a client whose batch is partly padding
    g = torch.randn(5, r.dim, generator=gen)
    out = r.client_embed_grads(eta_v, x, y, w, g)
    for a in range(5):
        ev = eta_v.clone().requires_grad_()
        phi = functional_call(r.embed.module, r.embed.layout.unflatten(ev), (x[a], y[a]))
        v = (phi * w[a, :, None]).sum(0) / w[a].sum()
        (want,) = torch.autograd.grad(v @ g[a], ev)
        torch.testing.assert_close(out[a], want, rtol=1e-5, atol=1e-7)
    for part in (slice(1, 2), slice(4, 5), slice(1, 4), slice(3, 5)):  # the same bits
        assert torch.equal(r.client_embed_grads(eta_v, *(t[part] for t in (x, y, w, g))),
                           out[part])  # fmt: skip
    assert r.client_embed_grads(eta_v, x[:0], y[:0], w[:0], g[:0]).shape == (0, eta_v.numel())


def test_the_descriptor_normalization_is_the_first_descriptors_and_kept(tmp_path):
    """The hub fixes (shift, scale) from the first descriptor it receives, round 0's first
    participant's (mean and standard deviation of its entries), and keeps them after."""
    r = PeFLLRun(config(tmp_path), images(), log=quiet)
    seen = []
    real = r.hub.normalize
    r.hub = Recorder(r.hub)
    r.hub.normalize = lambda state, v: seen.append(v.clone()) or real(state, v)
    one_round(r, 0)
    first = (r.hub_state["desc_shift"].clone(), r.hub_state["desc_scale"].clone())
    torch.testing.assert_close(first[0], seen[0][0].mean())
    torch.testing.assert_close(first[1], seen[0][0].std())
    one_round(r, 1)
    assert len(seen) == 2 and not torch.equal(seen[1][0], seen[0][0])
    assert torch.equal(r.hub_state["desc_shift"], first[0])
    assert torch.equal(r.hub_state["desc_scale"], first[1])


def test_a_round_waits_for_the_device_only_for_the_finite_check(monkeypatch, tmp_path):
    """On a GPU the host queues a PeFLL round and waits once, to read whether the hub's
    models are finite (an error then names the round): the Adam step's count, the
    normalization's flag and the labels' one-hot stay on the device (with torch.optim's fused
    Adam kernel; a build without it on this device reads the step count)."""
    if pefll.fused_adam("cpu") is None:
        pytest.skip("no fused Adam kernel on the CPU in this PyTorch build (from 2.4)")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_ops

    r = PeFLLRun(config(tmp_path), images(), log=quiet)
    one_round(r, 0)
    with bench_ops.Waits() as mode:
        one_round(r, 1)
        one_round(r, 2)
    assert mode.seen == ["aten._local_scalar_dense.default"] * 2


@pytest.mark.parametrize("layers", [1, 4])
def test_hidden_layers_sets_the_hypernetworks_depth(layers, tmp_path):
    """pefll.hidden_layers = k builds k hidden Linear+ReLU pairs (counted modules, in order,
    l -> hidden -> ... -> hidden), then one linear head per client tensor; the hub's eta_h
    has the hand count (l + 1) h + (k - 1) (h + 1) h + (h + 1) P, P the LeNet's parameters."""
    from torch import nn

    hidden, l = 7, 3
    cfg = config(tmp_path, pefll={"hidden": hidden, "hidden_layers": layers})
    r = PeFLLRun(cfg, images(), log=quiet)
    body = list(r.hyper.module.body)
    assert len(body) == 2 * layers
    assert all(isinstance(m, nn.Linear) for m in body[0::2])
    assert all(isinstance(m, nn.ReLU) for m in body[1::2])
    assert [(m.in_features, m.out_features) for m in body[0::2]] == [(l, hidden)] + [
        (hidden, hidden)
    ] * (layers - 1)
    client = list(build_model("lenet", (1, 16, 16), 4).parameters())
    P = sum(p.numel() for p in client)
    heads = r.hyper.module.heads
    assert len(heads) == len(client) and all(h.in_features == hidden for h in heads)
    assert sum(isinstance(m, nn.Linear) for m in r.hyper.module.modules()) == layers + len(client)
    expected = (l + 1) * hidden + (layers - 1) * (hidden + 1) * hidden + (hidden + 1) * P
    assert r.hub_state["eta_h"].numel() == expected


def test_a_last_round_that_blows_up_the_hub_is_neither_evaluated_nor_saved(tmp_path):
    """The hub's networks after each update are checked before a log or a checkpoint (the
    next round's models were checked only in that round, so the last round's NaN models were
    evaluated as ordinary accuracies and checkpointed)."""
    with pytest.raises(
        GossipError,
        match=r"round 1: the hub's networks became NaN/inf; lower "
        r"pefll.lr \(now 0.001\) or pefll.client_lr \(now 1e\+30\)",
    ):
        run(config(tmp_path, rounds=1, pefll={"client_lr": 1e30}), images(), log=quiet)
    assert not (tmp_path / checkpoint.FILE).exists()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_unseen_clients_need_training_data_and_score_only_with_test_data(tmp_path):
    """An unseen client without training data is refused (its model came from an all-zero
    descriptor); one without test data has no accuracy, and the unseen clients' mean leaves
    it out (it counted as 0) as the seen clients' does."""
    ds = images()
    c = ds.clients[6]
    ds.clients[6] = ClientData(c.x_train[:0], c.y_train[:0], c.x_val, c.y_val, c.x_test, c.y_test)
    with pytest.raises(GossipError, match="unseen client 6 has no training sample"):
        PeFLLRun(config(tmp_path / "a"), ds, log=quiet)
    ds = images()
    c = ds.clients[7]
    ds.clients[7] = ClientData(c.x_train, c.y_train, c.x_val, c.y_val, c.x_test[:0], c.y_test[:0])
    r = PeFLLRun(config(tmp_path / "b"), ds, log=quiet)
    one_round(r, 0)
    ((_, acc, n),) = r.evaluate(r.unseen_train, [r.unseen_test], r.unseen_pos, 2)
    assert n.tolist() == [10, 0] and acc[0] > 0
    assert r.metrics_row(0)["unseen_test_accuracy"] == acc[0]


def test_a_pefll_run_draws_the_model_runs_figures(tmp_path):
    """A PeFLL run wrote no figures (the loop's default drew none), though its rows hold
    what they show and `gossip-pfl plot` drew them."""
    run(config(tmp_path, rounds=1), images(), log=quiet)
    figures = sorted(p.name for p in PeFLLRun.write_plots(tmp_path))
    assert figures == sorted(f"{n}.png" for n in ("accuracy_vs_round", "loss_vs_round",
                                                 "consensus_vs_round", "accuracy_vs_bytes",
                                                 "client_accuracy_hist"))  # fmt: skip
    assert all((tmp_path / "plots" / f).stat().st_size > 0 for f in figures)
