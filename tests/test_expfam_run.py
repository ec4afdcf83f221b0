"""The EM workload (gossip_pfl.expfam.run) on the shared round loop: exact EM, the memory
invariant, the gossip form on the server schedule, 1 process == 2 Gloo ranks, resume, bad input
through the CLI."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from _helpers import check_ranks_refuse_other_checkpoints, run_ranks

from gossip_pfl import checkpoint
from gossip_pfl.cli import main
from gossip_pfl.config import load_config
from gossip_pfl.errors import GossipError
from gossip_pfl.expfam.data import gmm2d
from gossip_pfl.expfam.run import ExpFamRun, build_model
from gossip_pfl.runtime.comm import init_comm

torch.set_num_threads(1)


def _data():
    return gmm2d(n=6, m=30, seed=1, sizes="unequal")  # 6 workers of 9..51 samples


def _cfg(tmp, algorithm="fedem_em", rounds=6, schedule=None, **expfam):
    base = {
        "seed": 5,
        "rounds": rounds,
        "algorithm": {"name": algorithm},
        "eval": {"every": 3},
        "runtime": {"device": "cpu"},
        "out": str(tmp),
        "expfam": {"clients": 6, "samples": 30, "sizes": "unequal", "batch": 8, **expfam},
    }
    if schedule is not None:
        base["schedule"] = schedule
    return load_config(base=base)


def _run(cfg, resume=False, comm=None):
    run = ExpFamRun(cfg, dataset=_data(), comm=comm, log=lambda *a: None)
    summary = run.run(resume=resume)
    if comm is None:
        run.comm.close()
    return run, summary


def test_uncompressed_full_participation_full_batch_gamma_one_is_exact_em(tmp_path):
    cfg = _cfg(tmp_path, rounds=4, batch=0, gamma=1.0, alpha=0.5)
    run, summary = _run(cfg)
    data = _data()
    model, theta0 = build_model(cfg.expfam, data)
    mask = data.mask[..., None]
    w = torch.as_tensor(data.weights)

    def em_map(theta):  # sbar(theta) over all N samples, weighted by N_i / N
        s = (model.sbar(theta, data.x) * mask).sum(1) / mask.sum(1)
        return (w[:, None] * s).sum(0)

    S = em_map(theta0(cfg.seed))
    for _ in range(4):
        S = em_map(model.T(S))
    np.testing.assert_allclose(summary["statistics"], S.numpy(), rtol=0, atol=1e-10)


def test_the_hubs_rules_scale_the_participants_sum_by_one_over_p():
    """The star's inbox holds the participants' weighted mean and their share of the weight;
    Alg. 4 wants H = V + (1/p) sum_{i in A} w_i Quant(Delta_i) (weights summing to 1), and the
    naive baseline H = (1/p) sum_{i in A} w_i Quant(S_i - S)."""
    from gossip_pfl.algorithms.rules import Inbox
    from gossip_pfl.expfam.run import MemoryRule, NaiveRule

    g = torch.Generator().manual_seed(0)
    w = torch.tensor([0.1, 0.3, 0.2, 0.4], dtype=torch.float64)
    msgs = torch.randn(4, 5, generator=g, dtype=torch.float64)  # Quant(Delta_i), q = 5
    active = torch.tensor([True, False, True, False])
    received = (w[active, None] * msgs[active]).sum(0, keepdim=True)  # (1 row, q)
    inbox = Inbox({"q": received / w[active].sum()}, mass=float(w[active].sum()))
    S, V = torch.randn(2, 1, 5, generator=g, dtype=torch.float64)
    p, gamma, alpha = 0.5, 0.1, 0.3
    state, H, _ = MemoryRule(gamma, alpha, p, lambda s: (s, 0)).update(inbox, {"S": S, "V": V})
    torch.testing.assert_close(H, V + received / p, rtol=0, atol=1e-14)
    torch.testing.assert_close(state["S"], S + gamma * (V + received / p), rtol=0, atol=1e-14)
    torch.testing.assert_close(state["V"], V + alpha * received, rtol=0, atol=1e-14)
    state, H, _ = NaiveRule(gamma, p, lambda s: (s, 0)).update(inbox, {"S": S})
    torch.testing.assert_close(H, received / p, rtol=0, atol=1e-14)


@pytest.mark.parametrize("algorithm", ["fedem_em", "vr_fedem"])
def test_hub_memory_is_the_weighted_mean_of_the_workers(algorithm, tmp_path):
    """V_k = sum_i (N_i / N) V_{k,i}, also under Bernoulli participation and compression."""
    p = 0.5 if algorithm == "fedem_em" else 1.0
    vr = {"k_in": 3} if algorithm == "vr_fedem" else {}  # (FedEM refuses a key it does not read)
    run, _ = _run(_cfg(tmp_path, algorithm, rounds=7, p=p, compressor="dithering", **vr))
    w = torch.as_tensor(_data().weights)
    np.testing.assert_allclose(run.hub["V"][0], (w[:, None] * run.V_i).sum(0), atol=1e-13)


@pytest.mark.parametrize("algorithm", ["fedem_em", "vr_fedem"])
def test_gossip_on_the_server_schedule_equals_the_star(algorithm, tmp_path):
    opts = {"compressor": "block", "block": 3, "gamma": 0.2, "alpha": 0.3}
    opts.update({"p": 1.0, "k_in": 4} if algorithm == "vr_fedem" else {"p": 0.6})
    _, star = _run(_cfg(tmp_path / "star", algorithm, **opts))
    gossip_name = "gossip_" + algorithm
    _, gossip = _run(_cfg(tmp_path / "gossip", gossip_name, schedule={"graph": "server"}, **opts))
    np.testing.assert_allclose(gossip["statistics"], star["statistics"], rtol=0, atol=1e-10)
    for key in ("h_sq", "H_sq", "loglik"):
        assert gossip[key] == pytest.approx(star[key], rel=1e-8, abs=1e-12)
    assert gossip["bits_up"] > 0 and star["bits_up"] > 0


def test_gossip_ring_keeps_the_memory_invariant_on_average(tmp_path):
    """W_t is doubly stochastic: the peers' mean of their hub memories stays
    sum_i (N_i / N) V_i (the star's invariant), whatever the peers disagree on."""
    cfg = _cfg(tmp_path, "gossip_fedem_em", rounds=12, schedule={"graph": "ring",
               "weights": "metropolis"}, p=0.8, compressor="dithering")  # fmt: skip
    run, summary = _run(cfg)
    w = torch.as_tensor(_data().weights)
    np.testing.assert_allclose(run.hub["V"].mean(0), (w[:, None] * run.V_i).sum(0), atol=1e-12)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["consensus_distance"][0] > 0  # the peers' S differ on a ring
    assert np.isfinite(summary["statistics"]).all()


def _both_routes(tmp):
    """Both runs share one process group (a second one on the same port would not start)."""
    comm = init_comm("cpu", "auto", 60.0)
    out = {}
    for name, algorithm, schedule in [("star", "fedem_em", None),
                                      ("ring", "gossip_fedem_em", {"graph": "ring"})]:  # fmt: skip
        cfg = _cfg(f"{tmp}/{name}", algorithm, rounds=5, schedule=schedule, p=0.7,
                   compressor="dithering", levels=2)  # fmt: skip
        _, summary = _run(cfg, comm=comm)
        out[name] = (summary["statistics"], summary["h_sq"], summary["bits_up"])
    comm.close()
    return out


def test_one_process_and_two_gloo_ranks_give_the_same_statistics(tmp_path):
    single = _both_routes(tmp_path / "one")
    results = run_ranks(2, _both_routes, str(tmp_path / "two"), timeout=90)
    for status, value in results:
        assert status == "ok", value
        for name, (S, h_sq, bits) in single.items():
            np.testing.assert_allclose(value[name][0], S, rtol=0, atol=1e-10)
            assert value[name][1] == pytest.approx(h_sq, rel=1e-9)
            assert value[name][2] == bits


def _resume_own(dirs):
    """Rank r resumes from its own folder dirs[r] (a node's copy of the run folder)."""
    import os

    comm = init_comm("cpu", "auto", 30.0)
    try:
        _run(_cfg(dirs[int(os.environ["RANK"])], rounds=9), resume=True, comm=comm)
    finally:
        comm.close()


def test_ranks_that_read_different_checkpoints_stop_before_training(tmp_path):
    """EM's ranks at rounds 6 and 3 trained together (both timed out inside Gloo, rank 0's
    folder gained a row of the mix): they stop at once, naming the rounds, nothing written."""
    _run(_cfg(tmp_path / "a", rounds=6))
    _run(_cfg(tmp_path / "b", rounds=3))
    check_ranks_refuse_other_checkpoints(_resume_own, tmp_path / "a", tmp_path / "b",
                                         "rank 1 read a checkpoint of round 3, rank 0 one of "
                                         "round 6")  # fmt: skip


@pytest.mark.parametrize("algorithm", ["fedem_em", "vr_fedem"])
def test_resumed_run_ends_with_the_same_summary(algorithm, tmp_path):
    opts = {"compressor": "dithering", **({"p": 0.7} if algorithm == "fedem_em" else {"k_in": 4})}
    _, straight = _run(_cfg(tmp_path / "a", algorithm, rounds=9, **opts))
    _run(_cfg(tmp_path / "b", algorithm, rounds=6, **opts))
    if algorithm == "fedem_em":  # a checkpoint from before algorithm.loss_divisor, which EM
        state = checkpoint.load(tmp_path / "b")  # does not read: it resumes
        del state["config"]["algorithm"]["loss_divisor"]
        checkpoint.save(state, tmp_path / "b")
    _, resumed = _run(_cfg(tmp_path / "b", algorithm, rounds=9, **opts), resume=True)
    for key, value in straight.items():
        if key != "wall_seconds":
            assert resumed[key] == value, key
    rows_a = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    rows_b = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    strip = lambda r: {k: v for k, v in json.loads(r).items() if not k.startswith("seconds")}  # noqa: E731
    assert [strip(r) for r in rows_a] == [strip(r) for r in rows_b]


def _edit(state: dict, change: str) -> None:
    section, _, key = change.partition(".")
    if change == "rule_state.S nan":
        state["rule_state"]["S"][0, 0] = math.nan
    elif change == "counters lost":
        del state["counters"]["bits_up"]
    elif key:
        state[section][key] = state[section][key][:, :-1].clone()
    else:
        state[section] = state[section][:-1].clone()


@pytest.mark.parametrize(
    ("schedule", "change", "named"),
    [  # a valid digest over each: a traceback (exit 1), or a resume on to other numbers
        (None, "rule_state.V", "'rule_state.V' is a tensor of shape (1, "),
        (None, "workers.V_i", "'workers.V_i' is a tensor of shape (6, "),
        ({"graph": "ring"}, "H_sq", "'H_sq' is a tensor of shape (5,), this run's is a tensor "
                                    "of shape (6,)"),
        (None, "counters lost", "'counters' is a dict of ['bits_sent', 'expectations', "),
        (None, "rule_state.S nan", "'rule_state.S' holds NaN"),
    ],
)  # fmt: skip
def test_a_checkpoint_that_does_not_fit_is_named_before_the_resume(tmp_path, schedule, change,
                                                                    named):  # fmt: skip
    """Only the workers' statistics S were checked; a check of each tensor's shape and of
    the counters against what this run saves, before anything is restored."""
    algorithm = "fedem_em" if schedule is None else "gossip_fedem_em"
    _run(_cfg(tmp_path, algorithm, rounds=3, schedule=schedule))
    state = checkpoint.load(tmp_path)
    _edit(state, change)
    checkpoint.save(state, tmp_path)
    with pytest.raises(GossipError, match=re.escape(named)):
        _run(_cfg(tmp_path, algorithm, rounds=6, schedule=schedule), resume=True)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1  # untouched


def test_projection_is_counted_and_statistics_stay_finite(tmp_path):
    """A large step with coarse quantization pushes S out of T's domain: projected, never NaN."""
    cfg = _cfg(tmp_path, "naive_em", rounds=6, gamma=3.0, compressor="dithering", p=0.5)
    with pytest.warns(UserWarning, match=r"in \d+ updates and was projected back"):
        _, summary = _run(cfg)
    assert summary["projected"] > 0
    assert np.isfinite(summary["statistics"]).all() and np.isfinite(summary["loglik"])


def _config_file(tmp_path):
    path = tmp_path / "em.yaml"
    path.write_text("algorithm: {name: fedem_em}\nexpfam: {clients: 5, samples: 20}\n")
    return str(path)


def test_em_stays_on_the_cpu_where_a_gpu_is_visible(monkeypatch, tmp_path, capsys):
    """runtime.device auto picks the CPU for EM even where a GPU is visible (its statistics,
    tensors made on the CPU, met the data on the GPU there), through ``gossip-pfl run`` and
    a workload built alone: the run never asks for CUDA. Asked for it, a one-line error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: pytest.fail("asked for CUDA"))
    args = ["run", _config_file(tmp_path), "--out", str(tmp_path / "run"), "--quiet",
            "--set", "rounds=2", "--set", "runtime.device=auto"]  # fmt: skip
    assert main(args) == 0
    cfg = _cfg(tmp_path, rounds=2)
    cfg.runtime.device = "auto"
    run, summary = _run(cfg)
    assert run.device.type == "cpu" and run.x.device.type == "cpu"
    assert np.isfinite(summary["h_sq"])
    capsys.readouterr()
    for key, value in (("device", "cuda"), ("backend", "nccl"), ("device", "gpu")):
        args = ["run", _config_file(tmp_path), "--out", str(tmp_path / key / value),
                "--set", f"runtime.{key}={value}"]  # fmt: skip
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        want = "must be auto, cpu or cuda" if value == "gpu" else "EM runs on the CPU"
        assert len(err) == 1 and f"runtime.{key}" in err[0] and want in err[0], err


def test_cli_run_prints_em_results(tmp_path, capsys):
    args = ["run", _config_file(tmp_path), "--out", str(tmp_path / "run"), "--quiet",
            "--set", "rounds=3"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "results (fedem_em" in out and "h_sq" in out and "bits_up" in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in ("h_sq", "H_sq"):  # three significant digits, not .4f's 0.0000
        assert re.search(rf"^  {key} +{re.escape(format(summary[key], '.3g'))}$", out, re.M), out
    assert (tmp_path / "run" / "plots" / "expfam.png").is_file()


@pytest.mark.parametrize(
    "override, key",
    [
        ("expfam.p=0", "expfam.p"),
        ("expfam.p=1.5", "expfam.p"),
        ("expfam.levels=0", "expfam.levels"),
        ("expfam.components=0", "expfam.components"),
        ("expfam.rank=10", "expfam.rank"),
        ("expfam.missing=0.95", "expfam.missing"),  # d = 2: most rows have nothing observed
        ("expfam.missing=0", "expfam.missing"),  # reported a perfect imputation of nothing
        # an EM config switched to a model algorithm ran FedAvg on the default synthetic data
        ("algorithm.name=fedavg", "expfam.clients, expfam.samples"),
        # keys of the model workloads went unheeded
        ("data.n_clients=3", "data.n_clients=3 are for model workloads"),
        ("model.name=mlp", "model.name='mlp' are for model workloads"),
        # the advice named the model workload's gossip algorithms
        ("schedule.graph=ring", "gossip_fedem_em or gossip_vr_fedem; clients per round are set "
                                "by expfam.p"),
    ],
)  # fmt: skip
def test_bad_input_is_a_one_line_error_naming_the_key(override, key, tmp_path, capsys):
    args = ["run", _config_file(tmp_path), "--out", str(tmp_path / "run"), "--set",
            "expfam.clients=3", "--set", "expfam.samples=10", "--set", override]  # fmt: skip
    if "rank" in override or "missing" in override:
        args += ["--set", "expfam.data=lowrank", "--set", "expfam.model=imputation",
                 "--set", "expfam.dim=2", "--set", "expfam.rank=1"]  # fmt: skip
        args += ["--set", override]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0], err


@pytest.mark.parametrize(
    "overrides, message",
    [
        # the hunt's cases: a LinAlgError traceback (Cholesky of a covariance that is not
        # positive definite), and values past float range written to summary.json
        (["expfam.gamma=1e200"], "round 2: the statistics S map to a singular model"),
        # evaluated every round: the evaluation meets the singular model first
        (["expfam.gamma=1e200", "eval.every=1"], "round 1: the statistics S map to a singular"),
        (["expfam.gamma=1e200", "expfam.model=gmm_diag"], "round 1: the statistics S became"),
        (["expfam.clients=1", "expfam.samples=2"], "the model at start is singular on this "
                                                   "data (2 samples in all, dimension 2)"),
        # a feature observed nowhere: its mean was NaN, then a traceback (the memories' start
        # h_i(S_0) was outside the error's reach) or, with zero memories, advice on gamma
        *[(["expfam.data=lowrank", "expfam.model=imputation", "expfam.dim=4", "expfam.rank=1",
            "expfam.missing=0.5", "expfam.clients=1", "expfam.samples=3", "seed=1",
            f"expfam.init_memory={init}"], "feature 1 is missing in every sample")
          for init in ("h", "zero")],
        # a full pass (batch 0) was told to raise its batch
        (["expfam.gamma=1e200", "expfam.batch=0"], "singular model (a covariance that is not "
                                                   "positive definite): lower expfam.gamma "
                                                   "(now 1e+200)\n"),
    ],
)  # fmt: skip
def test_em_leaving_the_valid_set_stops_with_one_line(overrides, message, tmp_path, capsys):
    args = [
        "run",
        _config_file(tmp_path),
        "--out",
        str(tmp_path / "run"),
        "--quiet",
        "--set",
        "rounds=5",
        "--set",
        "expfam.clients=3",
        "--set",
        "expfam.samples=10",
    ]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 2
    err = capsys.readouterr().err.splitlines(keepends=True)  # (a message may end the line)
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("key", ["expfam.alpha=0.5", "expfam.init_memory=zero"])
def test_naive_em_refuses_the_memories_keys(key, tmp_path, capsys):
    """naive_em keeps no memories: their step and start were silently ignored (k_in, which
    only VR-FedEM reads, was refused)."""
    args = ["run", _config_file(tmp_path), "--out", str(tmp_path / "run"), "--set",
            "algorithm.name=naive_em", "--set", key]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"config key '{key.split('=')[0]}'" in err[0], err
    assert "every rule but naive_em" in err[0], err


def test_plot_of_an_em_run_draws_its_own_figure(tmp_path, capsys):
    """`gossip-pfl plot` on an EM run drew the model runs' six figures, all empty; it now
    draws EM's (h_sq, H_sq), and refuses to mix an EM run with others."""
    run = tmp_path / "run"
    assert main(["run", _config_file(tmp_path), "--out", str(run), "--quiet", "--no-plots",
                 "--set", "rounds=3"]) == 0  # fmt: skip
    out = tmp_path / "figs"
    assert main(["plot", str(run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["expfam.png"]
    # --labels titles it (it was ignored): the figure saved holds the label
    import matplotlib.figure

    titles, save = [], matplotlib.figure.Figure.savefig

    def saved(fig, *args, **kwargs):
        titles.append(fig.get_suptitle())
        return save(fig, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matplotlib.figure.Figure, "savefig", saved)
        assert main(["plot", str(run), "--out", str(out), "--labels", "gossip EM"]) == 0
    assert titles == ["gossip EM"]
    capsys.readouterr()
    assert main(["plot", str(run), str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is an EM run" in err[0], err


@pytest.mark.parametrize("init", ["h", "zero"])
def test_init_memory_sets_the_workers_first_memories(init, tmp_path):
    """expfam.init_memory against a hand E-step: V_{0,i} = h_i(S_0) = sbar_i(T(S_0)) - S_0 (h)
    or exactly 0 (zero), the hub's V their N_i/N-weighted mean, and the initial E-steps counted
    (2 N with h, N with zero). After one exact round (identity, p = 1, full batch) the closed
    form V_{1,i} = V_{0,i} + alpha (h_i(S_0) - V_{0,i}) tells the two apart (h_i for h,
    alpha h_i for zero), while S_1 = S_0 + gamma sum_i w_i h_i(S_0) either way."""
    gamma, alpha = 0.3, 0.25
    cfg = _cfg(tmp_path, rounds=1, batch=0, gamma=gamma, alpha=alpha, init_memory=init)
    data = _data()
    run = ExpFamRun(cfg, dataset=data, log=lambda *a: None)
    model, theta0 = build_model(cfg.expfam, data)
    mask = data.mask[..., None]
    w = torch.as_tensor(data.weights)[:, None]

    def sbar(theta):  # each worker's mean of sbar over its own samples
        return (model.sbar(theta, data.x) * mask).sum(1) / mask.sum(1)

    S0 = (w * sbar(theta0(cfg.seed))).sum(0)
    h = sbar(model.T(S0)) - S0
    assert h.abs().min() > 1e-6  # the two choices differ in every entry
    if init == "zero":
        V0 = torch.zeros_like(h)
        assert torch.count_nonzero(run.V_i) == 0 and torch.count_nonzero(run.hub["V"]) == 0
    else:
        V0 = h
    torch.testing.assert_close(run.V_i, V0, rtol=0, atol=1e-12)
    torch.testing.assert_close(run.hub["V"][0], (w * V0).sum(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(run.hub["S"][0], S0, rtol=0, atol=1e-12)
    N = int(data.counts.sum())
    assert run.init_expectations == (2 if init == "h" else 1) * N
    active = run.sample(0)
    assert active.all()
    run.local_work(0, active)
    run.communicate(0, active)
    run.comm.close()
    assert run.counters["projected"] == 0
    V1 = V0 + alpha * (h - V0)
    torch.testing.assert_close(run.V_i, V1, rtol=0, atol=1e-12)
    torch.testing.assert_close(run.hub["V"][0], (w * V1).sum(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(run.hub["S"][0], S0 + gamma * (w * h).sum(0), rtol=0, atol=1e-12)


def test_a_run_whose_statistics_were_projected_says_so(tmp_path, capsys):
    """Steps too large for the model: S leaves the M-step's domain and is projected back
    (a degenerate fit, exit 0); the count was in the summary alone, now a warning says so.
    A run that never projects prints none."""
    args = ["run", _config_file(tmp_path), "--quiet", "--no-plots", "--set", "rounds=6",
            "--set", "expfam.clients=10", "--set", "expfam.samples=30"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "b"), "--set", "expfam.gamma=100"]) == 0
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    err = capsys.readouterr().err.strip().splitlines()
    assert summary["projected"] > 0 and len(err) == 1, err
    assert f"in {summary['projected']} updates and was projected back" in err[0]


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [  # each a KeyError's or numpy's traceback (a hand-edited file)
        ("epochs", None, " has no number 'epochs'"),
        ("mixture_weights", None, "'s mixture_weights is None, not the numbers of row 1's"),
        ("mixture_weights", [0.5], "'s mixture_weights is [0.5], not the numbers of row 1's"),
        ("mixture_weights", ["a", "b"], "'s mixture_weights is ['a', 'b'], not the numbers"),
    ],
)
def test_plot_of_an_em_run_with_a_damaged_row_is_one_line(tmp_path, capsys, key, value, says):
    run = tmp_path / "run"
    assert main(["run", _config_file(tmp_path), "--out", str(run), "--quiet", "--no-plots",
                 "--set", "rounds=3", "--set", "eval.every=1"]) == 0  # fmt: skip
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows[0]["mixture_weights"]) == 2 and len(rows) == 3
    rows[-1].pop(key) if value is None else rows[-1].update({key: value})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"row {len(rows)}{says}" in err[0], err
