"""The gossip runtime: placement, exchange, batched local work, equality across placements."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import run_ranks, toy_dataset

from gossip_pfl.config import load_config
from gossip_pfl.errors import GossipError
from gossip_pfl.runtime import exchange
from gossip_pfl.runtime.comm import LocalComm, Pending, gather_rows, row_index
from gossip_pfl.runtime.placement import Placement
from gossip_pfl.runtime.stack import BatchedForward, ParamLayout
from gossip_pfl.train import Trainer
from topologies import Phase

SCHEDULES = {
    "ring": {"graph": "ring", "weights": "max_degree"},
    "link_failure": {
        "graph": "ring",
        "weights": "metropolis",
        "time_varying": {"kind": "link_failure", "q": 0.3},
    },
    "server": {"graph": "server"},
}


def make_cfg(tmp, schedule="ring", algorithm="dsgd", rounds=5, **algo):
    base = {
        "seed": 7,
        "rounds": rounds,
        "algorithm": {"name": algorithm, "batch_size": 16, "lr": 0.2, "momentum": 0.5, **algo},
        "schedule": SCHEDULES[schedule] if isinstance(schedule, str) else schedule,
        "eval": {"every": rounds},
        "out": str(tmp),
    }
    return load_config(base=base)


def train_and_collect(cfg, n_peers=8):
    """Run a config on this rank and return {peer: (M, P) parameters, its pi, the run's
    summary as this rank computed it}."""
    trainer = Trainer(cfg, dataset=toy_dataset(n_peers), log=lambda *a: None)
    summary = trainer.run()
    theta = trainer.shared_parameters()
    pi = trainer.personal["pi"].cpu().numpy()
    return {int(p): (theta[i], pi[i], summary) for i, p in enumerate(trainer.peers)}


def gathered(results):
    out = {}
    for status, value in results:
        assert status == "ok", value
        out.update(value)
    return out


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_placements_give_equal_parameters(schedule, tmp_path):
    cfg = make_cfg(tmp_path / "one", schedule)
    single = train_and_collect(cfg)
    for world in (2, 4):
        cfg_k = make_cfg(tmp_path / f"w{world}", schedule)
        multi = gathered(run_ranks(world, train_and_collect, cfg_k))
        assert sorted(multi) == sorted(single)
        for peer, (theta, _, _) in single.items():
            np.testing.assert_allclose(multi[peer][0], theta, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "options",
    [{}, {"pi_init": "random"}, {"client_weighting": "gossip"}, {"q_smoothing": 0.2}],
    ids=str,
)
def test_dfedem_placements_equal(options, tmp_path):
    """The mixture (M = 3, private pi) on 1 rank and on 4 Gloo ranks; random initial pi is drawn
    per peer, and the gossip's size weights come from the schedule on every rank, so they too
    are the same whatever the placement."""
    cfg = make_cfg(tmp_path / "one", "ring", "dfedem", components=3, **options)
    single = train_and_collect(cfg)
    cfg4 = make_cfg(tmp_path / "four", "ring", "dfedem", components=3, **options)
    multi = gathered(run_ranks(4, train_and_collect, cfg4))
    for peer, (theta, pi, summary) in single.items():
        np.testing.assert_allclose(multi[peer][0], theta, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(multi[peer][1], pi, rtol=1e-6, atol=1e-7)
        # every rank reports the same usage of the components, gathered over all peers
        np.testing.assert_allclose(multi[peer][2]["mixture_weights"], summary["mixture_weights"],
                                   atol=1e-5)  # fmt: skip
        assert multi[peer][2]["mixture_leaders"] == summary["mixture_leaders"]


def _unseen_summary(cfg):
    data = toy_dataset(9)
    data.unseen = [8]  # one held-out client: with two ranks, one of them holds none
    trainer = Trainer(cfg, dataset=data, log=lambda *a: None)
    summary = trainer.run()
    trainer.comm.close()
    return summary


def test_unseen_clients_fewer_than_ranks(tmp_path):
    """Held-out clients are spread over the ranks like peers; a rank with none still joins the
    gather, and every rank reports what one process does."""
    single = _unseen_summary(make_cfg(tmp_path / "one", "ring", "dfedem", components=2))
    results = run_ranks(2, _unseen_summary, make_cfg(tmp_path / "two", "ring", "dfedem",
                                                     components=2))  # fmt: skip
    for status, summary in results:
        assert status == "ok", summary
        np.testing.assert_allclose(summary["unseen_test_accuracy"],
                                   single["unseen_test_accuracy"], atol=1e-9)  # fmt: skip


def test_gossip_preserves_average_and_contracts_at_rho(tmp_path):
    """No local steps: theta_{t+1} = W theta_t. The average is conserved and the consensus
    distance shrinks by at most rho^2 per round (exactly for the slowest eigenvector)."""
    cfg = make_cfg(tmp_path, "ring", local_steps=0)
    trainer = Trainer(cfg, dataset=toy_dataset(8), log=lambda *a: None)
    gen = torch.Generator().manual_seed(0)
    trainer.nodes.copy_(torch.randn(trainer.nodes.shape, generator=gen, dtype=torch.float32))
    mean0 = trainer.nodes.double().mean(0)
    W = trainer.schedule.matrix(0)
    rho = np.linalg.norm(W - 1 / 8, 2)
    d_prev = sum(trainer.consensus_distance())
    for t in range(20):
        trainer.communicate(t)
        d = sum(trainer.consensus_distance())
        assert d <= rho**2 * d_prev * (1 + 1e-5)
        d_prev = d
    torch.testing.assert_close(trainer.nodes.double().mean(0), mean0, rtol=0, atol=1e-6)
    # Start on the slowest eigenvector: the contraction is exactly rho^2 per round.
    vals, vecs = np.linalg.eigh(W)
    slow = vecs[:, np.argsort(np.abs(vals))[-2]]
    trainer.nodes.copy_(
        torch.as_tensor(slow, dtype=torch.float32)[:, None, None].expand_as(trainer.nodes)
    )
    before = sum(trainer.consensus_distance())
    trainer.communicate(0)
    assert sum(trainer.consensus_distance()) == pytest.approx(rho**2 * before, rel=1e-5)


def _die_at_round_2(cfg):
    trainer = Trainer(cfg, dataset=toy_dataset(8), log=lambda *a: None)
    for t in range(cfg.rounds):
        if t == 2 and trainer.comm.rank == 1:
            os._exit(3)  # a crashed rank: no clean-up, no goodbye
        trainer.local_work(t)
        trainer.communicate(t)
    return "finished"


def _three_groups(store_port: int):
    from gossip_pfl.runtime.comm import init_comm

    os.environ["MASTER_PORT"] = str(store_port)  # the "agent's" store, kept across groups
    sums = []
    for k in range(3):  # three runs in one job, as a sweep under one torchrun
        comm = init_comm("cpu", "gloo", 20)
        sums.append(comm.all_reduce_sum(torch.full((1,), comm.rank + 10.0 * k)).item())
        comm.close()
    return sums


def test_one_job_makes_several_process_groups():
    """Under torchrun every group's keys land in the agent's one store: each group's under
    its own prefix, so a later group never reads an earlier one's (closed) addresses (Gloo's
    "connection refused"). Here this process plays the agent and holds the store."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    results = run_ranks(2, _three_groups, store.port, timeout=90, env=env)
    assert results == [("ok", [1.0, 21.0, 41.0])] * 2, results


def test_dead_rank_makes_others_fail_fast(tmp_path):
    cfg = make_cfg(tmp_path, "ring", rounds=6)
    cfg.runtime.timeout_s = 5
    start = time.monotonic()
    results = run_ranks(4, _die_at_round_2, cfg, timeout=90)
    # well under the harness's 90 s kill (spawning 4 torch processes on a loaded 2-core
    # machine alone can take 30 s); a hang would end as "missing", not "error", below
    assert time.monotonic() - start < 60
    assert results[1] == ("missing", 3)
    for r in (0, 2, 3):
        status, message = results[r]
        assert status == "error" and "GossipError" in message, results[r]
        assert "\n" not in message


def test_placement_arithmetic():
    p = Placement(10, 4, rank=0)
    sizes = np.diff(p.starts)
    assert sizes.tolist() == [3, 3, 2, 2]
    assert p.owner(np.arange(10)).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert p.nodes(11).tolist() == [0, 1, 2, 10]  # the aggregating hub lives on rank 0
    assert Placement(10, 4, rank=1).nodes(11).tolist() == [3, 4, 5]


class _PostedComm:
    """A stand-in for the process group inside one process: every rank's sends are posted
    first, then each rank's receives are filled from them."""

    device = torch.device("cpu")

    def __init__(self, rank: int, posted: dict):
        self.rank, self.posted = rank, posted

    def exchange(self, sends, recvs):
        for src, buf in recvs.items():
            buf.copy_(self.posted[src, self.rank])
        return Pending([], sorted(recvs), self.rank)


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_every_rank_plan_reproduces_the_dense_product(world, sparse, rowwise, monkeypatch):
    """Each rank's sends, receive buffer and two mixing blocks give its rows of W @ X, for
    random sparse W with an aggregating hub node (on rank 0), dense or sparse blocks, the
    received rows in one product or one by one, over a sequence of phases that receive more
    or fewer rows (the receive buffer is reused)."""
    monkeypatch.setattr(exchange, "ROWWISE_ROWS", 10**6 if rowwise else 0)
    monkeypatch.setattr(exchange, "ROWWISE_LOCAL", 10**6)
    monkeypatch.setattr(exchange, "ROWWISE_CHUNK", 3)  # chunks of 1 to 3 columns
    monkeypatch.setattr(exchange, "DENSE_BLOCK_ENTRIES", 0 if sparse else 10**6)
    monkeypatch.setattr(exchange, "DENSE_BLOCK_FILL", 2.0)  # a quarter-full block stays sparse
    n_peers, size, d = 11, 12, 5
    rng = np.random.default_rng(world)
    placements = [Placement(n_peers, world, r) for r in range(world)]
    exchangers = [exchange.Exchanger(p, _PostedComm(r, {})) for r, p in enumerate(placements)]
    for density in (0.3, 0.1, 0.6, 0.3):
        w = rng.random((size, size)) * (rng.random((size, size)) < density)
        w[5] = w[7] = 0.0  # a node with no row keeps its value ...
        phase = Phase.from_dense(w)
        # ... and one whose row lists only zero weights becomes zero, as in Phase.dense()
        phase = Phase(size, np.append(phase.rows, 7), np.append(phase.cols, 2),
                      np.append(phase.weights, 0.0))  # fmt: skip
        x = torch.as_tensor(rng.standard_normal((size, d)))
        plans = [exchange.plan_phase(phase, p, torch.device("cpu")) for p in placements]
        states = [x[p.nodes(size)] for p in placements]
        posted = {(r, dst): states[r][i] for r in range(world) for dst, i in plans[r].sends.items()}
        expected = torch.as_tensor(phase.dense()) @ x
        for r, (p, ex) in enumerate(zip(placements, exchangers)):
            assert (plans[r].own.layout == torch.strided) != sparse
            ex.comm.posted, sent = posted, ex.messages_sent
            torch.testing.assert_close(ex.mix(states[r], plans[r]), expected[p.nodes(size)])
            assert ex.messages_sent - sent == len(plans[r].sends)
            assert r not in plans[r].sends
            for src, k in plans[r].recv_counts.items():  # what r receives is what src sends it
                assert len(posted[src, r]) == k


@pytest.mark.parametrize("dense", [False, True])
def test_a_rank_whose_rows_take_only_other_ranks_values_mixes_them(dense, monkeypatch):
    """A phase in which every row of a rank reads only the other rank's nodes (its block over
    its own rows is empty: zeros of the state's dtype), duplicates summed in order: each
    rank's rows of W @ X, to the bit of the dense product of the summed entries."""
    monkeypatch.setattr(exchange, "DENSE_BLOCK_ENTRIES", 10**6 if dense else 0)
    n, d = 6, 3
    rows = np.r_[np.arange(n), np.arange(n)]
    cols = (rows + n // 2) % n  # node i reads node i + 3, twice: rank 0 reads rank 1 and back
    w = np.r_[np.full(n, 0.1), np.full(n, 0.9)]
    phase = Phase(n, rows, cols, w)
    x = torch.as_tensor(np.random.default_rng(0).standard_normal((n, d)))
    placements = [Placement(n, 2, r) for r in range(2)]
    plans = [exchange.plan_phase(phase, p, torch.device("cpu")) for p in placements]
    states = [x[p.nodes(n)] for p in placements]
    posted = {(r, dst): states[r][i] for r in range(2) for dst, i in plans[r].sends.items()}
    expected = torch.as_tensor(phase.dense()) @ x
    for r, p in enumerate(placements):
        assert not plans[r].own.to_dense().any()
        assert plans[r].own.dtype == torch.float64
        ex = exchange.Exchanger(p, _PostedComm(r, posted))
        assert torch.equal(ex.mix(states[r], plans[r]), expected[p.nodes(n)])


def test_rows_added_one_by_one_do_not_depend_on_how_they_are_cut(monkeypatch):
    """add_rows over rows cut into uneven parts (as zmq frames cut them, across rows) gives
    the bits of adding whole rows one at a time, and the product up to rounding; a sender
    left out (a lost link) adds nothing."""
    monkeypatch.setattr(exchange, "ROWWISE_CHUNK", 10)  # 5 columns per chunk for 2 rows
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 13, generator=g)
    w = torch.rand(2, 5, generator=g)
    rows = torch.randn(5, 13, generator=g)  # sender A: rows 0-2, sender B: rows 3-4
    flat_a, flat_b = rows[:3].reshape(-1), rows[3:].reshape(-1)
    cut_a = list(flat_a.split([4, 0, 17, 1, 17]))  # parts straddle rows and chunks
    cut_b = list(flat_b.split([13, 13]))
    whole, cut = base.clone(), base.clone()
    exchange.add_rows(whole, w, [(0, 3, [flat_a]), (3, 2, [flat_b])])
    exchange.add_rows(cut, w, [(0, 3, cut_a), (3, 2, cut_b)])
    want = base.clone()
    for k in range(5):
        want += w[:, k : k + 1] * rows[k]
    assert torch.equal(whole, want) and torch.equal(cut, want)
    torch.testing.assert_close(cut, base + w @ rows)
    only_b = base.clone()
    exchange.add_rows(only_b, w, [(3, 2, cut_b)])
    torch.testing.assert_close(only_b, base + w[:, 3:] @ rows[3:])


def test_gathered_rows_land_at_their_positions_whichever_the_index():
    """gather_rows against writing each row by hand: a contiguous run of positions goes
    through a slice (no indexing kernel), any other set through an index, including runs
    that start at 0, descend, skip, hold one row or none."""
    g = torch.Generator().manual_seed(0)
    for positions in ([0, 1, 2, 3], [2, 3, 4], [5], [], [4, 3, 2], [0, 2, 5], range(3, 7)):
        rows = torch.randn(len(positions), 3, generator=g, dtype=torch.float64)
        want = torch.zeros(7, 3, dtype=torch.float64)
        for k, p in enumerate(positions):
            want[p] = rows[k]
        assert torch.equal(gather_rows(LocalComm(torch.device("cpu")), rows, positions, 7), want)
    assert row_index(np.array([2, 3, 4]), "cpu") == slice(2, 5)
    assert torch.equal(row_index(np.array([-1, 0]), "cpu"), torch.tensor([-1, 0]))


@pytest.mark.parametrize("world", [0, 9])
def test_world_size_incompatible(world):
    with pytest.raises(GossipError, match="world size"):
        Placement(8, world)


def test_schedule_n_mismatch(tmp_path):
    cfg = make_cfg(tmp_path, {"n": 6, "graph": "ring", "weights": "metropolis"})
    with pytest.raises(GossipError, match="n = 6 but the run has 8"):
        Trainer(cfg, dataset=toy_dataset(8))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_nccl_without_gpu(tmp_path):
    cfg = make_cfg(tmp_path)
    cfg.runtime.backend = "nccl"
    with pytest.raises(GossipError, match="nccl"):
        Trainer(cfg, dataset=toy_dataset(8))


def test_unbatchable_model_when_batching_demanded():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    with pytest.raises(GossipError, match="cannot be batched"):
        BatchedForward(model, ParamLayout(model), "vmap")
    auto = BatchedForward(model, ParamLayout(model), "auto")
    assert auto.mode == "loop" and "buffers" in auto.describe()


def test_native_batched_layers_are_checked_instead_of_vmap():
    """A model with its own batched layers keeps them even when vmap could not run its plain
    forward (here a data-dependent .item())."""

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.w * float(x.abs().max().item() > -1)

        @staticmethod
        def batched_forward(params, x):  # (L, M, 3), (L, B, 3) -> (L, M, B, 3)
            return x[:, None] * params["w"][:, :, None]

    model = Scaled()
    layout = ParamLayout(model)
    theta, x = torch.randn(2, 2, 3), torch.randn(2, 4, 3)
    forward = BatchedForward(model, layout, "auto")
    forward.check(theta, x)
    assert forward.mode == "vmap" and "batched layers" in forward.describe()
    torch.testing.assert_close(forward(theta, x), BatchedForward(model, layout, "loop")(theta, x))


def test_batched_forward_equals_loop():
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    layout = ParamLayout(model)
    theta = torch.randn(5, 2, layout.numel)
    x = torch.randn(5, 7, 4)
    fast = BatchedForward(model, layout, "vmap")(theta, x)
    slow = BatchedForward(model, layout, "loop")(theta, x)
    assert fast.shape == (5, 2, 7, 3)
    torch.testing.assert_close(fast, slow)


@pytest.mark.parametrize(
    "name, options, words",
    [
        ("mlp", {"hidden": [-3]}, "option 'hidden' must be a list of positive integers"),
        ("mlp", {"hidden": "abc"}, "option 'hidden' must be a list of positive integers"),
        ("mlp", {"hidden": 5}, "option 'hidden' must be a list of positive integers"),
        ("cnn", {"hidden": 0}, "option 'hidden' must be a positive integer"),
        ("cnn", {"channels": [4, True]}, "option 'channels' must be a list"),
        ("lstm", {"layers": 1.5}, "option 'layers' must be a positive integer"),
        ("mlp", {"width": 3}, "bad option"),
    ],
)
def test_bad_model_options_name_the_option(name, options, words):
    """torch's own messages for these ("negative dimension -3") named no option."""
    from gossip_pfl.models import build_model

    shape = (1, 28, 28) if name == "cnn" else (12,)
    with pytest.raises(GossipError, match=f"model '{name}': {words}"):
        build_model(name, shape, 4, **options)


@pytest.mark.parametrize(
    "name, shape, options",
    [
        ("linear", (3, 4), {}),
        ("mlp", (12,), {"hidden": [7, 5]}),
        ("cnn", (1, 28, 28), {"channels": [3, 4], "hidden": 6}),
        ("cnn", (3, 32, 32), {"channels": [2, 5], "hidden": 4}),
    ],
)
def test_native_batched_layers_equal_the_plain_model(name, shape, options):
    """A model's own batched_forward gives the per-(peer, component) nn.Module's outputs and
    gradients."""
    _batched_layers_equal_the_loop(name, shape, options)


def _count_first_block_products(monkeypatch) -> list:
    """A list that gets an item each time a CPU's first convolution takes the products."""
    from gossip_pfl import models

    calls = []
    block = models._first_block_by_products
    monkeypatch.setattr(models, "_first_block_by_products", lambda *a: calls.append(1) or block(*a))
    return calls


@pytest.mark.parametrize(
    "name, shape, options",
    [
        ("cnn", (1, 28, 28), {"channels": [3, 4], "hidden": 6}),
        ("cnn", (3, 32, 32), {"channels": [2, 5], "hidden": 4}),
        ("cnn", (2, 30, 27), {"channels": [2, 5], "hidden": 4}),  # odd sizes: the pools floor
        ("lenet", (1, 16, 21), {}),
    ],
)
@pytest.mark.parametrize("first", ["products", "groups"])
def test_cpu_first_convolution_in_either_form_equals_the_plain_model(
    monkeypatch, name, shape, options, first
):
    """A CPU's first convolution as one product per peer over its images' patches, or as one
    convolution group per peer (``CPU_PATCH_*`` choose; both forced here), gives the
    per-(peer, component) nn.Module's outputs and gradients, on square and odd images."""
    from gossip_pfl import models

    monkeypatch.setattr(models, "CPU_PATCH_ROWS_PER_OUTPUT", 10**6 if first == "products" else 0)
    calls = _count_first_block_products(monkeypatch)
    _batched_layers_equal_the_loop(name, shape, options)
    assert bool(calls) == (first == "products")


@pytest.mark.parametrize(
    "shape, c1, components, patch_bytes, products",
    [
        ((1, 28, 28), 8, 3, 256 << 20, True),  # the study's CNN: 26 rows for 24 outputs
        ((1, 28, 28), 16, 1, 256 << 20, True),  # LeNet, one component: 26 for 16
        ((3, 32, 32), 16, 1, 256 << 20, False),  # 76 rows for 16 outputs: the copy costs more
        ((3, 32, 32), 32, 3, 256 << 20, True),  # the paper's widths on color images
        ((1, 28, 28), 8, 3, 1 << 20, False),  # patches past the bound: the groups' memory
    ],
)
def test_cpu_first_convolution_form_follows_its_patches(
    monkeypatch, shape, c1, components, patch_bytes, products
):
    """The CPU takes the products where its patches hold at most 2 rows per output channel
    and fit ``CPU_PATCH_BYTES`` (4 peers x 32 images here)."""
    from gossip_pfl import models

    monkeypatch.setattr(models, "CPU_PATCH_BYTES", patch_bytes)
    calls = _count_first_block_products(monkeypatch)
    C = shape[0]
    params = {
        "conv1.weight": torch.randn(4, components, c1, C, 5, 5),
        "conv1.bias": torch.randn(4, components, c1),
        "conv2.weight": torch.randn(4, components, 4, c1, 5, 5),
        "conv2.bias": torch.randn(4, components, 4),
    }
    models.conv_blocks(params, torch.randn(4, 32, *shape))
    assert bool(calls) == products


@pytest.mark.parametrize(
    "name, shape, options",
    [
        ("cnn", (1, 28, 28), {"channels": [3, 4], "hidden": 6}),
        ("cnn", (2, 30, 27), {"channels": [2, 5], "hidden": 4}),  # odd sizes: the pools floor
        ("lenet", (1, 16, 21), {}),
    ],
)
@pytest.mark.parametrize("slices", ["one-product", "per-group", "uneven"])
def test_convolutions_as_products_equal_the_plain_model(monkeypatch, name, shape, options, slices):
    """The GPU's form of the convolutions (batched products over image patches, in slices of
    groups past PATCH_BYTES: one, one group each, or 4 + 2 of the second conv's 6 groups), run
    here on the CPU, gives the per-(peer, component) nn.Module's outputs and gradients."""
    from gossip_pfl import models

    # the helper's 3 peers x 2 components x 5 samples, float64: the second conv's patches
    model = models.build_model(name, shape, 4, **options)
    c1, c2 = model.conv2.in_channels, model.conv2.out_channels
    h, w = ((shape[1] - 4) // 2 - 4, (shape[2] - 4) // 2 - 4)
    group = max(c1 * 25, c2) * 5 * h * w * 8
    patch_bytes = {"one-product": 2 << 30, "per-group": 1, "uneven": 4 * group}[slices]
    monkeypatch.setattr(models, "CONV_AS_PRODUCTS", ("cpu",))
    monkeypatch.setattr(models, "PATCH_BYTES", patch_bytes)
    products = []
    conv_pool_relu = models._conv_pool_relu
    monkeypatch.setattr(
        models, "_conv_pool_relu", lambda *a: products.append(len(a[0])) or conv_pool_relu(*a)
    )
    _batched_layers_equal_the_loop(name, shape, options)
    assert products[:2] == [3, 6]  # the products ran: 3 peers, then 6 (peer, component)s


@pytest.mark.parametrize("first", ["products", "groups"])
def test_convolutions_as_products_under_bf16_autocast(monkeypatch, first):
    """Under bf16 autocast the GPU's products (which copy the patches in bf16) and the CPU's
    form (its first convolution as products or groups, its second grouped) give the same
    logits and gradients up to bf16 rounding."""
    from gossip_pfl import models

    monkeypatch.setattr(models, "CPU_PATCH_ROWS_PER_OUTPUT", 10**6 if first == "products" else 0)

    torch.manual_seed(0)
    model = models.build_model("cnn", (1, 28, 28), 4, channels=[3, 4], hidden=6)
    layout = ParamLayout(model)
    theta = 0.3 * torch.randn(3, 2, layout.numel)
    x = torch.randn(3, 5, 1, 28, 28)
    outs = {}
    for devices in ((), ("cpu",)):
        monkeypatch.setattr(models, "CONV_AS_PRODUCTS", devices)
        t = theta.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = BatchedForward(model, layout, "auto")(t, x)
        outs[devices] = (out.float(), torch.autograd.grad(out.float().sum(), t)[0])
    (out_g, grad_g), (out_p, grad_p) = outs.values()
    assert out_g.abs().max() > 0.1  # logits far from 0: the tolerances below mean something
    torch.testing.assert_close(out_p, out_g, rtol=0.05, atol=0.05 * out_g.abs().max().item())
    torch.testing.assert_close(grad_p, grad_g, rtol=0.05, atol=0.05 * grad_g.abs().max().item())


def _batched_layers_equal_the_loop(name: str, shape: tuple, options: dict) -> None:
    from gossip_pfl.models import build_model

    torch.manual_seed(0)
    model = build_model(name, shape, 4, **options)
    layout = ParamLayout(model)
    assert getattr(model, "batched_forward", None) is not None
    theta = (0.3 * torch.randn(3, 2, layout.numel, dtype=torch.float64)).requires_grad_()
    x = torch.randn(3, 5, *shape, dtype=torch.float64)
    model.double()
    fast = BatchedForward(model, layout, "auto")
    slow = BatchedForward(model, layout, "loop")
    assert fast.mode == "vmap" and "batched layers" in fast.describe()
    out_fast, out_slow = fast(theta, x), slow(theta, x)
    assert out_fast.shape == (3, 2, 5, 4)
    torch.testing.assert_close(out_fast, out_slow)
    g_fast = torch.autograd.grad(out_fast.sin().sum(), theta)[0]
    g_slow = torch.autograd.grad(out_slow.sin().sum(), theta)[0]
    torch.testing.assert_close(g_fast, g_slow)


def test_token_inputs_with_lstm_fall_back_to_the_loop(tmp_path):
    """Text data (int64 token ids) keeps its dtype; an LSTM cannot be vmapped, so the runtime
    reports the per-peer loop and still trains."""
    from gossip_pfl.data.base import ClientData, FederatedDataset

    rng = np.random.default_rng(0)
    clients = []
    for _ in range(4):
        x = rng.integers(0, 5, size=(12, 6))
        y = x[:, -1].copy()  # next token = last token: learnable
        clients.append(ClientData(x, y, x[:0], y[:0], x[:4], y[:4]))
    data = FederatedDataset("tokens", clients, (6,), 5, "multiclass")
    cfg = load_config(
        base={
            "rounds": 2,
            "model": {"name": "lstm", "hidden": 8, "layers": 1},
            "algorithm": {"name": "dsgd", "batch_size": 4},
            "schedule": {"graph": "ring"},
            "out": str(tmp_path),
        }
    )
    trainer = Trainer(cfg, dataset=data, log=lambda *a: None)
    assert trainer.train.x.dtype == torch.int64
    assert trainer.forward.mode == "loop" and "lstm" in trainer.forward.describe()
    summary = trainer.run()
    assert 0 <= summary["test_accuracy"] <= 1
    assert np.isfinite(trainer.shared_parameters()).all()


@pytest.mark.parametrize("algorithm", ["dfedem", "pfedme"])
def test_local_steps_in_peer_pieces_equal_one_piece(algorithm, tmp_path):
    """runtime.step_chunk only splits the peer axis of each step: peers are independent, so
    any piece size gives the parameters of the unsplit step (1 sample: one peer per piece)."""
    results = []
    for chunk in (0, 1, 40):
        schedule = "ring" if algorithm == "dfedem" else None  # pFedMe runs on the server
        cfg = make_cfg(tmp_path / str(chunk), schedule, algorithm=algorithm, rounds=3)
        cfg.runtime.step_chunk = chunk
        trainer = Trainer(cfg, dataset=toy_dataset(6), log=lambda *a: None)
        if chunk:
            pieces = trainer.peer_pieces(6, 16)
            assert [p.stop - p.start for p in pieces] == ([1] * 6 if chunk == 1 else [2, 2, 2])
        trainer.run()
        results.append(trainer.shared_parameters())
    for other in results[1:]:
        np.testing.assert_allclose(other, results[0], rtol=1e-5, atol=1e-6)


def test_call_sizes_come_from_the_model_hint_unless_configured(tmp_path):
    """On a CPU the CNN's and LeNet's hint (about 8 MiB of first-conv output per call) sets
    both budgets; a configured value wins; a model without a hint keeps whole steps and 16384
    for eval."""
    from gossip_pfl.data.base import ClientData, FederatedDataset

    rng = np.random.default_rng(0)
    clients = []
    for _ in range(3):
        x = rng.normal(size=(10, 1, 28, 28)).astype(np.float32)
        y = rng.integers(0, 10, size=10)
        clients.append(ClientData(x, y, x[:0], y[:0], x[:4], y[:4]))
    images = FederatedDataset("images", clients, (1, 28, 28), 10, "multiclass")

    def trainer(model, data, **overrides):
        cfg = make_cfg(tmp_path, algorithm="dfedem", components=3)
        options = {"cnn": {"channels": [8, 16], "hidden": 8}, "mlp": {"hidden": [8]}}
        cfg.model.name, cfg.model.options = model, options.get(model, {})
        for key, value in overrides.items():
            section, name = key.split("__")
            setattr(getattr(cfg, section), name, value)
        return Trainer(cfg, dataset=data, log=lambda *a: None)

    cnn = trainer("cnn", images)
    hint = (8 << 20) // (4 * 3 * 8 * 24 * 24)  # bytes / (float32 x M x c1 x 24 x 24)
    assert cnn.step_chunk == cnn.eval_chunk == hint
    cnn.forward.piece_threads = lambda device: 1  # pieces in turn: the call size's
    assert [p.stop - p.start for p in cnn.peer_pieces(13, 32)] == [hint // 32] * 3 + [1]
    set_by_hand = trainer("cnn", images, runtime__step_chunk=64, eval__chunk=100)
    assert (set_by_hand.step_chunk, set_by_hand.eval_chunk) == (64, 100)
    lenet = trainer("lenet", images)  # 16 first-conv channels
    assert lenet.step_chunk == lenet.eval_chunk == (8 << 20) // (4 * 3 * 16 * 24 * 24)
    mlp = trainer("mlp", images)
    assert (mlp.step_chunk, mlp.eval_chunk) == (0, 16384)
    linear = trainer("linear", toy_dataset(3))
    assert (linear.step_chunk, linear.eval_chunk) == (0, 1 << 20)  # closed form
    assert linear.peer_pieces(300, 128) == [slice(0, 300)]


@pytest.mark.parametrize("dense", [False, True], ids=["cpu", "gpu_layout"])
@pytest.mark.parametrize("active", [None, [0, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]])
@pytest.mark.parametrize("budget", [1, 7, 40, 10_000])
def test_evaluation_chunks_cover_each_real_sample_once(budget, active, dense, monkeypatch):
    """Pieces skip padding-only peers, stay within the sample budget (when it allows a whole
    column), and together visit every real (peer, sample) exactly once; with ``active`` (a
    round's participants: the E-step), those peers' samples only. ``dense``: a GPU's layout
    (one call over the stack where the budget allows: every peer's row, as views)."""
    from gossip_pfl.runtime import data
    from gossip_pfl.runtime.data import PaddedSplit

    monkeypatch.setattr(data, "dense_layout", lambda device: dense)
    sizes = [0, 1, 5, 17, 3, 40]
    xs = [np.full((n, 2), i, dtype=np.float32) for i, n in enumerate(sizes)]
    ys = [np.arange(n) for n in sizes]
    split = PaddedSplit.build(xs, ys, torch.device("cpu"))
    on = np.ones(len(sizes), bool) if active is None else np.array(active, bool)
    seen = np.zeros((len(sizes), max(sizes)), dtype=int)
    for rows, sl, x, y, mask in split.chunks(budget, None if active is None else on):
        assert x.shape[:2] == y.shape == mask.shape and len(rows) == x.shape[0]
        assert x.shape[0] * x.shape[1] <= max(budget, x.shape[1])
        if not (dense and active is None and budget >= 6 * 40):  # (the stack's views)
            assert (split.counts[rows] > sl.start).all()  # no padding-only peer
        assert on[rows.numpy()].all()  # no peer sitting out
        torch.testing.assert_close(x[:, 0, 0], rows.float())  # rows are the right peers
        for r, m in zip(rows.tolist(), mask):
            seen[r, sl][m.cpu().numpy() > 0] += 1
    expected = (np.arange(max(sizes))[None, :] < np.array(sizes)[:, None]) & on[:, None]
    np.testing.assert_array_equal(seen, expected.astype(int))


def test_padded_split_views_back_to_back_inputs_and_pads_the_rest():
    """Clients cut in order from one array, with one count, are a view of it (no copy);
    any other inputs are copied into zero padding; the augmented samples are the real ones
    with a ones column, in peer order."""
    from gossip_pfl.runtime.data import PaddedSplit

    cpu = torch.device("cpu")
    base = np.random.default_rng(0).standard_normal((12, 5)).astype(np.float32)
    xs = [base[3 * i : 3 * i + 3] for i in range(4)]
    ys = [np.arange(3) for _ in xs]
    split = PaddedSplit.build(xs, ys, cpu)
    assert np.shares_memory(split.x.numpy(), base)
    np.testing.assert_array_equal(split.x.numpy(), np.stack(xs))
    for order in (xs[::-1], [xs[0], xs[2]], [x.astype(np.float64) for x in xs]):
        other = PaddedSplit.build(order, ys[: len(order)], cpu)
        assert not np.shares_memory(other.x.numpy(), base)
        np.testing.assert_array_equal(other.x.numpy(), np.stack(order).astype(np.float32))

    sizes = [2, 0, 5, 1]
    xs = [base[:n] + i for i, n in enumerate(sizes)]
    split = PaddedSplit.build(xs, [np.ones(n, dtype=np.int64) for n in sizes], cpu)
    want = np.zeros((4, 5, 5), dtype=np.float32)
    for i, x in enumerate(xs):
        want[i, : len(x)] = x
    np.testing.assert_array_equal(split.x.numpy(), want)
    np.testing.assert_array_equal(split.y.numpy(), split.mask.numpy())
    real = np.concatenate(xs)
    np.testing.assert_array_equal(
        split.augmented.numpy(), np.concatenate([real, np.ones((len(real), 1))], 1)
    )


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux /proc")
def test_padding_that_is_never_written_costs_no_memory():
    """31 peers of 8 samples padded to 2,048 (124 MiB of padding): the resident memory
    grows by about the samples, not the padding (large np.zeros arrays took huge pages, and
    writing a peer's samples made its whole padded row resident)."""
    from gossip_pfl.runtime.data import PaddedSplit

    def resident() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    sizes = [8] * 31 + [2048]
    xs = [np.ones((n, 512), dtype=np.float32) for n in sizes]
    ys = [np.zeros(n, dtype=np.int64) for n in sizes]
    before = resident()
    split = PaddedSplit.build(xs, ys, torch.device("cpu"))
    grew = resident() - before
    assert split.x.shape == (32, 2048, 512) and float(split.x.sum()) == 512 * sum(sizes)
    assert grew < 16 << 20, f"{grew / 2**20:.0f} MiB resident for 4.5 MiB of samples"


def _reference_plan(counts, peers, seed, round_, batch_size, epochs, steps, stream, mean=False):
    """Batch by batch, as the plan is defined: per peer a default_rng((seed, peer, round,
    stream)); epochs cut one permutation each (short last batch), fixed steps cut full
    batches from a running stream of permutations. Weights 1, or with ``mean`` B / b for a
    batch of b samples."""
    per_peer = []
    for i, n_i in zip(peers, counts):
        rng = np.random.default_rng([seed, int(i), round_, stream])
        n_i, b = int(n_i), min(batch_size, int(n_i))
        n_steps = steps if steps is not None else epochs * -(-n_i // batch_size)
        order, batches = np.empty(0, dtype=np.int64), []
        for _ in range(n_steps if n_i else 0):
            if steps is None:
                if len(order) == 0:
                    order = rng.permutation(n_i)
                batches.append(order[:batch_size])
                order = order[batch_size:]
            else:
                while len(order) < b:
                    order = np.concatenate([order, rng.permutation(n_i)])
                batches.append(order[:b])
                order = order[b:]
        per_peer.append(batches)
    S = steps if steps is not None else max((len(b) for b in per_peer), default=0)
    idx = np.zeros((S, len(peers), batch_size), dtype=np.int64)
    weight = np.zeros((S, len(peers), batch_size), dtype=np.float32)
    for l, batches in enumerate(per_peer):
        for s, b in enumerate(batches):
            share = np.float32(batch_size) / np.float32(len(b)) if mean else 1.0
            idx[s, l, : len(b)], weight[s, l, : len(b)] = b, share
    return idx, weight


def test_round_batches_equal_the_batch_by_batch_reference():
    from gossip_pfl.runtime.data import round_batches

    rng = np.random.default_rng(0)
    for _ in range(100):
        L = int(rng.integers(1, 10))
        counts = rng.integers(0, 90, L)
        counts[rng.integers(L)] += 1  # at least one peer with data
        peers = rng.permutation(50)[:L]
        args = (int(rng.integers(1, 40)), int(rng.integers(1, 4)))
        steps = None if rng.random() < 0.5 else int(rng.integers(0, 9))
        # seeds past 2**32 take the plain default_rng path, smaller ones the fast one
        seed = int(rng.choice([3, 2**32 - 1, 2**32, 2**40 + 7]))
        mean = bool(rng.random() < 0.5)
        got = round_batches(counts, peers, seed, 5, *args, steps, 1, mean)
        want = _reference_plan(counts, peers, seed, 5, *args, steps, 1, mean)
        # a batch no wider than the largest peer's data: past it the reference is padding
        width = min(args[0], counts.max())
        assert got[0].shape == (*want[0].shape[:2], width) and not want[1][..., width:].any()
        for g, w in zip(got, want):
            assert np.array_equal(g, w[..., :width])


@pytest.mark.parametrize("batching", ["auto", "vmap"])
@pytest.mark.parametrize("divisor", ["batch", "batch_size"])
def test_local_sgd_equals_a_per_client_torch_loop(divisor, batching, tmp_path):
    """Two epochs of plain SGD == each client alone, minibatch by minibatch of the same plan,
    on torch's binary cross-entropy summed and divided by the batch's own samples
    (``loss_divisor: batch``: ``reduction='mean'``, the released FedEM code) or by B
    (``batch_size``). Clients hold 20 to 85 samples and B = 16, so each epoch of every client
    ends on a short batch; ``auto`` takes the fused closed-form step, ``vmap`` autograd."""
    from gossip_pfl.runtime.data import round_batches

    B, lr, seed = 16, 0.3, 5
    cfg = load_config(base={
        "seed": seed, "rounds": 1, "out": str(tmp_path),
        "algorithm": {"name": "local", "batch_size": B, "lr": lr, "local_epochs": 2,
                      "loss_divisor": divisor},
        "runtime": {"device": "cpu", "batching": batching},
    })  # fmt: skip
    data = toy_dataset(6)
    tr = Trainer(cfg, dataset=data, log=lambda *a: None)
    assert tr.forward.closed_form == (batching == "auto")
    L = len(tr.peers)
    start = tr.nodes[:L, 0].clone()
    tr.local_work(0)
    idx, real = round_batches(tr.counts, tr.train_ids[tr.peers], seed, 0, B, epochs=2)
    short = 0
    for l in range(L):
        client = data.clients[int(tr.train_ids[tr.peers[l]])]
        x, y = torch.as_tensor(client.x_train), torch.as_tensor(client.y_train).double()
        p = {k: v.double() for k, v in tr.layout.unflatten(start[l]).items()}
        w, b = p["fc.weight"].requires_grad_(), p["fc.bias"].requires_grad_()
        for s in range(idx.shape[0]):
            rows = idx[s, l][real[s, l] > 0]
            if len(rows) == 0:
                continue
            short += len(rows) < B
            z = (x[rows].double() @ w.T + b)[:, 0]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(z, y[rows], reduction="sum")
            loss = loss / (len(rows) if divisor == "batch" else B)
            gw, gb = torch.autograd.grad(loss, (w, b))
            w, b = (w - lr * gw).detach().requires_grad_(), (b - lr * gb).detach().requires_grad_()
        got = tr.layout.unflatten(tr.nodes[l, 0])
        torch.testing.assert_close(got["fc.weight"].double(), w.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["fc.bias"].double(), b.detach(), rtol=1e-5, atol=1e-6)
    assert short == 2 * L  # every epoch of every client ended on a short batch


def test_fedavg_plus_fine_tunes_an_unseen_client_as_a_per_client_loop(tmp_path):
    """FedAvg+'s unseen client takes the local epoch a seen peer takes at evaluation: from the
    peers' average, plain SGD on its own training data (minibatches of stream 1, the batch's
    mean loss), then it is scored; equal to that loop written out with torch."""
    from gossip_pfl.runtime.data import round_batches

    B, lr, seed = 16, 0.3, 5
    cfg = load_config(base={
        "seed": seed, "rounds": 2, "out": str(tmp_path),
        "algorithm": {"name": "fedavg_plus", "batch_size": B, "lr": lr},
        "runtime": {"device": "cpu"},
    })  # fmt: skip
    data = toy_dataset(7)
    data.unseen = [6]  # 98 training samples: 6 full batches and a short one
    tr = Trainer(cfg, dataset=data, log=lambda *a: None)
    for t in range(2):
        tr.local_work(t)
        tr.communicate(t)
    _, acc, _ = tr.evaluate_unseen()
    theta_bar = tr.nodes[: len(tr.peers), 0].double().mean(0)
    client = data.clients[6]
    x, y = torch.as_tensor(client.x_train).double(), torch.as_tensor(client.y_train).double()
    p = tr.layout.unflatten(theta_bar)
    w, b = p["fc.weight"].clone().requires_grad_(), p["fc.bias"].clone().requires_grad_()
    idx, real = round_batches([len(y)], [6], seed, tr.round, B, epochs=1, stream=1)
    for s in range(idx.shape[0]):
        rows = idx[s, 0][real[s, 0] > 0]
        z = (x[rows] @ w.T + b)[:, 0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z, y[rows])
        gw, gb = torch.autograd.grad(loss, (w, b))
        w, b = (w - lr * gw).detach().requires_grad_(), (b - lr * gb).detach().requires_grad_()
    theta = theta_bar.float()[None, None].clone()
    tr.finetune_unseen(theta, tr.surrogate.init_personal(np.array([6]), theta[0]))
    got = tr.layout.unflatten(theta[0, 0])
    torch.testing.assert_close(got["fc.weight"].double(), w.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["fc.bias"].double(), b.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got["fc.bias"], p["fc.bias"].float())  # it did train
    xt, yt = torch.as_tensor(client.x_test).double(), torch.as_tensor(client.y_test)
    want = float((((xt @ w.T + b)[:, 0] > 0).long() == yt).double().mean())
    assert acc[0] == pytest.approx(want)


@pytest.mark.parametrize("name", ["pfedme", "apfl"])
def test_unseen_clients_fine_tune_their_personal_models(name, tmp_path):
    """pFedMe and APFL with ``eval.finetune_epochs``: two unseen clients of 20 and 111
    samples (their epochs end at different steps) fine-tune their personal state on the full
    rows, as local_steps does, and are scored through it (eval_state). This was an IndexError
    (the step's rows indexed into a copy already cut to them)."""
    cfg = make_cfg(tmp_path, "server", name, rounds=2, lr=0.1, personal_lr=0.02)
    cfg.eval.finetune_epochs = 1
    data = toy_dataset(8)
    data.unseen = [0, 7]
    tr = Trainer(cfg, dataset=data, log=lambda *a: None)
    for t in range(2):
        tr.local_work(t)
        tr.communicate(t)
    nll, acc, _ = tr.evaluate_unseen()
    tr.finetune_epochs = 0
    plain_nll, _, _ = tr.evaluate_unseen()
    assert np.isfinite(nll).all() and (0 <= acc).all() and (acc <= 1).all()
    assert (np.abs(nll - plain_nll) > 1e-4).all()  # both personal models were tuned and used


def test_fine_tuning_for_an_evaluation_keeps_the_rounds_losses_for_the_rule(tmp_path):
    """FedLi-LU's peers send the rule their last local step's loss. An evaluation that
    fine-tunes (``eval.finetune_epochs``) takes local steps of its own on copies: the losses
    kept for the rule stay the round's (they were overwritten by the fine-tuning's)."""
    cfg = make_cfg(tmp_path, "server", "fedli_lu", rounds=2, lr=0.1, momentum=0.0)
    cfg.eval.finetune_epochs = 1
    tr = Trainer(cfg, dataset=toy_dataset(8), log=lambda *a: None)
    tr.local_work(0)
    kept = tr.last_loss.clone()
    assert (kept > 0).all()
    tr.evaluate(tr.test)
    assert torch.equal(tr.last_loss, kept)


@pytest.mark.parametrize("name", ["pfedme", "apfl"])
@pytest.mark.parametrize("batching", ["auto", "vmap"])
def test_a_personal_step_takes_its_rows_as_a_slice_or_as_indices(name, batching, tmp_path):
    """pFedMe's and APFL's step on the personal rows of some peers: given as a slice (views,
    read and written in place: the trainer keeps them in the stack's order for a round) or
    as the same rows' indices (copies), the same gradient, loss and personal state, and the
    other peers' rows untouched."""
    cfg = make_cfg(tmp_path, "server", name, personal_lr=0.05)
    cfg.runtime.device, cfg.runtime.batching = "cpu", batching
    tr = Trainer(cfg, dataset=toy_dataset(8), log=lambda *a: None)
    gen = torch.Generator().manual_seed(0)
    for v in tr.personal.values():  # personal rows unlike the shared model's
        v.add_(torch.rand(v.shape, generator=gen) * (0.5 if v.ndim == 1 else 1.0)).clamp_(max=1)
    theta = tr.nodes[2:5] + 0.1 * torch.randn(tr.nodes[2:5].shape, generator=gen)
    x, y = tr.train.x[2:5, :16], tr.train.y[2:5, :16]
    sw = torch.rand(3, 1, 16, generator=gen)
    out = {}
    for rows in (slice(2, 5), torch.arange(2, 5)):
        personal = {k: v.clone() for k, v in tr.personal.items()}
        grad, loss = tr.surrogate.shared_grad(tr, theta, personal, rows, x, y, sw)
        out[isinstance(rows, slice)] = grad, loss, personal
    (g1, l1, p1), (g2, l2, p2) = out[True], out[False]
    assert torch.equal(g1, g2) and (l1 is l2 is None or torch.equal(l1, l2))
    for k, v in tr.personal.items():
        assert torch.equal(p1[k], p2[k]), k
        assert not torch.equal(p1[k][2:5], v[2:5]), k  # the step moved them
        assert torch.equal(p1[k][:2], v[:2]) and torch.equal(p1[k][5:], v[5:]), k


def test_components_beyond_the_memory_are_refused_with_the_arithmetic(tmp_path):
    """2**31 - 1 components of the toy model (the most a config takes): the error gives the
    product, at once (drawing them first spun for minutes)."""
    cfg = make_cfg(tmp_path, "ring", "dfedem", components=2**31 - 1)
    start = time.monotonic()
    with pytest.raises(GossipError, match=r"needs 8 nodes x algorithm.components 2147483647 x "
                       r"6 parameters x 4 bytes = 384.0 GiB, more than the"):  # fmt: skip
        Trainer(cfg, dataset=toy_dataset(8), log=lambda *a: None)
    assert time.monotonic() - start < 10


def test_cuda_numerics_switch_off_tf32_and_autotuning(monkeypatch):
    """What a CUDA run sets before its first product (the flags exist without a GPU): TF32 off
    and deterministic kernels by default; runtime.tf32 / deterministic: false undo each."""
    from gossip_pfl.runtime.comm import set_cuda_numerics

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.are_deterministic_algorithms_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    try:
        cfg = load_config(base={"algorithm": {"name": "fedavg"}}).runtime
        set_cuda_numerics(cfg.tf32, cfg.deterministic)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.utils.deterministic.fill_uninitialized_memory  # no NaN fill kernels
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        set_cuda_numerics(True, False)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.benchmark
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[:2]
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[2:4]
        torch.use_deterministic_algorithms(before[4])
        torch.utils.deterministic.fill_uninitialized_memory = before[5]
