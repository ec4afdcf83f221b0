"""Federated EM in statistic space: the three experiments of docs/expfam.md, one process.

(a) the synthetic 2-D mixture on the sorted split (half the workers hold one component only,
half the other) with FedEM, the naive baseline and VR-FedEM (block quantization, omega = 1),
plus the gossip form on a ring, and the same three without compression for the bits per round;
then where the naive baseline's floor comes from: naive and FedEM with and without compression,
with minibatches (b = 20) or full local passes, with p = 0.75 or 1, and the naive baseline's
floor on the iid, mixed and sorted splits; (b) Fashion-MNIST PCA-20 with a 10-component
mixture; (c) imputation on low-rank data. Writes the figures docs/expfam/*.png and the table
docs/expfam/results.md.

    OMP_NUM_THREADS=1 python benchmarks/expfam_experiments.py [--out runs/expfam] [--skip-fashion]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from gossip_pfl.config import load_config
from gossip_pfl.train import run

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs" / "expfam"
SYNTHETIC = ("gmm2d_fedem", "gmm2d_naive", "gmm2d_vr_fedem")
LABELS = {"gmm2d_fedem": "FedEM", "gmm2d_naive": "naive", "gmm2d_vr_fedem": "VR-FedEM",
          "gmm2d_gossip": "FedEM, gossip ring (new)"}  # fmt: skip


def _run(name: str, out: Path, overrides: list[str] = ()) -> tuple[dict, list[dict]]:
    tag = name + ("_" + "_".join(o.split("=")[-1] for o in overrides) if overrides else "")
    # one thread through runtime.threads: the run sets its own count (torch.set_num_threads
    # before it would be overridden by the machine's default)
    cfg = load_config(
        CONFIGS / f"{name}.yaml", [f"out={out / tag}", "runtime.threads=1", *overrides]
    )
    summary = run(cfg, log=lambda *a: None)
    rows = [json.loads(x) for x in (out / tag / "metrics.jsonl").read_text().splitlines()]
    print(f"  {tag}: {summary['wall_seconds']:.1f} s, h_sq {summary['h_sq']:.3g}", flush=True)
    return summary, rows


def _at(rows: list[dict], epochs: float, key: str) -> float:
    """``key`` at the first logged row past ``epochs``."""
    return next((r[key] for r in rows if r["epochs"] >= epochs), rows[-1][key])


def _commit() -> str:
    """``git rev-parse --short HEAD``, and whether the working tree differs from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "? (not a git checkout)"
    return head + (" plus uncommitted changes" if git("status", "--porcelain") else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/expfam", help="folder for the runs")
    ap.add_argument("--docs", default=str(ROOT / "docs" / "expfam"), help="figures and table")
    ap.add_argument("--skip-fashion", action="store_true", help="leave out experiment (b)")
    args = ap.parse_args()
    out, docs = Path(args.out), Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = []
    print("(a) synthetic 2-D mixture", flush=True)
    start = time.perf_counter()
    res = {name: _run(name, out) for name in SYNTHETIC}
    three = time.perf_counter() - start
    res["gmm2d_gossip"] = _run("gmm2d_gossip", out, ["expfam.split=sorted"])
    gossip_mixed, _ = _run("gmm2d_gossip", out)
    plain = {name: _run(name, out, ["expfam.compressor=identity"]) for name in SYNTHETIC}

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, (_, rows) in res.items():
        ep = [r["epochs"] for r in rows]
        for ax, key in zip(axes, ("h_sq", "H_sq")):
            ax.semilogy(ep, [max(r[key], 1e-300) for r in rows], label=LABELS[name])
    axes[0].set(xlabel="epochs", title="||h(S_k)||^2 (full data), sorted split")
    axes[1].set(xlabel="epochs", title="||H_k||^2")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(docs / "gmm2d.png", dpi=110)
    plt.close(fig)

    lines += ["## (a) Synthetic 2-D mixture, sorted split (block quantization, omega = 1)", "",
              "| method | ||h||^2 at 100 epochs | at 250 | at 500 | ||H||^2 at 500 | bits up per "
              "round (omega = 1) | uncompressed | wall s |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, (s, rows) in res.items():
        ref = plain.get(name, (None,))[0]
        uncompressed = f"{ref['bits_up_per_round']:.0f}" if ref else "-"
        lines.append(
            f"| {LABELS[name]} | {_at(rows, 100, 'h_sq'):.3g} | {_at(rows, 250, 'h_sq'):.3g} | "
            f"{s['h_sq']:.3g} | {s['H_sq']:.3g} | {s['bits_up_per_round']:.0f} | "
            f"{uncompressed} | {s['wall_seconds']:.1f} |"
        )
    fed, vr = res["gmm2d_fedem"][0]["h_sq"], res["gmm2d_vr_fedem"][0]["h_sq"]
    naive = res["gmm2d_naive"][0]["h_sq"]
    lines += ["", f"VR-FedEM / FedEM ||h||^2 at 500 epochs: {vr / fed:.2g}; naive / FedEM: "
              f"{naive / fed:.3g}. The three compressed runs took {three:.1f} s together.", "",
              f"The gossip ring on the mixed split (configs/expfam/gmm2d_gossip.yaml): ||h||^2 "
              f"{gossip_mixed['h_sq']:.3g} at 500 epochs.", ""]  # fmt: skip
    lines += [
        "Without compression, ||h||^2 at 500 epochs: "
        + ", ".join(f"{LABELS[k]} {v[0]['h_sq']:.3g}" for k, v in plain.items()),
        "",
    ]

    # where the naive baseline's floor comes from: compression, participation, minibatches
    print("(a') compression, participation and minibatch noise apart", flush=True)
    final = {("b = 20, p = 0.75", m, c): (res if c == "block" else plain)[f"gmm2d_{m}"][0]["h_sq"]
             for m in ("naive", "fedem") for c in ("identity", "block")}  # fmt: skip
    curves = {}
    settings = {"b = 20, p = 1": ["expfam.p=1.0"],
                "full batch, p = 0.75": ["expfam.batch=0"],
                "full batch, p = 1": ["expfam.batch=0", "expfam.p=1.0"]}  # fmt: skip
    for setting, opts in settings.items():
        for m in ("naive", "fedem"):
            for c in ("identity", "block"):
                if setting == "full batch, p = 0.75" and c == "block":
                    continue  # compression and participation together: the paper's row
                if setting == "full batch, p = 1" and c == "identity" and m == "fedem":
                    # omega = 0, p = 1: the memories play no role, both are EM with step gamma
                    final[(setting, m, c)] = final[(setting, "naive", c)]
                    continue
                s, rows = _run(f"gmm2d_{m}", out, [*opts, f"expfam.compressor={c}"])
                final[(setting, m, c)] = s["h_sq"]
                if setting == "full batch, p = 1":
                    curves[(m, c, "sorted")] = rows
    for split in ("iid", "mixed"):
        s, rows = _run(
            "gmm2d_naive", out, [*settings["full batch, p = 1"], f"expfam.split={split}"]
        )
        curves[("naive", "block", split)] = rows

    fig, ax = plt.subplots(figsize=(6, 3.8))
    names = {("naive", "identity", "sorted"): "EM with step gamma (no compression; naive = FedEM)",
             ("fedem", "block", "sorted"): "FedEM, omega = 1",
             ("naive", "block", "sorted"): "naive, omega = 1, sorted split",
             ("naive", "block", "mixed"): "naive, omega = 1, mixed split",
             ("naive", "block", "iid"): "naive, omega = 1, iid split"}  # fmt: skip
    for key, label in names.items():
        rows = curves[key]
        ax.semilogy([r["round"] for r in rows], [max(r["h_sq"], 1e-300) for r in rows],
                    label=label)  # fmt: skip
    ax.set(xlabel="rounds", title="||h(S_k)||^2, full local passes, p = 1 (only compression noise)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(docs / "gmm2d_compression.png", dpi=110)
    plt.close(fig)

    lines += ["## (a') Compression, participation and minibatch noise apart (sorted split)", "",
              f"||h(S)||^2 after {res['gmm2d_fedem'][0]['rounds']} rounds (gamma = 1e-2; full local"
              " passes cost 5x the epochs of b = 20):", "",
              "| setting | naive, none | naive, omega = 1 | FedEM, none | FedEM, omega = 1 |",
              "|---|---|---|---|---|"]  # fmt: skip
    for setting in ("b = 20, p = 0.75", *settings):
        cells = [f"{final[(setting, m, c)]:.3g}" if (setting, m, c) in final else "-"
                 for m in ("naive", "fedem") for c in ("identity", "block")]  # fmt: skip
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    floors = {split: curves[("naive", "block", split)][-1]["h_sq"] for split in ("iid", "mixed")}
    floors["sorted"] = final[("full batch, p = 1", "naive", "block")]
    lines += ["", "The naive baseline's floor with full local passes, p = 1, omega = 1, by split: "
              + ", ".join(f"{k} {v:.3g}" for k, v in floors.items()) + ".", ""]  # fmt: skip

    if args.skip_fashion:  # keep the table's (b) as it was (it was dropped from the file)
        lines += _kept_section(docs / "results.md", "## (b) ", "## (c) ")
    else:
        print("(b) Fashion-MNIST", flush=True)
        s, rows = _run("fashion_mnist_fedem", out)
        ep = [r["epochs"] for r in rows]
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        axes[0].plot(ep, [r["mixture_weights"] for r in rows])
        axes[0].set(xlabel="epochs", title="mixture weights")
        axes[1].semilogy(ep, [r["H_sq"] for r in rows])
        axes[1].set(xlabel="epochs", title="||H_k||^2")
        fig.tight_layout()
        fig.savefig(docs / "fashion_mnist.png", dpi=110)
        plt.close(fig)
        weights = " ".join(f"{w:.3f}" for w in s["mixture_weights"])
        lines += ["## (b) Fashion-MNIST, PCA 20, G = 10", "",
                  f"After {s['epochs']:.0f} epochs: log-likelihood {s['loglik']:.3f} per image, "
                  f"||h||^2 {s['h_sq']:.3g}, ||H||^2 {s['H_sq']:.3g}, mixture weights {weights} "
                  f"({s['wall_seconds']:.0f} s).", ""]  # fmt: skip

    print("(c) imputation", flush=True)
    s, rows = _run("lowrank_imputation", out)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.plot([r["epochs"] for r in rows], [r["imputation_rmse"] for r in rows], label="FedEM")
    ax.axhline(s["mean_imputation_rmse"], color="gray", ls="--", label="mean imputation")
    ax.set(xlabel="epochs", ylabel="RMSE on the missing entries", title="low-rank imputation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(docs / "imputation.png", dpi=110)
    plt.close(fig)
    lines += ["## (c) Imputation, rank 2, d = 10, 20% missing", "",
              f"RMSE on the missing entries: FedEM {s['imputation_rmse']:.4f}, mean imputation "
              f"{s['mean_imputation_rmse']:.4f} (noise sd 0.3); ||h||^2 {s['h_sq']:.3g}, "
              f"log-likelihood {s['loglik']:.4f}, {s['projected']} projections, after "
              f"{s['epochs']:.0f} epochs ({s['wall_seconds']:.1f} s).", ""]  # fmt: skip

    head = ["# Federated EM: benchmark numbers", "",
            f"`benchmarks/expfam_experiments.py` at commit {_commit()}, {platform.machine()}, "
            f"torch {torch.__version__}, 1 thread.", ""]  # fmt: skip
    (docs / "results.md").write_text("\n".join(head + lines))
    print("\n".join(lines))


def _kept_section(path: Path, start: str, end: str) -> list[str]:
    """The lines of ``path`` from the heading ``start`` up to ``end`` (none: no such file or
    section), marked as kept from an earlier run."""
    old = path.read_text().splitlines() if path.is_file() else []
    at = next((i for i, line in enumerate(old) if line.startswith(start)), None)
    if at is None:
        return []
    stop = next((i for i in range(at + 1, len(old)) if old[i].startswith(end)), len(old))
    note = "(Kept from the file's earlier run: this one skipped it.)"
    body = [line for line in old[at + 1 : stop] if line != note]
    while body and not body[0]:  # (one blank line after the note, however often it is kept)
        body.pop(0)
    return [old[at], "", note, "", *body]


if __name__ == "__main__":
    main()
