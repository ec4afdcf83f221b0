"""``gossip-pfl plot``: PNGs from fake run directories, the curves equal the metrics, and
one-line errors with exit code 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from gossip_pfl import plots
from gossip_pfl.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(t: int, algo_shift: float, bytes_per_round: int, consensus: float, unseen: bool):
    acc = 0.5 + algo_shift + 0.01 * t
    row = {
        "round": t,
        "train_loss": 1.0 / t + algo_shift,
        "train_accuracy": acc + 0.02,
        "test_loss": 1.1 / t,
        "test_accuracy": acc,
        "test_accuracy_weighted": acc,
        "test_accuracy_p10": acc - 0.1,
        "consensus_distance": [consensus / t, 2 * consensus / t],
        "model_bytes": bytes_per_round * t,
        "bytes_sent": 0,
        "messages_sent": 0,
        "bytes_sent_per_rank": [0],
        "messages_sent_per_rank": [0],
        "seconds_local": 0.1 * t,
        "seconds_exchange": 0.01 * t,
        "client_test_accuracy": [acc - 0.05, acc, acc + 0.05],
    }
    if unseen:
        row["unseen_test_accuracy"] = acc - 0.03
        row["unseen_test_accuracy_p10"] = acc - 0.13
    return row


def write_run(
    root: Path,
    name: str,
    algo: str,
    *,
    shift: float = 0.0,
    bytes_per_round: int = 4000,
    consensus: float = 0.5,
    unseen: bool = False,
    summary: bool = True,
) -> Path:
    run = root / name
    run.mkdir(parents=True)
    rows = [_row(t, shift, bytes_per_round, consensus, unseen) for t in (2, 4, 6)]
    (run / "config.yaml").write_text(f"seed: 0\nrounds: 6\nalgorithm:\n  name: {algo}\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary:
        last = rows[-1]
        doc = {
            "algorithm": algo,
            "rounds": 6,
            "test_accuracy": last["test_accuracy"],
            "test_accuracy_p10": last["test_accuracy_p10"],
            "client_test_accuracy": [0.4, 0.6, 0.7, 0.9],
            "world_size": 1,
        }
        (run / "summary.json").write_text(json.dumps(doc))
    return run


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    a = write_run(tmp_path / "runs", "dfedem", "dfedem", unseen=True)
    b = write_run(tmp_path / "runs", "local", "local", shift=-0.1, bytes_per_round=0, consensus=0)
    return a, b


def _assert_png(path: Path) -> None:
    import matplotlib.image as mpimg

    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_MAGIC
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 0 and img.shape[1] > 0


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("gossip-pfl: error: ")
    return err


def test_plot_two_runs_writes_valid_pngs(two_runs, tmp_path, capsys):
    out = tmp_path / "figs"
    assert main(["plot", *map(str, two_runs), "--out", str(out), "--labels", "A,B"]) == 0
    stdout = capsys.readouterr().out
    for name in plots.PLOT_NAMES:
        _assert_png(out / f"{name}.png")
        assert str(out / f"{name}.png") in stdout


def test_plot_one_run_defaults_to_run_dir(two_runs, capsys):
    run = two_runs[0]
    assert main(["plot", str(run)]) == 0
    for name in plots.PLOT_NAMES:
        _assert_png(run / "plots" / f"{name}.png")


def test_plot_several_runs_default_out(two_runs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plot", *map(str, two_runs)]) == 0
    for name in plots.PLOT_NAMES:
        _assert_png(tmp_path / "runs" / "plots" / f"{name}.png")


def _line(fig, gid: str):
    found = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_gid() == gid]
    assert len(found) == 1, gid
    return found[0]


def test_curves_equal_metrics(two_runs):
    runs = [plots.load_run(p) for p in two_runs]
    rows = [
        [json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines()] for p in two_runs
    ]

    fig = plots.plot_accuracy(runs)
    for i, rs in enumerate(rows):
        for key in ("test_accuracy", "test_accuracy_p10"):
            line = _line(fig, f"{i}:{key}")
            np.testing.assert_array_equal(line.get_xdata(), [r["round"] for r in rs])
            np.testing.assert_array_equal(line.get_ydata(), [r[key] for r in rs])
            assert line.get_linestyle() == ("-" if key == "test_accuracy" else "--")
    unseen = _line(fig, "0:unseen_test_accuracy")
    np.testing.assert_array_equal(unseen.get_ydata(), [r["unseen_test_accuracy"] for r in rows[0]])
    assert unseen.get_linestyle() == ":"
    assert not [ln for ln in fig.axes[0].get_lines() if ln.get_gid() == "1:unseen_test_accuracy"]
    # one colour per run, shared by its curves
    assert (
        _line(fig, "0:test_accuracy").get_color() == _line(fig, "0:test_accuracy_p10").get_color()
    )
    assert _line(fig, "0:test_accuracy").get_color() != _line(fig, "1:test_accuracy").get_color()
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "bottom 10% of clients" in legend and "unseen clients (mean)" in legend

    loss = _line(plots.plot_loss(runs), "1:train_loss")
    np.testing.assert_array_equal(loss.get_ydata(), [r["train_loss"] for r in rows[1]])

    cons = plots.plot_consensus(runs)
    assert cons.axes[0].get_yscale() == "log"
    y = _line(cons, "0:consensus_distance").get_ydata()
    np.testing.assert_allclose(y, [max(r["consensus_distance"]) for r in rows[0]])
    assert np.isnan(_line(cons, "1:consensus_distance").get_ydata()).all()  # all zero
    assert any("distance 0" in t.get_text() for t in cons.axes[0].get_legend().get_texts())

    by_bytes = plots.plot_accuracy_vs_bytes(runs)
    assert by_bytes.axes[0].get_xscale() == "log"
    line = _line(by_bytes, "0:test_accuracy")
    np.testing.assert_array_equal(line.get_xdata(), [r["model_bytes"] for r in rows[0]])
    np.testing.assert_array_equal(line.get_ydata(), [r["test_accuracy"] for r in rows[0]])
    flat = _line(by_bytes, "1:test_accuracy")  # Local: 0 bytes -> its final accuracy
    assert set(flat.get_ydata()) == {rows[1][-1]["test_accuracy"]}


def test_mixture_weights_plot_only_for_mixtures(two_runs, tmp_path, capsys):
    """The mixture-weight curves equal the metrics, one per component and run; the PNG is
    written only when some run has mixture weights."""
    out = tmp_path / "no_mixture"
    assert main(["plot", *map(str, two_runs), "--out", str(out)]) == 0
    assert not (out / "mixture_weights_vs_round.png").exists()

    fedem = write_run(tmp_path / "runs", "fedem", "fedem")
    lines = (fedem / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    for t, row in enumerate(rows):  # component 1 dies out
        row["mixture_weights"] = [0.4 + 0.1 * t, 0.3 - 0.1 * t, 0.3]
    (fedem / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = [plots.load_run(p) for p in (fedem, two_runs[1])]
    fig = plots.plot_mixture_weights(runs)
    for m in range(3):
        line = _line(fig, f"0:mixture_weights:{m}")
        np.testing.assert_array_equal(line.get_xdata(), [r["round"] for r in rows])
        np.testing.assert_allclose(line.get_ydata(), [r["mixture_weights"][m] for r in rows])
    assert not [ln for ln in fig.axes[0].get_lines() if ln.get_gid().startswith("1:")]
    out = tmp_path / "mixture"
    assert main(["plot", str(fedem), str(two_runs[1]), "--out", str(out)]) == 0
    _assert_png(out / "mixture_weights_vs_round.png")
    assert str(out / "mixture_weights_vs_round.png") in capsys.readouterr().out
    # the same folder for runs without mixtures: the older figure went, not kept beside them
    assert main(["plot", *map(str, two_runs), "--out", str(out)]) == 0
    assert not (out / "mixture_weights_vs_round.png").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.png" for n in plots.PLOTS)


def test_default_labels_and_histogram_source(two_runs, tmp_path):
    runs = [plots.load_run(p) for p in two_runs]
    assert plots.default_labels(runs) == ["dfedem", "local"]
    other = write_run(tmp_path / "x", "seed1", "fedavg", summary=False)
    twin = write_run(tmp_path / "y", "seed1", "fedavg", summary=False)
    labels = plots.default_labels([plots.load_run(other), plots.load_run(twin)])
    assert labels == ["fedavg (x/seed1)", "fedavg (y/seed1)"]  # from config.yaml, made unique
    # summary.json wins; without it, the last metrics row
    np.testing.assert_array_equal(runs[0].final_client_accuracy(), [0.4, 0.6, 0.7, 0.9])
    last = json.loads((other / "metrics.jsonl").read_text().splitlines()[-1])
    np.testing.assert_array_equal(
        plots.load_run(other).final_client_accuracy(), last["client_test_accuracy"]
    )


def test_repeated_rounds_keep_latest_rows(tmp_path):
    run = write_run(tmp_path, "r", "fedavg")
    rows = (run / "metrics.jsonl").read_text()
    again = json.dumps(_row(2, 0.3, 10, 0.1, False)) + "\n"  # the run started again
    (run / "metrics.jsonl").write_text(rows + again)
    loaded = plots.load_run(run)
    assert [r["round"] for r in loaded.rows] == [2]
    assert loaded.rows[0]["test_accuracy"] == pytest.approx(0.82)
    resumed = "".join(json.dumps(_row(t, 0.3, 10, 0.1, False)) + "\n" for t in (4, 6, 8))
    (run / "metrics.jsonl").write_text(rows + resumed)  # resumed from round 3's checkpoint
    loaded = plots.load_run(run)
    assert [r["round"] for r in loaded.rows] == [2, 4, 6, 8]
    assert loaded.rows[0]["test_accuracy"] == pytest.approx(0.52)
    assert loaded.rows[1]["test_accuracy"] == pytest.approx(0.84)


def test_old_runs_without_optional_keys(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    rows = [{"round": t, "test_accuracy": 0.1 * t, "train_loss": 1.0} for t in (1, 2)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    paths = plots.write_plots([plots.load_run(run)], tmp_path / "out")
    fig = plots.plot_accuracy_vs_bytes([plots.load_run(run)])
    assert "no run recorded model_bytes" in fig.axes[0].texts[0].get_text()
    fig = plots.plot_accuracy_vs_bytes([plots.load_run(run)] * 2)
    assert fig.axes[0].texts[0].get_text().startswith("no run recorded model_bytes")
    assert fig.axes[0].get_legend() is None
    new = write_run(tmp_path, "new", "dfedem")
    fig = plots.plot_accuracy_vs_bytes([plots.load_run(new), plots.load_run(run)])
    texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert texts == ["dfedem (new)", "old (no model_bytes, not drawn)"]
    for path in paths:
        _assert_png(path)


def test_error_missing_run_dir(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["plot", str(missing)]) == 2
    err = _one_error_line(capsys)
    assert str(missing) in err and "does not exist" in err


def test_error_no_metrics(tmp_path, capsys):
    run = tmp_path / "fresh"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    assert main(["plot", str(run)]) == 2
    err = _one_error_line(capsys)
    assert "no metrics.jsonl" in err and str(run) in err and "not evaluated yet" in err


def test_error_empty_metrics(tmp_path, capsys):
    run = tmp_path / "fresh"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    assert main(["plot", str(run)]) == 2
    assert "not evaluated yet" in _one_error_line(capsys)


@pytest.mark.parametrize(
    ("bad", "why"),
    [("{not json\n", "line 2: not valid JSON"), ("[1, 2]\n", "line 2: expected a JSON object"),
     ('{"x": 1}\n', "row 2: missing or non-integer 'round'")],
)  # fmt: skip
def test_error_malformed_metrics_line(tmp_path, capsys, bad, why):
    run = write_run(tmp_path, "r", "fedavg")
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text(lines[0] + bad + "".join(lines[1:]))
    assert main(["plot", str(run), "--out", str(tmp_path / "o")]) == 2
    err = _one_error_line(capsys)
    assert f"{metrics}, {why}" in err
    assert not (tmp_path / "o").exists()


def test_a_row_being_written_is_left_out(tmp_path, capsys):
    """A run still going (or killed mid-write) can end in a cut-short row: the plot is made
    of the rows before it (that line used to stop the plot as not valid JSON)."""
    run = write_run(tmp_path, "r", "fedavg")
    metrics = run / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + whole.splitlines()[-1][:25])
    assert main(["plot", str(run), "--out", str(tmp_path / "o")]) == 0
    assert [r["round"] for r in plots.load_run(run).rows] == [
        json.loads(x)["round"] for x in whole.splitlines()
    ]


def test_error_malformed_summary(tmp_path, capsys):
    run = write_run(tmp_path, "r", "fedavg")
    (run / "summary.json").write_text('{\n  "algorithm": \n')
    assert main(["plot", str(run)]) == 2
    err = _one_error_line(capsys)
    assert str(run / "summary.json") in err and "line" in err


def test_error_labels_count(two_runs, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["plot", *map(str, two_runs), "--labels", "only-one", "--out", str(out)]) == 2
    err = _one_error_line(capsys)
    assert "--labels has 1 label(s) but 2 RUN_DIR(s)" in err
    assert not out.exists()


def test_a_run_without_consensus_distances_says_not_recorded(tmp_path):
    """A merged p2p run has no consensus distance in its rows: the legend said "distance 0"."""
    run = write_run(tmp_path, "p2p", "dfedem")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        del r["consensus_distance"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    zero = write_run(tmp_path, "local", "local", consensus=0.0)
    cons = plots.plot_consensus([plots.load_run(run), plots.load_run(zero)])
    texts = [t.get_text() for t in cons.axes[0].get_legend().get_texts()]
    assert any(t.endswith("(not recorded)") for t in texts), texts
    assert any(t.endswith("(distance 0, not drawn)") for t in texts), texts


@pytest.mark.parametrize(
    "file, text",
    [
        ("metrics.jsonl", '{"round": 2, "consensus_distance": "x"}\n'),
        ("metrics.jsonl", '{"round": 2, "client_test_accuracy": {"a": 1}}\n'),
        ("summary.json", '{"client_test_accuracy": "abc"}'),
        # each drawn as a number, or on a category axis, with exit 0
        ("metrics.jsonl", '{"round": 2, "mixture_weights": ["a", "b"]}\n'),
        ("metrics.jsonl", '{"round": 2, "mixture_weights": [true, 0.5]}\n'),
        ("metrics.jsonl", '{"round": 2, "mixture_weights": {"a": 1}}\n'),
        ("summary.json", '{"client_test_accuracy": ["0.5", 0.7]}'),
    ],
)
def test_a_value_of_the_wrong_type_is_one_line(file, text, tmp_path, capsys):
    """Each was a ValueError or TypeError traceback from a figure, or drawn as if a number."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"round": 2}\n')
    (run / file).write_text(text)
    assert main(["plot", str(run), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"not a (number|list of numbers)", err[0]), err
    assert str(run / file) in err[0] or "is not a number or list of numbers" in err[0], err


def test_a_peer_that_did_not_report_is_a_gap_in_the_histogram(tmp_path):
    """A merged peer-to-peer row names null for a peer that did not report: NaN, as before."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"round": 2, "client_test_accuracy": [0.5, null]}\n')
    acc = plots.load_run(run).final_client_accuracy()
    assert acc[0] == 0.5 and np.isnan(acc[1])


def test_a_run_of_one_evaluated_row_draws_a_visible_point(tmp_path):
    """One evaluated round (eval.every >= rounds) drew each curve as a line of one point,
    nothing visible, over ticks 0.945..1.05: a marker now, and the round's neighbours."""
    run = write_run(tmp_path, "one", "dfedem", unseen=True)
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text(rows[0] + "\n")
    one = [plots.load_run(run)]
    for fig, gid in [(plots.plot_accuracy(one), "0:test_accuracy"),
                     (plots.plot_accuracy(one), "0:unseen_test_accuracy"),
                     (plots.plot_loss(one), "0:train_loss"),
                     (plots.plot_consensus(one), "0:consensus_distance")]:  # fmt: skip
        line = _line(fig, gid)
        assert line.get_marker() == "o" and len(line.get_xdata()) == 1, gid
        assert fig.axes[0].get_xlim() == (1.0, 3.0), gid  # round 2, one either side
    several = plots.plot_loss([plots.load_run(write_run(tmp_path, "three", "dfedem"))])
    assert _line(several, "0:train_loss").get_marker() in ("None", "", None)


def test_runs_without_consensus_distances_are_not_said_to_be_at_zero(tmp_path):
    """Merged peer-to-peer runs record no consensus distance by round: the figure said
    "every run has consensus distance 0"."""
    run = write_run(tmp_path, "p2p", "dfedem")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        del r["consensus_distance"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = [t.get_text() for t in plots.plot_consensus([plots.load_run(run)]).axes[0].texts]
    assert texts == ["no run recorded its consensus distance by round"]
    zero = write_run(tmp_path, "local", "local", consensus=0.0)
    texts = [t.get_text() for t in plots.plot_consensus([plots.load_run(zero)]).axes[0].texts]
    assert texts == ["every run has consensus distance 0"]
