"""On a GPU: the fast path equals the plain one, and a run on CUDA gives the CPU's numbers
(float tolerance). Marked ``cuda``: skipped without a GPU (tests/conftest.py)."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from _helpers import cnn_trainer
from test_speed import CASES, FUSED_CASES, rounds, trainer

pytestmark = pytest.mark.cuda

#: the fused linear round's forms on a GPU: plain SGD, its terms and momentum, FedLi-LU's kept
#: losses, pFedMe's and APFL's personal models (and the line search, the solver's steps)
CUDA_FUSED = ["dfedem (fused SGD update)", "fedli_ls (line search)", "dfedem, momentum and decay",
              "scaffold, momentum", "fedem, fedli_lu rule, momentum, decay", "pfedme, momentum",
              "apfl, decay"]  # fmt: skip


@pytest.mark.parametrize("case", CUDA_FUSED)
def test_fused_path_equals_plain_path_on_cuda(case, tmp_path):
    """The fused round on a GPU (its dense layout, a step of every peer, graphed) == the
    solver's steps, on peers of unequal sizes: parameters, momentum, personal state, kept
    losses."""
    sizes = [40, 85, 20, 59, 33, 59]
    fused = rounds(trainer(tmp_path, "auto", FUSED_CASES[case], device="cuda", sizes=sizes))
    plain = rounds(trainer(tmp_path, "vmap", FUSED_CASES[case], device="cuda", sizes=sizes))
    assert fused.device.type == "cuda"
    np.testing.assert_allclose(fused.shared_parameters(), plain.shared_parameters(),
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    torch.testing.assert_close(fused.opt_state.momentum, plain.opt_state.momentum,
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    for k, v in plain.personal.items():
        torch.testing.assert_close(fused.personal[k], v, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fused.last_loss, plain.last_loss, rtol=1e-4, atol=1e-6)


def test_cuda_run_equals_cpu_run(tmp_path):
    """The same config on both devices (TF32 off, deterministic kernels): the summaries
    agree to float tolerance."""
    case = CASES["dfedem (fused SGD update)"]
    on_gpu = trainer(tmp_path / "gpu", "auto", case, device="cuda")
    on_cpu = trainer(tmp_path / "cpu", "auto", case, device="cpu")
    gpu, cpu = on_gpu.run(), on_cpu.run()
    assert gpu["test_accuracy"] == pytest.approx(cpu["test_accuracy"], abs=1e-3)
    assert gpu["train_loss"] == pytest.approx(cpu["train_loss"], rel=1e-4)
    np.testing.assert_allclose(on_gpu.shared_parameters(), on_cpu.shared_parameters(),
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    assert torch.cuda.is_available()


def test_rows_added_on_cuda_give_the_cpu_bits(monkeypatch):
    """add_rows is a product then a sum per element, each correctly rounded: a GPU's chunks
    (a bounded temporary) give the CPU's bits."""
    from gossip_pfl.runtime import exchange

    monkeypatch.setattr(exchange, "ROWWISE_CHUNK_GPU", 3 * 100)  # 100 columns per step
    g = torch.Generator().manual_seed(0)
    base, w = torch.randn(3, 1001, generator=g), torch.rand(3, 4, generator=g)
    rows = torch.randn(4, 1001, generator=g)
    out = {}
    for dev in ("cpu", "cuda"):
        o = base.to(dev, copy=True)  # .to("cpu") of a CPU tensor is that tensor itself
        flat = rows.to(dev).reshape(-1)
        parts = list(flat[1001:].split(999))  # pieces across rows
        exchange.add_rows(o, w.to(dev), [(0, 1, [flat[:1001]]), (1, 3, parts)])
        out[dev] = o.cpu()
    assert torch.equal(out["cpu"], out["cuda"])


#: the graphed steps' cases: plain SGD, momentum and weight decay, pFedMe's, FedLi-LU's losses
CUDA_GRAPHED = ["dfedem (fused SGD update)", "dfedem, momentum and decay", "pfedme, momentum",
                "fedem, fedli_lu rule, momentum, decay"]  # fmt: skip


#: the CNN's graphed steps (the step size cut tenfold halfway) and its line search
CNN_GRAPHED = {"lr_decay": [0.5]}
CNN_LINE_SEARCH = {"name": "fedli_ls", "components": 1, "momentum": 0.0}


def graph_case(name: str) -> dict:
    """A graphed-steps case, with the mixtures' smoothed loss weights where it has them
    (pFedMe's single model has none, and the config refuses a key its algorithm does not read)."""
    case = dict(FUSED_CASES[name])
    if case["name"] != "pfedme":
        case["q_smoothing"] = 0.05
    return case


@pytest.mark.parametrize("case", CUDA_GRAPHED)
@pytest.mark.parametrize("participation, sizes", [(1.0, None), (0.5, [3, 5, 7, 9, 40, 6])])
def test_cuda_graph_steps_equal_eager_steps(case, participation, sizes, tmp_path):
    """runtime.cuda_graphs: the round's SGD steps (plain, with momentum and weight decay,
    pFedMe's, with FedLi-LU's kept losses) captured once per shape and replayed after, and the
    E-step, give the eager ones' parameters, mixture weights, momentum, personal models and
    kept losses; with half the peers a round (the E-step's graph the same: every peer's
    rows), the shapes and the batch width change between rounds, the narrow ones first (a
    graph per shape, each with its own gather buffer: a shared one grew and moved under the
    first)."""
    case = graph_case(case)
    runs = []
    for graphs in (True, False):
        tr = trainer(tmp_path / str(graphs), "auto", case, device="cuda", sizes=sizes,
                     cuda_graphs=graphs)  # fmt: skip
        tr.cfg.participation = participation
        tr.n_active = max(1, int(len(tr.peers) * participation))
        for t in (2, 0, 2, 0, 3, 4):  # half the peers: round 2's batches are narrower than 0's
            active = tr.sample(t)
            tr.local_work(t, active)
            tr.communicate(t, active)
        runs.append(tr)
    graphed, eager = runs
    assert "CUDA graph" in graphed.forward.describe() and eager.forward.graphs is None
    assert 1 <= len(graphed.forward.graphs.graphs) < 6  # captured, and replayed
    # the E-step's graph (the first round eager), one a stack, whoever takes part
    assert eager.e_step_graphs is None
    if "pi" in eager.personal and graphed.M > 1:
        assert graphed.e_step_graphs.failure is None
        assert 1 <= len(graphed.e_step_graphs.graphs) <= 2
    np.testing.assert_allclose(graphed.shared_parameters(), eager.shared_parameters(),
                               rtol=1e-6, atol=1e-7)  # fmt: skip
    torch.testing.assert_close(graphed.opt_state.momentum, eager.opt_state.momentum)
    for k, v in eager.personal.items():
        torch.testing.assert_close(graphed.personal[k], v)
    torch.testing.assert_close(graphed.last_loss, eager.last_loss)


def test_a_graph_whose_first_run_waits_for_the_device_is_not_captured():
    """GraphReplay: a function that reads a value back (``.item()``) cannot be a graph. Its
    first run, which does the call's work once, says so; no capture is begun, so the stream
    and the allocator stay out of capture mode, later calls run it as it is, and another
    GraphReplay captures and replays."""
    from gossip_pfl.runtime.graphs import GraphReplay

    x = torch.zeros(4, device="cuda")
    bad = GraphReplay()
    for _ in range(2):
        bad("k", lambda t: x.add_(t * t.sum().item()), torch.ones(4, device="cuda"))
        assert not torch.cuda.is_current_stream_capturing()
    assert bad.failure is not None and "waits for the device" in bad.failure
    assert x.tolist() == [8.0] * 4 and not bad.graphs  # 4 a call, once each
    y, good = torch.zeros(4, device="cuda"), GraphReplay()
    for v in (1.0, 2.0, 3.0):
        good("k", lambda t: y.add_(t), torch.full((4,), v, device="cuda"))
    assert good.failure is None and len(good.graphs) == 1
    assert y.tolist() == [6.0] * 4


def test_cnn_fedem_on_cuda_equals_cpu(tmp_path):
    """Two rounds of the CNN's FedEM on CUDA give the CPU's parameters and mixture weights
    to float tolerance (deterministic kernels, TF32 off)."""
    gpu, cpu = (rounds(cnn_trainer(tmp_path / d, d), 2) for d in ("cuda", "cpu"))
    assert gpu.forward.by_parameter and gpu.device.type == "cuda"
    np.testing.assert_allclose(gpu.shared_parameters(), cpu.shared_parameters(),
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    torch.testing.assert_close(gpu.personal["pi"].cpu(), cpu.personal["pi"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("precision", ["float32", "bf16"])
@pytest.mark.parametrize("participation", [1.0, 0.6])
def test_cnn_graphed_steps_equal_eager_steps(participation, precision, tmp_path):
    """runtime.cuda_graph_steps: the CNN's FedEM steps (momentum, weight decay, the step
    size cut tenfold after two of four rounds) as CUDA graphs, one per step shape, give the
    eager steps' parameters, momentum, step sizes and mixture weights (float rounding); with
    3 of 5 clients a round the steps' shapes change between rounds."""
    runs = []
    for graphs in (False, True):
        tr = cnn_trainer(tmp_path / str(graphs), "cuda", CNN_GRAPHED, precision=precision,
                         cuda_graph_steps=graphs)  # fmt: skip
        tr.cfg.rounds = 4
        if participation < 1:
            tr.cfg.participation, tr.n_active = participation, 3
        runs.append(rounds(tr, 4))
    eager, graphed = runs
    assert eager.step_graphs is None and len(graphed.step_graphs.graphs) >= 2
    # the same kernels, but cuBLAS may pick its algorithm by stream (the captures' own)
    close = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-6)
    close(graphed.nodes, eager.nodes)
    close(graphed.opt_state.momentum, eager.opt_state.momentum)
    close(graphed.opt_state.eta, eager.opt_state.eta)
    close(graphed.personal["pi"], eager.personal["pi"])


def test_cnn_line_search_as_graphs_takes_the_eager_round(tmp_path):
    """runtime.cuda_graph_steps with FedLi-LS's line search on the CNN (a graph of each step's
    start and end, one a further trial): after a round, the eager steps' parameters, step
    sizes and kept losses to float tolerance. One round: a graphed trial runs every peer of
    its step where the eager one runs those still searching, which may take other kernels,
    and a trial at its threshold could then go the other way in a later round."""
    runs = []
    for graphs in (False, True):
        tr = cnn_trainer(tmp_path / str(graphs), "cuda", CNN_LINE_SEARCH,
                         cuda_graph_steps=graphs)  # fmt: skip
        runs.append(rounds(tr, 1))
    eager, graphed = runs
    kinds = {key[0][1] for key in graphed.step_graphs.graphs}
    assert {"start", "end"} <= kinds and graphed.step_graphs.failure is None
    close = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-6)
    close(graphed.nodes, eager.nodes)
    close(graphed.opt_state.eta, eager.opt_state.eta)
    close(graphed.last_loss, eager.last_loss)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_queued_finite_check_on_cuda_names_the_first_bad_peer(bad, tmp_path):
    """The GPU's queued finite check: each peer's smallest and largest value copied to one
    page-locked buffer, read at the next check or before a log: finite parameters pass, and
    a bad peer is named by the settle that follows its round, not before."""
    from gossip_pfl.errors import GossipError

    tr = trainer(tmp_path, "auto", CASES["dfedem (fused SGD update)"], device="cuda")
    theta = tr.nodes[: len(tr.peers)].clone()
    tr._check_finite(0, theta)
    tr.settle()
    assert tr._finite_host.is_pinned() and tr._finite_host.shape == (2, len(tr.peers))
    theta[4, 1, -1], theta[2, 0, 0] = bad, bad
    tr._check_finite(1, theta)  # queued: read later
    with pytest.raises(GossipError, match=r"round 2: .*\(first: peer 2 on rank 0\)"):
        tr.settle()


def test_phase_clock_times_the_device_without_waiting_for_it():
    """The loop's phase times on a GPU come from events on its stream: a phase's queued work
    counts to that phase once the device has run it, and marking it does not wait for it."""
    import time

    from gossip_pfl.loop import PhaseClock

    device = torch.device("cuda")
    clock, times = PhaseClock(device), {"local": 0.0, "exchange": 0.0}
    torch.cuda._sleep(1)  # its kernel loaded before the host's clock starts
    torch.cuda.synchronize(device)
    host = time.perf_counter()
    start = clock.mark()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of device cycles in the "local work"
    local = clock.mark()
    clock.add(times, start, local, clock.mark())
    host = time.perf_counter() - host
    clock.settle(times)
    assert not clock.pending
    assert times["local"] > 0.02 and times["local"] > 5 * host  # the host did not wait
    assert 0 <= times["exchange"] < 0.01


def test_uploads_rewrite_a_buffer_only_after_its_copy_ran():
    """The fused round's uploads go through two page-locked buffers without waiting for the
    device: with the device far behind the host (a queued sleep), a buffer is still not
    rewritten before its last copy has run, so every upload arrives intact."""
    from gossip_pfl.runtime.data import Uploads

    up = Uploads(torch.device("cuda"))
    assert up.staged
    for _ in range(2):  # both buffers made first (an allocation might wait for the device)
        up("floats", np.zeros(1 << 20, np.float32))
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s: the copies below queue behind it
    arrays = [np.full(1 << 20, i, np.float32) for i in range(5)]
    got = [up("floats", a) for a in arrays]
    for tensor, a in zip(got, arrays):
        assert torch.equal(tensor.cpu(), torch.from_numpy(a))
    assert all(slot[0].is_pinned() for slot in up.slots["floats"])


@pytest.mark.parametrize("graph", ["cycle", "complete"], ids=["sparse blocks", "dense blocks"])
def test_a_phase_planned_every_round_goes_to_the_device_without_waiting(graph):
    """Partial participation plans a gossip phase every round: a rank's mixing blocks (a ring
    of 100 peers on 2 ranks: sparse CSR blocks and the rows it sends, 0 and 49; a complete
    graph: dense blocks) reach the device through page-locked memory, so planning does not
    wait for the device's queue (PyTorch's synchronisation check errs on the waits it
    watches: the pageable copies they were), and they hold the CPU plan's weights and rows."""
    import networkx as nx

    from gossip_pfl.runtime.exchange import plan_phase
    from gossip_pfl.runtime.placement import Placement
    from topologies import Phase

    w = nx.to_numpy_array(getattr(nx, f"{graph}_graph")(100))
    w = (w + np.eye(100)) / (w.sum(1, keepdims=True) + 1)  # each row's neighbours, evenly
    phase, placement = Phase.from_dense(w), Placement(100, 2, rank=0)
    cpu = plan_phase(phase, placement, torch.device("cpu"))
    assert cpu.own.is_sparse_csr is (graph == "cycle")
    assert isinstance(cpu.sends[1], torch.Tensor) is (graph == "cycle")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of queued work the planning must not wait for
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = plan_phase(phase, placement, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for mine, want in ((gpu.own, cpu.own), (gpu.received, cpu.received)):
        assert mine.is_cuda and mine.is_sparse_csr is want.is_sparse_csr
        dense = (lambda b: b.to_dense()) if want.is_sparse_csr else (lambda b: b)
        assert torch.equal(dense(mine).cpu(), dense(want))
    sent, want = gpu.sends[1], cpu.sends[1]
    if isinstance(want, slice):
        assert sent == want
    else:
        assert sent.is_cuda and torch.equal(sent.cpu(), want)
