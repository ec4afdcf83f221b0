"""Peer-to-peer runs (``runtime.transport: zmq``, docs/p2p.md) against issue 20's numbers.

D-FedEM on the synthetic benchmark (configs/synthetic/dfedem.yaml's data generator, with
``data.n_clients`` set to the number of peers), on a ring with Metropolis weights, started with
``gossip-pfl peers-local`` on 127.0.0.1:

  drop   a ring of 16 peers (16 processes), 20% of links dropped per exchange (faults.drop 0.2),
         against the same run without faults: the average of the shared models is conserved
         (the drift merge measures stays at the fault-free run's float rounding, no
         disagreements), and test accuracy is within 2 points of the fault-free run;
  kill   8 processes, process 3 killed at round 10 and restarted at round 20: the run finishes,
         and the restarted peer's final test accuracy is within 2 points of the others' mean;
  equal  no faults, 4 processes (2 peers each): the same summary as the torch transport
         (torchrun, 4 Gloo ranks) and as one process (accuracies to 1e-4).

Writes RUN_DIR/bench_p2p.json and RUN_DIR/bench_p2p.md (and each run's folder under RUN_DIR).

    python benchmarks/bench_p2p.py [--cases drop,kill,equal] [--rounds 30] [--drop-peers 16]
        [--kill-peers 8] [--equal-procs 4] [--equal-clients 8] [--n-test 1000] [--out RUN_DIR]

Slow on a small machine: every process imports torch and builds its data; use ``--rounds``
and ``--n-test`` to fit (the kill case needs rounds > 20).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "synthetic" / "dfedem.yaml"
KEYS = ("test_accuracy", "test_accuracy_p10", "test_accuracy_weighted", "train_accuracy",
        "train_loss")  # fmt: skip


def _sets(args, clients: int, **extra) -> list[str]:
    """--set overrides: the synthetic data with ``clients`` clients, a ring, the rounds."""
    sets = {
        "data.n_clients": clients,
        "data.n_test": args.n_test,
        "data.cache": "false",
        "schedule.graph": "ring",
        "schedule.graph_args": "{}",
        "schedule.weights": "metropolis",
        "rounds": args.rounds,
        "eval.every": args.eval_every,
        "runtime.device": "cpu",
        "runtime.timeout_s": args.timeout,
        "runtime.link_timeout_s": args.link_timeout,
        **extra,
    }
    out = []
    for k, v in sets.items():
        out += ["--set", f"{k}={v}"]
    return out


def _run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    t0 = time.monotonic()
    with open(log, "w") as f:
        print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout)
        except BaseException:  # the command's own group: the launcher and the peers it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    return code, time.monotonic() - t0


def _peers_local(args, name: str, n: int, sets: list[str]) -> dict:
    out = args.out / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "gossip_pfl", "peers-local", str(CONFIG), "-n", str(n),
           "--out", str(out), *sets]  # fmt: skip
    code, wall = _run(cmd, out.parent / f"{name}.log", args.run_timeout)
    res = {"name": name, "processes": n, "returncode": code, "wall_s": round(wall, 1)}
    if code == 0:
        res["summary"] = json.loads((out / "summary.json").read_text())
    return res


def case_drop(args) -> dict:
    n = args.drop_peers
    base = _peers_local(args, f"drop_ring{n}_clean", n, _sets(args, n))
    faults = ["--set", f"runtime.faults.drop={args.drop}", "--set", "runtime.faults.seed=7"]
    drop = _peers_local(args, f"drop_ring{n}_p{args.drop}", n, _sets(args, n) + faults)
    res = {"case": "drop", "peers": n, "drop": args.drop, "clean": base, "faulty": drop}
    if base["returncode"] == 0 and drop["returncode"] == 0:
        a, b = base["summary"], drop["summary"]
        res["accuracy_gap"] = b["test_accuracy"] - a["test_accuracy"]
        res["pass_accuracy"] = abs(res["accuracy_gap"]) <= 0.02
        # conserved: no disagreement, and the average moved no more than the fault-free run's
        # float rounding (x10 slack: the sum of more, differently rounded, steps)
        floor = max(a["links"]["drift_total"], 1e-6)
        res["pass_average"] = (b["links"]["disagreements"] == 0
                               and b["links"]["drift_total"] <= 10 * floor)  # fmt: skip
    return res


def _links(run: Path, k: int) -> list[dict]:
    path = run / "peers" / str(k) / "links.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def case_kill(args) -> dict:
    n, who = args.kill_peers, args.kill_id
    kill = f"[{{id: {who}, round: {args.kill_round}, restart: {args.restart_round}}}]"
    sets = _sets(args, n, checkpoint_every=args.checkpoint_every)
    sets += ["--set", f"runtime.faults.kill={kill}"]
    run = _peers_local(args, f"kill{n}", n, sets)
    # the same peers without faults: the restarted peer's client differs from the others (its
    # own data), so its accuracy there is the fairer reference
    clean = _peers_local(args, f"kill{n}_clean", n, _sets(args, n))
    res = {"case": "kill", "processes": n, "killed": who, "kill_round": args.kill_round,
           "restart_round": args.restart_round, "run": run, "clean": clean}  # fmt: skip
    if run["returncode"] != 0:
        return res
    if clean["returncode"] == 0:
        ref = np.array(clean["summary"]["client_test_accuracy"], dtype=float)
        res["clean_accuracy"] = float(ref[who])
        res["clean_others_mean"] = float(np.delete(ref, who).mean())
    s = run["summary"]
    acc = np.array(s["client_test_accuracy"], dtype=float)
    others = np.delete(acc, who)
    res["restarted_accuracy"] = float(acc[who])
    res["others_mean"] = float(others.mean())
    res["gap"] = res["restarted_accuracy"] - res["others_mean"]
    res["finished"] = s["peers_reporting"] == n
    # the check, literally; each client has its own data, so its accuracy differs from
    # the others' mean without faults too: the change against the fault-free run is reported
    res["pass"] = bool(res["finished"] and abs(res["gap"]) <= 0.02)
    if "clean_accuracy" in res:
        res["gap_vs_clean"] = res["gap"] - (res["clean_accuracy"] - res["clean_others_mean"])
        res["pass_vs_clean"] = bool(res["finished"] and abs(res["gap_vs_clean"]) <= 0.02)
    # when its links counted again: its exchanges after the crash, and the links lost in each
    out = args.out / f"kill{n}"
    mine = _links(out, who)
    after = [e for e in mine if e["round"] >= args.kill_round]
    res["rejoined_at_round"] = after[0]["round"] if after else None
    res["lost_after_rejoin"] = [[e["round"], e["lost"]] for e in after[:12]]
    full = [e["round"] for e in after if not e["lost"]]
    res["first_full_round_after_rejoin"] = full[0] if full else None
    return res


def case_equal(args) -> dict:
    n, clients = args.equal_procs, args.equal_clients
    sets = _sets(args, clients)
    p2p = _peers_local(args, f"equal{n}_zmq", n, sets)
    runs = {"zmq": p2p}
    env_cmds = {
        "one": [sys.executable, "-m", "gossip_pfl", "run", str(CONFIG)],
        "torch": [
            "torchrun",
            "--standalone",
            f"--nproc_per_node={n}",
            "-m",
            "gossip_pfl",
            "run",
            str(CONFIG),
            "--set",
            "runtime.backend=gloo",
        ],  # fmt: skip
    }
    for name, cmd in env_cmds.items():
        out = args.out / f"equal{n}_{name}"
        if out.exists():
            shutil.rmtree(out)
        code, wall = _run([*cmd, *sets, "--out", str(out), "--quiet"],
                          args.out / f"equal{n}_{name}.log", args.run_timeout)  # fmt: skip
        runs[name] = {"name": name, "returncode": code, "wall_s": round(wall, 1)}
        if code == 0:
            runs[name]["summary"] = json.loads((out / "summary.json").read_text())
    res = {"case": "equal", "processes": n, "clients": clients, "runs": runs}
    if all(r["returncode"] == 0 for r in runs.values()):
        ref = runs["one"]["summary"]
        diffs = {}
        for name in ("zmq", "torch"):
            s = runs[name]["summary"]
            d = {k: abs(s[k] - ref[k]) for k in KEYS if k in s and k in ref}
            d["client_test_accuracy"] = float(np.max(np.abs(
                np.array(s["client_test_accuracy"], float)
                - np.array(ref["client_test_accuracy"], float))))  # fmt: skip
            diffs[name] = d
        res["max_abs_diff_vs_one_process"] = diffs
        res["pass"] = all(v <= 1e-4 for d in diffs.values() for v in d.values())
    return res


def _table(results: list[dict], args) -> str:
    lines = [
        f"D-FedEM, synthetic data (dim 150, M = 3, n_test {args.n_test} per client), ring with "
        f"Metropolis weights, {args.rounds} rounds, eval every {args.eval_every}, "
        f"link_timeout_s {args.link_timeout:g}, peers-local on 127.0.0.1.",
        "",
        "| case | run | test acc | links lost / ends | disagreements | drift (total) | "
        "wall s | check |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def row(case, run, check=""):
        if run["returncode"] != 0:
            return f"| {case} | {run['name']} | exit {run['returncode']} | | | | | FAIL |"
        s = run["summary"]
        ln = s.get("links")
        lk = f"{ln['link_ends_lost']} / {ln['link_ends']}" if ln else "-"
        dis = str(ln["disagreements"]) if ln else "-"
        dr = f"{ln['drift_total']:.2g}" if ln else "-"
        return (f"| {case} | {run['name']} | {s['test_accuracy']:.4f} | {lk} | {dis} | {dr} | "
                f"{run['wall_s']:.0f} | {check} |")  # fmt: skip

    def ok(flag):
        return "pass" if flag else "FAIL"

    for r in results:
        if r["case"] == "drop":
            lines.append(row("drop", r["clean"]))
            chk = ""
            if "accuracy_gap" in r:
                chk = (f"gap {100 * r['accuracy_gap']:+.2f} pt ({ok(r['pass_accuracy'])}); "
                       f"average {ok(r['pass_average'])}")  # fmt: skip
            lines.append(row("drop", r["faulty"], chk))
        elif r["case"] == "kill":
            chk = ""
            if "gap" in r:
                chk = (f"peer {r['killed']}: {r['restarted_accuracy']:.4f} vs others "
                       f"{r['others_mean']:.4f} ({100 * r['gap']:+.2f} pt), rejoined at round "
                       f"{r['rejoined_at_round']}, all links from round "
                       f"{r['first_full_round_after_rejoin']} ({ok(r['pass'])})")  # fmt: skip
            lines.append(row("kill", r["run"], chk))
            chk = ""
            if "clean_accuracy" in r:
                chk = (f"peer {r['killed']} without faults: {r['clean_accuracy']:.4f} vs others "
                       f"{r['clean_others_mean']:.4f}; the restart moved its gap by "
                       f"{100 * r['gap_vs_clean']:+.2f} pt ({ok(r['pass_vs_clean'])})")  # fmt: skip
            lines.append(row("kill", r["clean"], chk))
        elif r["case"] == "equal":
            for name, run in r["runs"].items():
                chk = ""
                d = r.get("max_abs_diff_vs_one_process", {}).get(name)
                if d:
                    chk = f"max abs diff vs one process {max(d.values()):.1e}"
                    chk += f" ({ok(max(d.values()) <= 1e-4)})"
                lines.append(row("equal", run, chk))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="drop,kill,equal")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--n-test", type=int, default=1000, help="test samples per client")
    ap.add_argument("--drop-peers", type=int, default=16)
    ap.add_argument("--drop", type=float, default=0.2)
    ap.add_argument("--kill-peers", type=int, default=8)
    ap.add_argument("--kill-id", type=int, default=3)
    ap.add_argument("--kill-round", type=int, default=10)
    ap.add_argument("--restart-round", type=int, default=20)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--equal-procs", type=int, default=4)
    ap.add_argument("--equal-clients", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=600, help="runtime.timeout_s")
    ap.add_argument("--link-timeout", type=float, default=30, help="runtime.link_timeout_s")
    ap.add_argument("--run-timeout", type=float, default=3600, help="seconds per command")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_p2p")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cases = {"drop": case_drop, "kill": case_kill, "equal": case_equal}
    results = []
    for name in args.cases.split(","):
        t0 = time.monotonic()
        results.append(cases[name](args))
        print(f"# {name}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        (args.out / "bench_p2p.json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
            indent=2) + "\n")  # fmt: skip
    table = _table(results, args)
    (args.out / "bench_p2p.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
