"""Figures that compare finished runs (``gossip-pfl plot``).

Pure functions: :func:`load_run` reads a run directory into a :class:`Run`, each ``plot_*``
function returns a :class:`matplotlib.figure.Figure` (drawn on an Agg canvas, no pyplot, so
no global backend switch), and :func:`write_plots` saves all of them as PNGs. Matplotlib is
imported only when a figure is made.

Every line a ``plot_*`` function draws from data carries a gid ``"<run index>:<series>"``
(e.g. ``"0:test_accuracy"``), so callers and tests can find the curve of a run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gossip_pfl.errors import GossipError, one_line
from gossip_pfl.rundir import FIGURES, is_number, read_rows, replace_all

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 120
FIGSIZE = (7.5, 4.6)
MAX_INSIDE_LEGEND = 4  # more runs: the legend goes right of the axes

#: the PNG file stems, in the order they are written (see PLOTS for the functions)
PLOT_NAMES = FIGURES[:5]


@dataclass
class Run:
    """One run directory: its evaluated rows (``metrics.jsonl``, rounds increasing), its
    ``summary.json`` (``{}`` when absent) and its resolved ``config.yaml`` (``{}`` when absent)."""

    path: Path
    rows: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    @property
    def algorithm(self) -> str:
        algo = self.summary.get("algorithm")
        if not algo:
            algo = (self.config.get("algorithm") or {}).get("name")
        return str(algo) if algo else ""

    def series(self, key: str) -> np.ndarray:
        """``rows[i][key]`` as floats; NaN where a row lacks the key or holds null. Any other
        value that is not a number is named (a string was plotted as a gap, unsaid)."""
        values = []
        for r in self.rows:
            v = r.get(key)
            if v is not None and not is_number(v):
                raise GossipError(f"{self.path / 'metrics.jsonl'}, round {r['round']}: {key} "
                                  f"is {v!r}, not a number")  # fmt: skip
            values.append(math.nan if v is None else float(v))
        return np.array(values, dtype=float)

    def numbers(self, where: str, key: str, value) -> np.ndarray:
        """A list of numbers from ``where`` (a file, a round) as floats, null as NaN (a peer
        that did not report): a string or a boolean in it is named, not read as a number
        ("0.5" was 0.5, true 1, "a" a category axis)."""
        if not (isinstance(value, list) and all(x is None or is_number(x) for x in value)):
            raise GossipError(f"{where}: {key} is {value!r:.80}, not a list of numbers")
        return np.array([math.nan if x is None else x for x in value], dtype=float)

    @property
    def rounds(self) -> np.ndarray:
        return np.array([r["round"] for r in self.rows], dtype=float)

    def final_client_accuracy(self) -> np.ndarray | None:
        """Per-client test accuracy at the end: summary.json, else the last metrics row."""
        acc, where = self.summary.get("client_test_accuracy"), str(self.path / "summary.json")
        if acc is None:
            last = self.rows[-1]
            acc = last.get("client_test_accuracy")
            where = f"{self.path / 'metrics.jsonl'}, round {last['round']}"
        return None if acc is None else self.numbers(where, "client_test_accuracy", acc)


# --------------------------------------------------------------------------- loading


def load_run(path: str | Path) -> Run:
    """Read a run directory; every problem becomes a one-line :class:`GossipError`."""
    path = Path(path)
    if not path.exists():
        raise GossipError(f"run directory {path} does not exist")
    if not path.is_dir():
        raise GossipError(f"{path} is not a directory (expected a run directory)")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise GossipError(
            f"no metrics.jsonl in {path}: not a run directory, or the run has not evaluated "
            "yet (rows are written every eval.every rounds)"
        )
    rows = _read_metrics(metrics)
    summary = _read_json(path / "summary.json")
    config = _read_config(path / "config.yaml")
    return Run(path=path, rows=rows, summary=summary, config=config)


def _read_metrics(file: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for k, row in enumerate(read_rows(file), start=1):
        rnd = row.get("round")
        if isinstance(rnd, bool) or not isinstance(rnd, int):
            raise GossipError(f"{file}, row {k}: missing or non-integer 'round'")
        # rows are appended: a run resumed from a checkpoint (or started again) in the same
        # folder repeats rounds; the later rows replace the earlier ones from that round on
        while rows and rows[-1]["round"] >= rnd:
            rows.pop()
        rows.append(row)
    if not rows:
        raise GossipError(
            f"{file} is empty: the run has not evaluated yet (rows are written every "
            "eval.every rounds)"
        )
    return rows


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        doc = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise GossipError(f"cannot read {file}: {one_line(err)}") from None
    except json.JSONDecodeError as err:
        raise GossipError(f"{file}, line {err.lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(doc, dict):
        raise GossipError(f"{file}: expected a JSON object")
    return doc


def _read_config(file: Path) -> dict[str, Any]:
    """The run's config, for the algorithm name only: unreadable configs are ignored."""
    if not file.is_file():
        return {}
    try:
        import yaml

        doc = yaml.safe_load(file.read_text())
    except Exception:  # optional metadata: never fatal
        return {}
    return doc if isinstance(doc, dict) else {}


def default_labels(runs: list[Run]) -> list[str]:
    """``"<algorithm> (<dir name>)"`` (just the algorithm when the folder is named after it);
    labels that would repeat get more of the path."""

    def label(run: Run, depth: int) -> str:
        parts = run.path.resolve().parts[-depth:]
        name = "/".join(parts)
        algo = run.algorithm
        if not algo:
            return name
        return algo if name == algo else f"{algo} ({name})"

    labels = [label(r, 1) for r in runs]
    for depth in (2, 3):
        dup = {x for x in labels if labels.count(x) > 1}
        if not dup:
            break
        labels = [label(r, depth) if x in dup else x for r, x in zip(runs, labels)]
    return labels


# --------------------------------------------------------------------------- figures


def _figure(title: str, n_runs: int) -> tuple[Figure, Axes]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    w, h = FIGSIZE
    if n_runs > MAX_INSIDE_LEGEND:  # room for the legend on the right
        w += 2.5
    fig = Figure(figsize=(w, h), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _labels(runs: list[Run]) -> list[str]:
    defaults = default_labels(runs)
    return [r.label or d for r, d in zip(runs, defaults)]


def _legend(ax: Axes, n_runs: int, loc: str = "best", **kw: Any):
    """The runs' legend: inside the axes for a few runs, right of them for many."""
    if n_runs > MAX_INSIDE_LEGEND:
        handles, labels = ax.get_legend_handles_labels()
        return ax.figure.legend(handles, labels, loc="outside right upper", fontsize="small", **kw)
    return ax.legend(loc=loc, fontsize="small", **kw)


def _x_round(ax: Axes, runs: list[Run] | None = None) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    rounds = [r for run in runs or [] for r in run.rounds]
    if rounds and len(set(rounds)) == 1:  # (one evaluated round: ticks 0.945..1.05 around it)
        ax.set_xlim(rounds[0] - 1, rounds[0] + 1)


def _fmt(style: str, run: Run) -> str:
    """A line style, with a marker where the run has one evaluated row (a line of one point
    draws nothing)."""
    return style + "o" if len(run.rows) == 1 else style


def plot_accuracy(runs: list[Run]) -> Figure:
    """Mean test accuracy over clients (solid), bottom decile (dashed), unseen clients'
    accuracy (dotted, when recorded) vs round; one colour per run."""
    from matplotlib.lines import Line2D

    fig, ax = _figure("Test accuracy vs round", len(runs))
    any_unseen = False
    for i, (run, label, color) in enumerate(zip(runs, _labels(runs), _colors(len(runs)))):
        x = run.rounds
        ax.plot(x, run.series("test_accuracy"), _fmt("-", run), color=color, label=label,
                gid=f"{i}:test_accuracy")  # fmt: skip
        ax.plot(x, run.series("test_accuracy_p10"), _fmt("--", run), color=color,
                gid=f"{i}:test_accuracy_p10")  # fmt: skip
        unseen = run.series("unseen_test_accuracy")
        if np.isfinite(unseen).any():
            any_unseen = True
            ax.plot(x, unseen, _fmt(":", run), color=color, gid=f"{i}:unseen_test_accuracy")
    _x_round(ax, runs)
    ax.set_ylabel("test accuracy")
    runs_legend = _legend(ax, len(runs), loc="lower right", title="run")
    if runs_legend.axes is ax:  # inside: keep it when the styles' legend replaces ax.legend_
        ax.add_artist(runs_legend)
    styles = [("-", "mean over clients"), ("--", "bottom 10% of clients")]
    if any_unseen:
        styles.append((":", "unseen clients (mean)"))
    proxies = [Line2D([], [], color="0.3", linestyle=ls) for ls, _ in styles]
    ax.legend(proxies, [s for _, s in styles], loc="upper left", fontsize="small")
    return fig


def plot_loss(runs: list[Run]) -> Figure:
    """Training loss (weighted over training samples) vs round."""
    fig, ax = _figure("Training loss vs round", len(runs))
    for i, (run, label, color) in enumerate(zip(runs, _labels(runs), _colors(len(runs)))):
        ax.plot(
            run.rounds,
            run.series("train_loss"),
            _fmt("-", run),
            color=color,
            label=label,
            gid=f"{i}:train_loss",
        )
    _x_round(ax, runs)
    ax.set_ylabel("train loss")
    _legend(ax, len(runs))
    return fig


def consensus_max(run: Run) -> np.ndarray:
    """Largest consensus distance over the mixture components, per evaluated round."""
    out = []
    for r in run.rows:
        d = r.get("consensus_distance")
        vals = np.asarray(d if isinstance(d, list) else [d], dtype=float) if d is not None else []
        out.append(float(np.max(vals)) if len(vals) else math.nan)
    return np.array(out, dtype=float)


def plot_consensus(runs: list[Run]) -> Figure:
    """Consensus distance (max over components) vs round on a log axis. Runs whose distance
    is always 0 (server averaging, Local) cannot be drawn on it: they appear in the legend
    only, marked "= 0"; single zero points are left out of a curve."""
    fig, ax = _figure("Consensus distance vs round", len(runs))
    positive = recorded = False
    for i, (run, label, color) in enumerate(zip(runs, _labels(runs), _colors(len(runs)))):
        y = consensus_max(run)
        recorded = recorded or not np.isnan(y).all()
        if np.isnan(y).all():
            label = f"{label} (not recorded)"
        elif not (y > 0).any():
            label = f"{label} (distance 0, not drawn)"
        positive = positive or bool((y > 0).any())
        y = np.where(y > 0, y, np.nan)
        ax.plot(run.rounds, y, _fmt("-", run), color=color, label=label,
                gid=f"{i}:consensus_distance")  # fmt: skip
    _x_round(ax, runs)
    if positive:
        ax.set_yscale("log")
        ax.set_ylabel("consensus distance (max over components, log)")
    else:
        ax.set_ylabel("consensus distance (max over components)")
        ax.set_ylim(-0.05, 1)
        ax.text(
            0.5,
            0.5,
            # (a merged peer-to-peer run records none by round: it was said to be 0)
            "every run has consensus distance 0"
            if recorded
            else "no run recorded its consensus distance by round",
            transform=ax.transAxes,
            ha="center",
            va="center",
            color="0.4",
        )
    _legend(ax, len(runs))
    return fig


def traffic(run: Run) -> np.ndarray | None:
    """Cumulative ``model_bytes`` per evaluated round (the schedule's peer-to-peer traffic as
    if every peer were its own machine); None for runs that did not record it. ``bytes_sent``
    is no substitute: it counts traffic between ranks only, 0 in one process."""
    if not any("model_bytes" in r for r in run.rows):
        return None
    return np.nan_to_num(run.series("model_bytes"), nan=0.0)


def plot_accuracy_vs_bytes(runs: list[Run]) -> Figure:
    """Mean test accuracy vs cumulative model bytes exchanged (log x). A run that sent
    nothing (Local) is a horizontal dotted line at its final accuracy, marked in the legend;
    a run without ``model_bytes`` (older metrics) is listed in the legend, not drawn."""
    fig, ax = _figure("Test accuracy vs communication", len(runs))
    flat: list[tuple[int, float, str, Any]] = []
    for i, (run, label, color) in enumerate(zip(runs, _labels(runs), _colors(len(runs)))):
        x, y = traffic(run), run.series("test_accuracy")
        if x is None:
            ax.plot([], [], color=color, label=f"{label} (no model_bytes, not drawn)")
        elif not (x > 0).any():
            flat.append((i, float(y[-1]), label, color))
        else:
            keep = x > 0  # the log axis has no 0: drop rounds before the first message
            ax.plot(
                x[keep], y[keep], "o-", ms=3, color=color, label=label, gid=f"{i}:test_accuracy"
            )
    drawn = any(len(line.get_xdata()) for line in ax.lines)
    for i, acc, label, color in flat:
        ax.axhline(
            acc,
            linestyle=":",
            color=color,
            gid=f"{i}:test_accuracy",
            label=f"{label}: 0 bytes (final accuracy)",
        )
    if drawn:
        ax.set_xscale("log")
        ax.set_xlabel("model bytes exchanged between peers (cumulative, log)")
    else:
        ax.set_xlabel("model bytes exchanged between peers (cumulative)")
        ax.set_xticks([])
        if not flat:
            ax.set_yticks([])
            ax.text(
                0.5,
                0.5,
                "no run recorded model_bytes (a merged peer-to-peer run counts bytes_sent "
                "instead; an older gossip-pfl, neither)",
                transform=ax.transAxes,
                ha="center",
                va="center",
                color="0.4",
            )
    ax.set_ylabel("test accuracy")
    if drawn or flat:
        _legend(ax, len(runs))
    return fig


def plot_client_hist(runs: list[Run]) -> Figure:
    """Histogram of the final per-client test accuracy, one translucent histogram per run
    over shared bins; a dashed line marks each run's mean."""
    fig, ax = _figure("Final per-client test accuracy", len(runs))
    accs = [run.final_client_accuracy() for run in runs]
    data = [a[np.isfinite(a)] for a in accs if a is not None and np.isfinite(a).any()]
    lo = min((float(a.min()) for a in data), default=0.0)
    hi = max((float(a.max()) for a in data), default=1.0)
    lo, hi = max(0.0, math.floor(lo * 20) / 20), min(1.0, math.ceil(hi * 20) / 20)
    if hi <= lo:
        lo, hi = max(0.0, lo - 0.05), min(1.0, hi + 0.05)
    bins = np.linspace(lo, hi, 21)
    for i, (acc, label, color) in enumerate(zip(accs, _labels(runs), _colors(len(runs)))):
        if acc is None or not np.isfinite(acc).any():
            ax.plot([], [], color=color, label=f"{label}: no per-client accuracy recorded")
            continue
        acc = acc[np.isfinite(acc)]
        ax.hist(
            acc,
            bins=bins,
            color=color,
            alpha=0.35,
            label=f"{label} (n = {len(acc)})",
            gid=f"{i}:client_test_accuracy",
        )
        ax.hist(acc, bins=bins, color=color, histtype="step", linewidth=1.2)
        ax.axvline(
            float(acc.mean()),
            color=color,
            linestyle="--",
            linewidth=1,
            gid=f"{i}:client_test_accuracy_mean",
        )
    ax.set_xlabel("test accuracy of a client (dashed: mean)")
    ax.set_ylabel("clients")
    if data:
        _legend(ax, len(runs))
    else:
        ax.text(
            0.5,
            0.5,
            "no run recorded client_test_accuracy (metrics from an older gossip-pfl?)",
            transform=ax.transAxes,
            ha="center",
            va="center",
            color="0.4",
        )
    return fig


PLOTS = dict(
    zip(
        PLOT_NAMES,
        (plot_accuracy, plot_loss, plot_consensus, plot_accuracy_vs_bytes, plot_client_hist),
    )
)


def mixture_weights(run: Run) -> np.ndarray | None:
    """(rounds, M) mean mixture weight of each component per evaluated round; None for runs
    without mixture weights (one model, or metrics from an older gossip-pfl)."""
    path = run.path / "metrics.jsonl"
    rows = [r.get("mixture_weights") for r in run.rows]
    rows = [w if w is None else run.numbers(f"{path}, round {r['round']}", "mixture_weights", w)
            for w, r in zip(rows, run.rows)]  # fmt: skip
    if all(w is None for w in rows):
        return None
    m = max(len(w) for w in rows if w is not None)
    return np.array([w if w is not None and len(w) == m else [math.nan] * m for w in rows])


def plot_mixture_weights(runs: list[Run]) -> Figure:
    """Each component's mean mixture weight over the clients vs round, one color per run and
    one line style per component: a component dying out (weight to 0) or taking over every
    client (to 1) shows at a glance."""
    fig, ax = _figure("Mixture weights vs round", len(runs))
    styles = ("-", "--", ":", "-.")
    for i, (run, label, color) in enumerate(zip(runs, _labels(runs), _colors(len(runs)))):
        w = mixture_weights(run)
        for m in range(0 if w is None else w.shape[1]):
            ax.plot(run.rounds, w[:, m], _fmt(styles[m % len(styles)], run), color=color,
                    label=f"{label}, component {m}", gid=f"{i}:mixture_weights:{m}")  # fmt: skip
    _x_round(ax, runs)
    ax.set_ylabel("mean mixture weight over clients")
    ax.set_ylim(-0.02, 1.02)
    _legend(ax, len(runs))
    return fig


def _bad_value(figure: str, runs: list[Run], err: Exception) -> str:
    folders = ", ".join(str(run.path) for run in runs)
    return (f"{figure}: a value in metrics.jsonl or summary.json of {folders} is not a number "
            f"or list of numbers ({one_line(err)})")  # fmt: skip


def write_plots(runs: list[Run], out: str | Path) -> list[Path]:
    """Save every figure of :data:`PLOTS` as ``out/<name>.png``, and
    ``mixture_weights_vs_round.png`` when a run has mixture weights; the paths written."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise GossipError(f"cannot create {out}: {one_line(err)}") from None
    figures = dict(PLOTS)
    try:
        if any(mixture_weights(run) is not None for run in runs):
            figures["mixture_weights_vs_round"] = plot_mixture_weights
    except (TypeError, ValueError) as err:
        raise GossipError(_bad_value("mixture weights", runs, err)) from None
    saves = {}
    for name, fn in figures.items():
        try:
            fig = fn(runs)
        except GossipError:  # (a ValueError) already names its file, round and key
            raise
        except (TypeError, ValueError) as err:  # e.g. "consensus_distance": "x"
            raise GossipError(_bad_value(name, runs, err)) from None
        saves[out / f"{name}.png"] = partial(fig.savefig, dpi=DPI, format="png")
    # the set replaces the old one at once: a failure part way left old figures beside new
    # ones, and runs without mixture weights plotted into a folder kept an older run's
    try:
        replace_all(saves)
        if "mixture_weights_vs_round" not in figures:
            (out / "mixture_weights_vs_round.png").unlink(missing_ok=True)
    except OSError as err:
        raise GossipError(f"cannot write {err.filename or out}: {one_line(err)}") from None
    return list(saves)
