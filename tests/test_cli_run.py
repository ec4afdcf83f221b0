"""`gossip-pfl run` end to end: the embedded demo through the command line, its results table,
and a bad override."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from gossip_pfl.cli import main
from gossip_pfl.loop import RoundLoop


def test_demo_run_prints_results_table(tmp_path, capsys):
    assert main(["run", "--set", "rounds=4", "--out", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "results (dfedem" in out
    assert summary["torch_threads"] == torch.get_num_threads()
    table = dict(line.split(None, 1) for line in out.splitlines() if line.startswith("  "))
    assert float(table["test_accuracy"]) == round(summary["test_accuracy"], 4)
    weights = [float(w) for w in table["mixture_weights"].split()]
    assert len(weights) == 3 and abs(sum(weights) - 1) < 2e-3
    assert weights == [round(w, 3) for w in summary["mixture_weights"]]
    assert f"plots: {tmp_path / 'plots'}/" in out
    assert (tmp_path / "plots" / "accuracy_vs_round.png").is_file()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) >= 1


def test_no_plots_writes_the_run_without_figures(tmp_path, capsys):
    assert main(["run", "--set", "rounds=2", "--out", str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "results (dfedem" in out and "plots:" not in out
    assert (tmp_path / "summary.json").is_file() and not (tmp_path / "plots").exists()


def test_unknown_override_is_one_line_error(tmp_path, capsys):
    assert main(["run", "--set", "algorithm.lrr=0.1", "--out", str(tmp_path)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "algorithm.lrr" in err[0] and "lr" in err[0]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_warning_is_one_line(tmp_path, capsys, monkeypatch):
    """A warning during a run (here: a synthetic cache that cannot be written) is one
    'gossip-pfl: warning:' line, and the run goes on."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("GOSSIP_PFL_CACHE", str(tmp_path / "file"))
    config = str(Path(__file__).parent.parent / "configs" / "synthetic" / "local.yaml")
    args = ["run", config, "--set", "rounds=1", "--set", "data.n_clients=4", "--set",
            "data.n_test=5", "--out", str(tmp_path / "run"), "--no-plots", "--quiet"]  # fmt: skip
    assert main(args) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(err) == 1 and err[0].startswith("gossip-pfl: warning: synthetic: cannot write")


def test_checks_help_topology_and_plot_errors_do_not_load_torch(tmp_path):
    """Importing torch takes seconds: a bad config, a taken run folder, --help, the topology
    commands and a plot of a missing run answer without it."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "summary.json").write_text("{}")
    script = f"""
import contextlib, io, sys
from gossip_pfl.cli import main
runs = [
    (["run", "configs/synthetic/dfedem.yaml", "--set", "rounds=-1"], 2),
    (["run", "configs/synthetic/dfedem.yaml", "--out", {str(taken)!r}], 2),
    (["topology", "describe", "configs/topologies/lesmis.yaml"], 0),
    (["plot", {str(tmp_path / "missing")!r}], 2),
    (["--help"], 0),
]
for argv, want in runs:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code
    assert code == want, (argv, code)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


class _Averaging(RoundLoop):
    """A workload of ten numbers: each round half of them (seeded) are sampled and the hub
    moves its estimate half way to their mean. It sets nothing of ``times``."""

    summary_keys = ("estimate", "rounds")

    def __init__(self, cfg, dataset=None, comm=None, log=print):
        self.cfg, self.comm, self.log, self.device = cfg, comm, log, torch.device("cpu")
        self.values, self.estimate = np.arange(10.0), 0.0

    def sample(self, t):
        return np.random.default_rng([self.cfg.seed, t]).random(10) < 0.5

    def local_work(self, t, active=None):
        self.sent = self.values[active] if active.any() else self.values

    def communicate(self, t, active=None):
        self.estimate = 0.5 * self.estimate + 0.5 * float(self.sent.mean())

    def metrics_row(self, t):
        return {"round": t + 1, "estimate": self.estimate}

    def checkpoint(self, out, rounds_done, rows):
        state = {"rounds_done": rounds_done, "estimate": self.estimate, "rows": rows}
        torch.save(state, Path(out) / "averaging.pt")

    def restore(self, out):
        state = torch.load(Path(out) / "averaging.pt")
        self.estimate = state["estimate"]
        return state["rounds_done"], state["rows"]

    def summary(self, last, wall):
        return {"estimate": self.estimate, "rounds": self.cfg.rounds, "wall_seconds": wall}

    def describe(self):
        return "averaging: a hub moves half way to the sampled numbers' mean"


def test_a_workload_registered_as_a_class_runs_and_resumes(tmp_path, capsys, monkeypatch):
    """algorithms.md's 'Another kind of algorithm', as written: the class itself in WORKLOADS
    (a "module:Class" string was required), no ``times`` and no train_loss in its rows. The
    estimate after 4 rounds, also resumed after 2, is the recurrence written out."""
    from gossip_pfl import algorithms, train

    monkeypatch.setitem(algorithms.ALGORITHMS, "averaging",
                        algorithms.AlgorithmSpec(True, "server", workload="averaging"))  # fmt: skip
    monkeypatch.setitem(train.WORKLOADS, "averaging", _Averaging)
    want = 0.0
    for t in range(4):
        mask = np.random.default_rng([7, t]).random(10) < 0.5
        want = 0.5 * want + 0.5 * (np.arange(10.0)[mask].mean() if mask.any() else 4.5)
    base = ["--set", "algorithm.name=averaging", "--set", "seed=7", "--set", "eval.every=1"]
    out = tmp_path / "run"
    assert main(["run", *base, "--set", "rounds=2", "--out", str(out), "--quiet"]) == 0
    assert main(["run", "--resume", str(out), "--set", "rounds=4", "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["estimate"] == want
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert f"estimate {round(want, 4)}" in " ".join(capsys.readouterr().out.split())
