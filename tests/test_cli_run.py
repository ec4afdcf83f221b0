"""`gossip-pfl run` end to end: the embedded demo through the command line, its results table,
and a bad override."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gossip_pfl.cli import main


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
