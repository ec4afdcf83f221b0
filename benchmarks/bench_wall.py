"""A run's ``wall_seconds`` on this tree against another commit's, side by side: the runs
alternate (base, new, base, new, ...) so that other jobs on the machine weigh on both alike,
and the medians and their ratio are printed. The base commit is checked out once in a git
worktree (under runs/bench_wall/) and imported from there.

    python benchmarks/bench_wall.py --base ef07664 [--config configs/synthetic/dfedem.yaml]
        [--threads 1,2] [--repeats 3] [--set KEY=VALUE ...]

Prints one markdown row per thread count, with both trees' test accuracy (which the speed
work must not move).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench_ops import commit

ROOT = Path(__file__).resolve().parent.parent


def worktree(rev: str) -> Path:
    """A checkout of ``rev`` (made once, reused; named by its commit, so that a name such as
    HEAD or a branch does not reuse the checkout of what it named before)."""
    parse = ["git", "rev-parse", "--short", f"{rev}^{{commit}}"]
    done = subprocess.run(parse, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"--base {rev}: not a commit here ({done.stderr.strip()})")
    rev = done.stdout.strip()
    path = ROOT / "runs" / "bench_wall" / f"tree-{rev}"
    if not (path / "gossip_pfl").is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--force", "--detach", str(path), rev],
                       cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    return path


def one_run(tree: Path, config: str, threads: int, sets: list[str], out: Path) -> dict:
    """``gossip-pfl run`` with ``tree``'s package first on the path; its summary."""
    # OMP_NUM_THREADS, not runtime.threads: the key is younger than the anchor commit
    # (5e626a6), and a run with runtime.threads: 0 (the default) takes the variable's count
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads)}
    args = [a for s in sets for a in ("--set", s)]
    cmd = [sys.executable, "-m", "gossip_pfl", "run", str(ROOT / config), "--out", str(out)]
    shutil.rmtree(out, ignore_errors=True)  # a run refuses another run's folder
    done = subprocess.run(cmd + args, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd + args)} failed: {done.stderr.strip()[-500:]}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare with (e.g. ef07664)")
    ap.add_argument("--config", default="configs/synthetic/dfedem.yaml")
    ap.add_argument("--threads", default="1,2", help="torch threads per run, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="runs per tree and thread count")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every run")  # fmt: skip
    args = ap.parse_args()
    trees = {"base": worktree(args.base), "new": ROOT}
    out = ROOT / "runs" / "bench_wall"
    print(f"# {args.config}, base {args.base}, load average {os.getloadavg()[0]:.1f} at start")
    print("| threads | base s (median) | new s (median) | new / base | base acc | new acc |")
    print("|---|---|---|---|---|---|")
    for threads in map(int, args.threads.split(",")):
        walls: dict[str, list[float]] = {k: [] for k in trees}
        acc = {}
        for rep in range(args.repeats):
            for name, tree in trees.items():
                s = one_run(tree, args.config, threads, args.set, out / f"{name}-{threads}-{rep}")
                walls[name].append(s["wall_seconds"])
                acc[name] = s.get("test_accuracy", float("nan"))
        base, new = (statistics.median(walls[k]) for k in ("base", "new"))
        print(f"| {threads} | {base:.2f} ({', '.join(f'{w:.1f}' for w in walls['base'])}) | "
              f"{new:.2f} ({', '.join(f'{w:.1f}' for w in walls['new'])}) | {new / base:.2f} | "
              f"{acc['base']:.4f} | {acc['new']:.4f} |")  # fmt: skip
    print(f"# load average {os.getloadavg()[0]:.1f} at the end; commit {commit()}")


if __name__ == "__main__":
    main()
