"""Configs keep their numbers: run every quick config for a few rounds, and compare each run's
summary.json with the one an earlier commit wrote.

Each config (default: every configs/synthetic/*.yaml) runs in its own process as

    gossip-pfl run CONFIG --set rounds=N --set eval.every=N --set runtime.device=cpu
                   --out OUT/NAME --quiet

(one torch thread: OMP_NUM_THREADS=1 unless --threads says otherwise), so it evaluates once, at
the last round. With --compare REF, every numeric field of OUT/NAME/summary.json (lists of
numbers element by element, nested mappings by key; wall_seconds left out) is compared with
REF/NAME/summary.json, and the largest absolute difference per config is printed. The exit
status is 1 when a config differs by more than --tol, lost a numeric field the reference has,
or failed to run. Configs without a reference, and fields only the new summary has, are listed
and do not fail the check.

    python benchmarks/config_summaries.py [CONFIG ...] [--rounds 5] [--out DIR]
        [--compare REF_DIR] [--tol 1e-6] [--no-run]

Make a reference on an earlier commit with the same command without --compare (or with
``gossip-pfl run`` as above, one folder per config named after its file).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = {"wall_seconds"}


def run_config(config: Path, out: Path, rounds: int, threads: int) -> tuple[bool, float, str]:
    """One config in a fresh process; (ok, seconds, last lines of its error output)."""
    cmd = [
        sys.executable,
        "-m",
        "gossip_pfl.cli",
        "run",
        str(config),
        "--set",
        f"rounds={rounds}",
        "--set",
        f"eval.every={rounds}",
        "--set",
        "runtime.device=cpu",
        "--out",
        str(out),
        "--quiet",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    return proc.returncode == 0, time.perf_counter() - t0, tail


def numeric_fields(value, path: str = "") -> dict[str, float]:
    """Every number in a JSON value by its path (``a.b``, ``a[3]``); bools and strings left out."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return {}
    if isinstance(value, (int, float)):
        return {path: float(value)}
    out = {}
    if isinstance(value, dict):
        for k, v in value.items():
            if k in SKIP:
                continue
            out.update(numeric_fields(v, f"{path}.{k}" if path else str(k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.update(numeric_fields(v, f"{path}[{i}]"))
    return out


def _group(path: str) -> str:
    """The top-level field a path belongs to (``client_test_accuracy[12]`` -> its list)."""
    return path.split("[", 1)[0].split(".", 1)[0]


def compare(new: dict, ref: dict) -> dict:
    """Largest absolute difference over the numeric fields both have, where it is, and the
    fields only one side has (grouped by top-level field)."""
    a, b = numeric_fields(new), numeric_fields(ref)
    worst, where = 0.0, ""
    for key in sorted(a.keys() & b.keys()):
        x, y = a[key], b[key]
        if math.isnan(x) and math.isnan(y):
            continue
        d = math.inf if math.isnan(x) or math.isnan(y) else abs(x - y)
        if d > worst:
            worst, where = d, key
    return {
        "max_abs": worst,
        "where": where,
        "fields": len(a.keys() & b.keys()),
        "missing": sorted({_group(k) for k in b.keys() - a.keys()}),
        "added": sorted({_group(k) for k in a.keys() - b.keys()}),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "configs",
        nargs="*",
        type=Path,
        help="run configs (default: every configs/synthetic/*.yaml)",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("runs/config_summaries"),
        help="one folder per config, named after its file",
    )
    ap.add_argument(
        "--compare",
        type=Path,
        metavar="REF_DIR",
        help="reference folder: REF_DIR/NAME/summary.json per config",
    )
    ap.add_argument("--tol", type=float, default=1e-6, help="largest absolute difference allowed")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    ap.add_argument(
        "--no-run", action="store_true", help="compare the summaries already in --out, run nothing"
    )
    args = ap.parse_args()
    configs = [c.resolve() for c in args.configs] or sorted(
        (ROOT / "configs" / "synthetic").glob("*.yaml")
    )
    if not configs:
        print("no configs found", file=sys.stderr)
        return 2
    missing = [str(c) for c in configs if not c.is_file()]
    if missing:
        print(f"config file not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    args.out = args.out.resolve()  # the runs start in the repository root
    names = [c.stem for c in configs]
    if len(set(names)) != len(names):
        print("configs with the same file name would share an output folder", file=sys.stderr)
        return 2
    width = max(map(len, names))
    failed = []
    ran = (f"{args.rounds} rounds (evaluated at the last), device cpu, {args.threads} "
           "thread(s)" if not args.no_run else "the summaries already there")  # fmt: skip
    print(
        f"# {len(configs)} configs, {ran}; output in {args.out}"
        + (f"; reference {args.compare}, tol {args.tol:g}" if args.compare else "")
    )
    header = f"{'config':<{width}}  {'run s':>6}  "
    if args.compare:
        header += f"{'max |diff|':>10}  {'fields':>6}  {'status':<6}  notes"
    print(header)
    no_reference = []
    for config, name in zip(configs, names):
        out = args.out / name
        line = f"{name:<{width}}  "
        if args.no_run:
            line += f"{'-':>6}  "
        else:
            ok, secs, tail = run_config(config, out, args.rounds, args.threads)
            line += f"{secs:>6.1f}  "
            if not ok:
                failed.append(name)
                print(line + f"{'':>10}  {'':>6}  {'FAILED':<6}  run failed: {tail}")
                continue
        summary_path = out / "summary.json"
        if not summary_path.is_file():
            failed.append(name)
            print(line + f"{'':>10}  {'':>6}  {'FAILED':<6}  no {summary_path}")
            continue
        if not args.compare:
            print(line)
            continue
        ref_path = args.compare / name / "summary.json"
        if not ref_path.is_file():
            no_reference.append(name)
            print(line + f"{'-':>10}  {'-':>6}  {'new':<6}  no reference ({ref_path})")
            continue
        res = compare(json.loads(summary_path.read_text()), json.loads(ref_path.read_text()))
        bad = res["max_abs"] > args.tol or res["missing"]
        notes = []
        if res["max_abs"] > 0:
            notes.append(f"largest at {res['where']}")
        if res["missing"]:
            notes.append(f"missing: {', '.join(res['missing'])}")
        if res["added"]:
            notes.append(f"new fields: {', '.join(res['added'])}")
        if bad:
            failed.append(name)
        status = "FAIL" if bad else "ok"
        print(
            line + f"{res['max_abs']:>10.3g}  {res['fields']:>6}  {status:<6}  " + "; ".join(notes)
        )
    if no_reference:
        print(f"# without a reference (not compared): {', '.join(no_reference)}")
    if failed:
        print(f"# FAILED: {', '.join(failed)}")
        return 1
    if args.compare:
        print(f"# every compared config within {args.tol:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
