"""Faults a user meets: each is a one-line error with exit 2 (or the signal's code), no
traceback, nothing earlier lost. Schedules that cannot mix, output folders that cannot take a
run, bad values, and SIGTERM in the middle of a run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from _helpers import toy_dataset

from gossip_pfl.cli import main
from gossip_pfl.config import load_config
from gossip_pfl.errors import GossipError
from gossip_pfl.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
SMALL = {
    "seed": 5,
    "rounds": 3,
    "data": {"name": "synthetic", "n_clients": 8, "n_test": 20, "dim": 10},
    "algorithm": {"name": "fedavg", "lr": 0.1, "batch_size": 16},
    "eval": {"every": 1},
    "runtime": {"device": "cpu"},
}


def write_cfg(tmp: Path, **over) -> Path:
    cfg = {**SMALL, **over}
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli(args: list[str], capsys) -> tuple[int, list[str]]:
    code = main(args)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, err


def one_line_error(capsys, args, pattern) -> None:
    code, err = cli(args, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("gossip-pfl: error:"), err
    assert pattern in err[0], err[0]


def quiet(*_a, **_k):
    pass


# ---- schedules that cannot mix ---------------------------------------------------------------
def _dsgd(tmp, schedule, **over):
    base = {
        "seed": 1,
        "rounds": 2,
        "algorithm": {"name": "dsgd", "batch_size": 16},
        "schedule": schedule,
        "runtime": {"device": "cpu"},
        "out": str(tmp / "out"),
        **over,
    }
    return load_config(base=base)  # fmt: skip


def test_schedule_that_never_connects_is_refused_with_its_components(tmp_path):
    sched = {"graph": "ring", "time_varying": {"kind": "link_failure", "q": 1.0}}
    with pytest.raises(GossipError, match="never connects all 8 peers.*8 components"):
        Trainer(_dsgd(tmp_path, sched), dataset=toy_dataset(8), log=quiet)


def test_identity_and_two_blocks_are_refused(tmp_path):
    blocks = np.zeros((8, 8))
    blocks[:4, :4] = blocks[4:, 4:] = 0.25
    for name, w in (("eye", np.eye(8)), ("blocks", blocks)):
        f = tmp_path / f"{name}.npz"
        np.savez(f, W=w[None])
        with pytest.raises(GossipError, match="never connects"):
            Trainer(_dsgd(tmp_path, {"graph": str(f)}), dataset=toy_dataset(8), log=quiet)


def test_row_stochastic_schedule_is_refused_unless_opted_out(tmp_path):
    w = np.full((8, 8), 1 / 8)
    w[:, 0] += 0.1
    w[:, 1] -= 0.1  # rows still sum to 1, columns 0 and 1 do not
    f = tmp_path / "rows.npz"
    np.savez(f, W=w[None])
    with pytest.raises(GossipError, match=r"not doubly stochastic: W_0 column 0 sums to 1\.8"):
        Trainer(_dsgd(tmp_path, {"graph": str(f)}), dataset=toy_dataset(8), log=quiet)
    cfg = _dsgd(tmp_path, {"graph": str(f)}, check_schedule=False)
    assert Trainer(cfg, dataset=toy_dataset(8), log=quiet).route == "gossip"


# ---- output folders ---------------------------------------------------------------------------
def test_output_folder_that_is_a_file(tmp_path, capsys):
    cfg = write_cfg(tmp_path)
    (tmp_path / "taken").write_text("mine")
    one_line_error(capsys, ["run", str(cfg), "--out", str(tmp_path / "taken"), "--quiet"],
                   "is a file")  # fmt: skip
    assert (tmp_path / "taken").read_text() == "mine"
    # under a file: it read "permission denied" (as root: nothing at all until the write)
    one_line_error(capsys, ["run", str(cfg), "--out", str(tmp_path / "taken" / "run")],
                   "taken is a file, so")  # fmt: skip
    one_line_error(capsys, ["run", str(tmp_path), "--out", str(tmp_path / "r")],
                   f"config file {tmp_path} is a folder, not a file")  # fmt: skip
    # --resume continues in its own folder: --out went unheeded
    one_line_error(capsys, ["run", "--resume", str(tmp_path), "--out", str(tmp_path / "r")],
                   "continues the run in its own folder; drop --out")  # fmt: skip
    one_line_error(capsys, ["run", "--resume", str(tmp_path), "--set", "out=elsewhere"],
                   "continues the run in its own folder; drop --set out=elsewhere")  # fmt: skip


def test_another_runs_folder_is_kept_unless_overwrite(tmp_path, capsys):
    cfg, out = write_cfg(tmp_path), tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--no-plots"]) == 0
    capsys.readouterr()
    before = (out / "metrics.jsonl").read_bytes()
    one_line_error(capsys, ["run", str(cfg), "--out", str(out), "--quiet"], "holds another run")
    assert (out / "metrics.jsonl").read_bytes() == before
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--overwrite", "--no-plots"]) == 0


def test_a_run_stopped_before_its_first_row_leaves_a_folder_to_start_again(tmp_path, capsys):
    """Stopped before its first row and checkpoint, a run left config.yaml and an empty
    metrics.jsonl: a new run there was told the folder held another run to continue with
    --resume, and --resume that there was no checkpoint. Nothing is lost there: it starts."""
    cfg, out = write_cfg(tmp_path), tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("rounds: 2\n")
    (out / "metrics.jsonl").write_text("")
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--no-plots"]) == 0
    assert (out / "summary.json").is_file()


@pytest.mark.parametrize("folder", ["1e-3", "100", "yes"])
def test_an_out_folder_named_like_a_number_runs_and_resumes(folder, tmp_path, monkeypatch):
    """--out went into the config as YAML text: a folder named 1e-3 (a learning-rate sweep's),
    100 or yes was a number or a boolean, 'must be str'; the saved config reads back as it
    was written (its out quoted)."""
    monkeypatch.chdir(tmp_path)
    cfg = write_cfg(tmp_path, checkpoint_every=1)
    assert main(["run", str(cfg), "--out", folder, "--quiet", "--no-plots"]) == 0
    assert yaml.safe_load((tmp_path / folder / "config.yaml").read_text())["out"] == folder
    assert main(["run", "--resume", folder, "--set", "rounds=4", "--quiet", "--no-plots"]) == 0
    assert json.loads((tmp_path / folder / "summary.json").read_text())["rounds"] == 4


def test_a_resume_that_would_move_the_lr_decay_is_refused(tmp_path, capsys):
    """lr_decay is in fractions of the run: 4 rounds resumed as 6 took the decay from rounds
    2 and 3 to 3 and 4.5 (the step went back up 10x at round 5) and gave neither run's
    numbers, unsaid. Without a decay the longer resume goes on."""
    algorithm = {**SMALL["algorithm"], "lr_decay": [0.5, 0.75]}
    cfg, out = write_cfg(tmp_path, rounds=4, algorithm=algorithm), tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--no-plots"]) == 0
    capsys.readouterr()
    says = (
        "algorithm.lr_decay [0.5, 0.75] is in fractions of the run, so resuming its 4 "
        "rounds as rounds=6 would move the decay from rounds 2, 3 to 3, 4.5"
    )
    one_line_error(capsys, ["run", "--resume", str(out), "--set", "rounds=6", "--quiet"], says)
    plain = write_cfg(tmp_path, rounds=4)
    assert main(["run", str(plain), "--out", str(out), "--quiet", "--no-plots", "--overwrite"]) == 0
    assert main(["run", "--resume", str(out), "--set", "rounds=6", "--quiet", "--no-plots"]) == 0


def test_a_run_with_a_schedule_file_resumes_from_any_folder(tmp_path, monkeypatch):
    """The run's config.yaml held the schedule file's path relative to the working folder, and
    a resume read it relative to the run's folder: 'schedule file not found'."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "ring.yaml").write_text("graph: ring\n")
    algorithm = {**SMALL["algorithm"], "name": "dsgd"}
    cfg = {**SMALL, "algorithm": algorithm, "schedule": "ring.yaml", "checkpoint_every": 1}
    (tmp_path / "cfg" / "x.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "cfg/x.yaml", "--out", "run", "--quiet", "--no-plots"]) == 0
    monkeypatch.chdir(tmp_path / "cfg")
    assert main(["run", "--resume", "../run", "--set", "rounds=4", "--quiet", "--no-plots"]) == 0
    # so is one given with --set, relative to the working folder
    monkeypatch.chdir(tmp_path)
    argv = ["run", "cfg/x.yaml", "--set", "schedule=cfg/ring.yaml", "--out", "run2", "--quiet",
            "--no-plots"]  # fmt: skip
    assert main(argv) == 0
    monkeypatch.chdir(tmp_path / "cfg")
    assert main(["run", "--resume", "../run2", "--set", "rounds=4", "--quiet", "--no-plots"]) == 0


def test_data_folders_are_relative_to_the_config_and_held_absolute(tmp_path, monkeypatch):
    """data.root and data.cache_dir were read relative to the working folder, whatever the
    config's folder, and config.yaml kept them relative, so a resume from elsewhere looked in
    the wrong place; a --set one is relative to the working folder, and ``~`` is expanded."""
    (tmp_path / "cfg").mkdir()
    data = {**SMALL["data"], "cache_dir": "cache"}
    (tmp_path / "cfg" / "x.yaml").write_text(yaml.safe_dump({**SMALL, "data": data}))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "cfg/x.yaml", "--out", "run", "--quiet", "--no-plots"]) == 0
    assert any((tmp_path / "cfg" / "cache").iterdir()) and not (tmp_path / "cache").exists()
    held = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["data"]
    assert held["cache_dir"] == str(tmp_path / "cfg" / "cache")
    monkeypatch.chdir(tmp_path / "cfg")
    assert main(["run", "--resume", "../run", "--set", "rounds=4", "--quiet", "--no-plots"]) == 0
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    argv = ["run", "x.yaml", "--set", "data.cache_dir=~/c", "--out", "../run2", "--quiet",
            "--no-plots"]  # fmt: skip
    assert main(argv) == 0 and any((tmp_path / "home" / "c").iterdir())
    # a run saved before: its config.yaml named the folder relative to the working folder,
    # where its resume still looks (not in the run's folder)
    saved = tmp_path / "run" / "config.yaml"
    saved.write_text(saved.read_text().replace(str(tmp_path / "cfg" / "cache"), "cfg/cache"))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--resume", "run", "--set", "rounds=5", "--quiet", "--no-plots"]) == 0
    assert not (tmp_path / "run" / "cfg").exists()
    # a resume given the user's own config reads it relative to that config, as a run does
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    argv = ["run", "../cfg/x.yaml", "--resume", "../run", "--set", "rounds=6", "--quiet",
            "--no-plots"]  # fmt: skip
    assert main(argv) == 0 and not any((tmp_path / "elsewhere").iterdir())


def test_overwrite_replaces_the_old_runs_files_once_the_new_run_is_built(tmp_path, capsys):
    """An --overwrite refused for a bad schedule (found once the run is built) keeps the old
    run whole, its checkpoint too (it was deleted first, and a resume then said there was
    none); one that runs leaves none of the old run's figures (an EM run kept FedAvg's)."""
    cfg, out = write_cfg(tmp_path, checkpoint_every=1), tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out), "--quiet"]) == 0
    old = {p.name: p.read_bytes() for p in [*out.glob("*.*"), *(out / "plots").glob("*.png")]}
    assert "checkpoint.pt" in old and "accuracy_vs_round.png" in old
    capsys.readouterr()
    bad = ["--set", "algorithm.name=dsgd", "--set", "schedule={graph: torus}"]  # n = 8
    code, err = cli(["run", str(cfg), "--out", str(out), "--quiet", "--overwrite", *bad], capsys)
    assert code == 2 and "torus" in err[0], err
    assert {p.name: p.read_bytes() for p in [*out.glob("*.*"), *(out / "plots").glob("*.png")]
            } == old  # fmt: skip
    em = ["run", str(ROOT / "configs/expfam/gmm2d_fedem.yaml"), "--set", "rounds=2",
          "--set", "expfam.clients=6", "--out", str(out), "--quiet", "--overwrite"]  # fmt: skip
    assert main(em) == 0
    assert sorted(p.name for p in (out / "plots").iterdir()) == ["expfam.png"]
    assert json.loads((out / "summary.json").read_text())["rounds"] == 2


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_output_folder_without_permission(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    one_line_error(capsys, ["run", str(write_cfg(tmp_path)), "--out", str(locked / "run")],
                   "cannot write")  # fmt: skip


# ---- values ---------------------------------------------------------------------------------
RING = ["--set", "algorithm.name=dsgd", "--set", "schedule.graph=ring"]  # a gossip run
BAD = {
    "binary config": (["run", "{bin}"], "not a text"),
    "set not YAML": (["run", "{cfg}", "--set", "algorithm.lr=[1"], "is not a YAML value"),
    "negative weight decay": (
        ["run", "{cfg}", "--set", "algorithm.weight_decay=-1"],
        "algorithm.weight_decay",
    ),  # fmt: skip
    "NaN weight decay": (
        ["run", "{cfg}", "--set", "algorithm.weight_decay=.nan"],
        "algorithm.weight_decay",
    ),  # fmt: skip
    "NaN rule option": (["run", "{cfg}", "--set", "rule.eps=.nan"], "rule.eps"),
    "gossip without schedule": (
        ["run", "{cfg}", "--set", "algorithm.name=dsgd"],
        "needs a schedule",
    ),
    "unknown algorithm": (["run", "{cfg}", "--set", "algorithm.name=nope"], "unknown algorithm"),
    # torch.manual_seed's overflow, a traceback before
    "huge seed": (["run", "{cfg}", "--set", "seed=100000000000000000"], "'seed' must be in"),
    # the generator's int() took it as 8, silently
    "data option type": (["run", "{cfg}", "--set", "data.n_clients=8.5"], "'n_clients' must be"),
    # every accuracy read 0.0
    "no test samples": (["run", "{cfg}", "--set", "data.n_test=0"], "no test samples"),
    # the next four were tracebacks
    "lr_decay item": (["run", "{cfg}", "--set", "algorithm.lr_decay=[abc]"], "lr_decay[0]' must"),
    "pfedme no steps": (["run", "{cfg}", "--set", "algorithm.inner_steps=0"], "inner_steps"),
    "graph_args": (
        ["run", "{cfg}", *RING, "--set", "schedule.graph_args=5"],
        "schedule.graph_args: must be a mapping",
    ),
    # these went unheeded (PeFLL and EM have their own server step), or trained on
    "rule for EM": (
        ["run", "{cfg}", "--set", "algorithm.name=fedem_em", "--set", "rule.name=scaffold"],
        "rule.name: rules are for the model workloads",
    ),
    "PeFLL gossip": (
        ["run", "{cfg}", "--set", "algorithm.name=pefll", *RING[2:]],
        "'pefll' runs on the server schedule",
    ),
    "negative personal lr": (
        ["run", "{cfg}", "--set", "algorithm.personal_lr=-0.05"],
        "algorithm.personal_lr' must be > 0",
    ),
    "negative alpha lr": (["run", "{cfg}", "--set", "algorithm.alpha_lr=-1"], "alpha_lr' must"),
    # it read "seed: must be an int", as if the run's seed
    "schedule seed": (
        ["run", "{cfg}", *RING, "--set", "schedule.seed=abc"],
        "error: schedule.seed: must be an int",
    ),
    "model width": (
        ["run", "{cfg}", "--set", "model.name=mlp", "--set", "model.hidden=[-3]"],
        "'hidden' must",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_are_one_line_errors_before_any_output(case, tmp_path, capsys):
    args, pattern = BAD[case]
    (tmp_path / "bin.yaml").write_bytes(b"\x00\x01\xff\xfe")
    cfg = write_cfg(tmp_path)
    args = [a.format(bin=tmp_path / "bin.yaml", cfg=cfg) for a in args]
    one_line_error(capsys, [*args, "--out", str(tmp_path / "out"), "--quiet"], pattern)
    assert not (tmp_path / "out").exists()


def test_a_diverged_run_names_its_round_counted_from_1(tmp_path, capsys):
    """As metrics.jsonl and the progress lines count (it said round 0)."""
    args = ["run", str(write_cfg(tmp_path)), "--out", str(tmp_path / "o"), "--quiet",
            "--set", "model.name=mlp", "--set", "algorithm.lr=1e30"]  # fmt: skip
    one_line_error(capsys, args, "round 1: the parameters of a peer (first: peer ")


def test_private_models_that_diverge_stop_the_run(tmp_path, capsys):
    """APFL's private models (never mixed) went NaN while the shared ones stayed finite: the
    run ended with exit 0, NaN losses in its metrics and summary."""
    args = ["run", str(write_cfg(tmp_path)), "--out", str(tmp_path / "o"), "--quiet",
            "--set", "algorithm.name=apfl", "--set", "model.name=mlp",
            "--set", "algorithm.personal_lr=1000"]  # fmt: skip
    one_line_error(capsys, args, "algorithm.personal_lr (now 1000)")
    assert "NaN" not in (tmp_path / "o" / "metrics.jsonl").read_text()


def test_a_folder_in_use_by_another_run_is_refused(tmp_path, capsys):
    """A resume (or a fresh run with --overwrite) while the run still goes in its folder (a
    SLURM requeue): both wrote the same files, rows twice and out of order, exit 0. The
    running one's hold is a lock on RUN_DIR/.lock, released (and the file removed) when it
    ends."""
    import os

    from gossip_pfl.rundir import RunLock

    out = tmp_path / "o"
    args = ["run", str(write_cfg(tmp_path)), "--out", str(out), "--quiet", "--no-plots"]
    assert main(args) == 0
    running = RunLock(out).acquire()  # (as the other process would hold it)
    try:
        one_line_error(capsys, ["run", "--resume", str(out), "--set", "rounds=5", "--quiet"],
                       f"out: {out} is in use by another run (process {os.getpid()})")  # fmt: skip
        one_line_error(capsys, [*args, "--overwrite"], f"out: {out} is in use by another run")
    finally:
        running.release()
    assert main(["run", "--resume", str(out), "--set", "rounds=5", "--quiet", "--no-plots"]) == 0
    rounds = [json.loads(r)["round"] for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3, 4, 5]
    assert not (out / ".lock").exists()


def test_a_run_that_ends_as_another_takes_its_folder_leaves_one_holder(tmp_path, monkeypatch):
    """A ends (removes .lock, then lets go) between B's open and B's lock: B held the removed
    file, and C a new one: two runs in one folder. B takes the file that is there now."""
    import fcntl

    from gossip_pfl.rundir import LOCK_FILE, RunLock

    a = RunLock(tmp_path).acquire()
    flock, ended = fcntl.flock, []

    def a_ends_first(fh, op):
        if not ended:
            ended.append(a.release())
        return flock(fh, op)

    monkeypatch.setattr(fcntl, "flock", a_ends_first)
    b = RunLock(tmp_path).acquire()
    monkeypatch.undo()
    try:
        assert os.fstat(b.file.fileno()).st_ino == os.stat(tmp_path / LOCK_FILE).st_ino
        with pytest.raises(GossipError, match="is in use by another run"):
            RunLock(tmp_path).acquire()
    finally:
        b.release()


# ---- signals ----------------------------------------------------------------------------------
def test_sigterm_checkpoints_and_the_resumed_run_equals_the_uninterrupted(tmp_path, capsys):
    """SIGTERM in the middle: the run finishes its round, writes a checkpoint, says how to
    resume and exits 143; resumed, it ends with the uninterrupted run's summary."""
    cfg = write_cfg(tmp_path, rounds=5000)
    out = tmp_path / "stopped"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gossip_pfl.cli", "run", str(cfg), "--out", str(out), "--quiet",
         "--set", "runtime.timeout_s=30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert "stopped by SIGTERM" in stdout and f"--resume {out}" in stdout
    assert "Traceback" not in stderr
    done = json.loads(metrics.read_text().splitlines()[-1])["round"]
    total = done + 3
    # resume (in this process, one thread as the child) and an uninterrupted run to `total`
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        opts = ["--set", f"rounds={total}", "--quiet", "--no-plots"]
        assert main(["run", "--resume", str(out), *opts]) == 0
        ref = tmp_path / "ref"
        assert main(["run", str(cfg), "--out", str(ref), *opts]) == 0
    finally:
        torch.set_num_threads(threads)
    a = json.loads((out / "summary.json").read_text())
    b = json.loads((ref / "summary.json").read_text())
    for key in ("test_accuracy", "train_loss", "train_accuracy"):
        assert a[key] == pytest.approx(b[key], abs=1e-6), key


def test_truncated_data_cache_is_regenerated(tmp_path):
    """A cache file cut short (a full disk, a killed copy) is only a cache: the data is made
    again, the same as the first time, and the file rewritten."""
    from gossip_pfl.data.synthetic import make_synthetic

    first = make_synthetic(n_clients=4, dim=5, n_test=10, seed=0, cache_dir=tmp_path)
    (cached,) = tmp_path.glob("*/x_fit.npy")
    size = cached.stat().st_size
    cached.write_bytes(cached.read_bytes()[:500])
    with pytest.warns(UserWarning, match="damaged"):
        again = make_synthetic(n_clients=4, dim=5, n_test=10, seed=0, cache_dir=tmp_path)
    np.testing.assert_array_equal(again.clients[3].x_train, first.clients[3].x_train)
    assert cached.stat().st_size == size
    (cached.parent / "y_test.npy").unlink()  # a file gone: the same
    with pytest.warns(UserWarning, match="damaged"):
        again = make_synthetic(n_clients=4, dim=5, n_test=10, seed=0, cache_dir=tmp_path)
    np.testing.assert_array_equal(again.clients[3].y_test, first.clients[3].y_test)
    assert (cached.parent / "y_test.npy").exists() and len(list(tmp_path.iterdir())) == 1


def test_graph_file_named_inline_is_read_from_the_configs_folder(tmp_path, monkeypatch):
    """schedule: {graph: ring8.txt} in a config is the file beside the config, wherever the
    command runs from."""
    folder = tmp_path / "study"
    folder.mkdir()
    (folder / "ring8.txt").write_text("".join(f"{i} {(i + 1) % 8}\n" for i in range(8)))
    run_cfg = {"algorithm": {"name": "dsgd"}, "schedule": {"graph": "ring8.txt"}}
    (folder / "run.yaml").write_text(yaml.safe_dump(run_cfg))
    monkeypatch.chdir(tmp_path)
    cfg = load_config(folder / "run.yaml")
    assert Path(cfg.schedule["graph"]) == folder / "ring8.txt"
    trainer = Trainer(cfg, dataset=toy_dataset(8), log=quiet)
    assert trainer.schedule.n == 8


def _run_with_full_disk(cfg, what: str = "metrics"):
    """On rank 0, appending to metrics.jsonl (or writing the checkpoint) fails as on a full
    disk."""
    import os

    import torch.distributed as dist

    from gossip_pfl import rundir

    def full(*args, **kw):
        raise OSError(28, "No space left on device")

    if what == "metrics":
        rundir.append_row = full
    elif int(os.environ["RANK"]) == 0:
        os.fsync = full  # (checkpoint.save's, before its rename)
    try:
        Trainer(cfg, dataset=toy_dataset(8), log=quiet).run()
    except GossipError as err:
        return str(err)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return "no error"


@pytest.mark.parametrize("what", ["metrics", "checkpoint"])
def test_a_failed_write_is_a_one_line_error_on_every_rank(tmp_path, what):
    """Rank 0 cannot append to metrics.jsonl, or write its checkpoint: every rank stops after
    that round with its own one-line error (the others are told it was rank 0's write, not a
    lost peer: after a checkpoint they were)."""
    from _helpers import run_ranks

    base = {"seed": 1, "rounds": 3, "algorithm": {"name": "fedavg", "batch_size": 16},
            "eval": {"every": 1}, "runtime": {"device": "cpu", "timeout_s": 30},
            "checkpoint_every": 1, "out": str(tmp_path / "out")}  # fmt: skip
    cfg = load_config(base=base)
    results = run_ranks(2, _run_with_full_disk, cfg, what)
    msgs = [value for status, value in results]
    assert all(status == "ok" for status, _ in results), results
    assert "could not write" in msgs[0] and "No space left" in msgs[0], msgs
    assert "rank 0 could not write" in msgs[1], msgs
    assert all("\n" not in m for m in msgs)


def _run_with_this_ranks_lr(base: dict) -> str:
    """Rank r runs ``base`` with algorithm.lr 0.1 + 0.2 r (as a node whose copy of the config
    differs would)."""
    import os

    from gossip_pfl import train

    rank = int(os.environ["RANK"])
    cfg = load_config(base=base, overrides=[f"algorithm.lr={0.1 + 0.2 * rank}"])
    try:
        train.run(cfg, dataset=toy_dataset(8), log=quiet)
    except GossipError as err:
        return str(err)
    return "no error"


def test_ranks_started_with_different_configs_stop_at_once(tmp_path):
    """A rank with another algorithm.lr trained, and the run reported a mix of two runs with
    exit 0: every rank stops before any data is built, naming the rank and the keys."""
    from _helpers import run_ranks

    base = {"seed": 1, "rounds": 2, "algorithm": {"name": "fedavg", "batch_size": 16},
            "runtime": {"device": "cpu", "timeout_s": 30},
            "out": str(tmp_path / "out")}  # fmt: skip
    results = run_ranks(2, _run_with_this_ranks_lr, base)
    says = (
        "rank 1 was started with another config than rank 0's (keys differ: algorithm.lr); "
        "start every rank with the same config and --set"
    )
    assert results == [("ok", says), ("ok", says)], results
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def _check_configs(base: dict, per_rank: list[list[str]], late: float = 0.0) -> str:
    """Rank r joins a group (rank 1 ``late`` seconds after rank 0) and checks ``base`` with
    ``per_rank[r]``'s overrides against the other rank's."""
    import os
    import time

    import torch.distributed as dist

    from gossip_pfl.runtime.comm import init_comm
    from gossip_pfl.train import check_same_config

    rank = int(os.environ["RANK"])
    cfg = load_config(base=base, overrides=per_rank[rank])
    time.sleep(late * rank)
    comm = init_comm("cpu", "gloo", timeout_s=4)
    try:
        check_same_config(comm, cfg)
    except GossipError as err:
        return str(err)
    finally:
        dist.destroy_process_group()
    return "same"


def test_every_runtime_key_may_or_may_not_differ_between_ranks():
    """A runtime key added later is put in one list or the other, not allowed to differ by
    default (tf32 was: products at 1e-3 on one rank, full float32 on another)."""
    import dataclasses

    from gossip_pfl import checkpoint
    from gossip_pfl.config import RuntimeConfig

    keys = [f.name for f in dataclasses.fields(RuntimeConfig)]
    assert sorted(keys) == sorted(checkpoint.RUNTIME_PER_PROCESS + checkpoint.RUNTIME_SHARED)
    assert not set(checkpoint.RUNTIME_PER_PROCESS) & set(checkpoint.RUNTIME_SHARED)


def test_ranks_may_read_from_their_own_places(tmp_path):
    """Node-local caches and data folders, a schedule file named from another folder, and
    call sizes may differ between ranks (they were refused as another config); a rank that
    starts later than half the timeout still joins (rank 0's store waits the whole timeout)."""
    from _helpers import run_ranks

    (tmp_path / "ring.yaml").write_text("graph: ring\n")
    base = {"seed": 1, "rounds": 2, "algorithm": {"name": "dsgd", "batch_size": 16},
            "runtime": {"device": "cpu"}, "out": str(tmp_path / "out")}  # fmt: skip
    per_rank = [[f"data.cache_dir={tmp_path / f'c{r}'}", f"eval.chunk={100 * r}",
                 f"schedule={tmp_path / 'ring.yaml' if r else tmp_path / '.' / 'ring.yaml'}"]
                for r in range(2)]  # fmt: skip
    assert run_ranks(2, _check_configs, base, per_rank, 2.5) == [("ok", "same")] * 2
    per_rank[1] += ["runtime.threads=1", "runtime.step_chunk=64"]  # how it runs: its own
    assert run_ranks(2, _check_configs, base, per_rank) == [("ok", "same")] * 2
    # what every rank computes: a bf16 rank trained a mix of two runs, exit 0
    per_rank[1] += ["rounds=3", "runtime.precision=bf16", "runtime.tf32=true"]
    says = ("rank 1 was started with another config than rank 0's (keys differ: rounds, "
            "runtime.precision, runtime.tf32)")  # fmt: skip
    assert [v.split(";")[0] for _, v in run_ranks(2, _check_configs, base, per_rank)] == [says] * 2


# ---- runtime.faults.ack_drop: lost acknowledgements ---------------------------------------------
def _faults_of_a_peer_process(tmp: Path, monkeypatch, ack_drop: float):
    """The Faults that `gossip-pfl peer` hands its ZmqComm for runtime.faults.ack_drop (the
    comm is replaced by one that records them and stops the process there)."""
    import gossip_pfl.runtime.zmq_comm as zc

    class Built(Exception):
        pass

    def fake_comm(*args, faults=None, **kw):
        raise Built(faults)

    peers = tmp / "peers.yaml"
    peers.write_text("0: 127.0.0.1:1\n1: 127.0.0.1:2\n")
    runtime = {"device": "cpu", "faults": {"ack_drop": ack_drop, "seed": 7}}
    algorithm = {"name": "dsgd", "lr": 0.1, "batch_size": 16}
    cfg = write_cfg(tmp, algorithm=algorithm, schedule={"graph": "ring"}, runtime=runtime)
    with monkeypatch.context() as m, pytest.raises(Built) as built:
        m.setattr(zc, "ZmqComm", fake_comm)
        main(["peer", str(cfg), "--peers", str(peers), "--id", "0", "--out", str(tmp / "run"),
              "--quiet"])  # fmt: skip
    return built.value.args[0]


@pytest.mark.parametrize("ack_drop", [0.0, 0.3])
def test_ack_drop_makes_the_ends_disagree_and_merge_counts_it(ack_drop, tmp_path, monkeypatch):
    """runtime.faults.ack_drop reaches a peer process's Faults; with them, a ring of 4 ZmqComm
    ranks (threads, seeded) mixes rows with weight 1/3 per link. Independent truths: each
    rank's new row is x_k + sum over the links it counted of (x_j - x_k) / 3 (a lost link's
    weight on the diagonal); the ends of a link disagree only through lost acks (none at 0,
    some at 0.3 over 5 rounds); the change of the rows' sum in a round is exactly the
    disagreeing links' (x_j - x_k) / 3 at the end that counted (the drift docs/p2p.md names),
    and merge's links report counts the same disagreements, lost ends and drift."""
    import torch
    from _helpers import run_threads

    from gossip_pfl import cli_peer
    from gossip_pfl.runtime import zmq_comm as zc
    from gossip_pfl.runtime.exchange import Exchanger
    from gossip_pfl.runtime.placement import Placement
    from topologies import Phase

    faults = _faults_of_a_peer_process(tmp_path, monkeypatch, ack_drop)
    assert (faults.drop, faults.ack_drop, faults.seed) == (0.0, ack_drop, 7)
    n, rounds = 4, 5
    peers = {r: f"127.0.0.1:{p}" for r, p in enumerate(cli_peer.free_ports(n))}
    lt = 0.25 if ack_drop else 5.0  # a lost ack costs the rank waiting for it a link timeout
    x0 = torch.randn(n, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    i = np.arange(n)
    phase = Phase(n, np.concatenate([i, i, i]), np.concatenate([i, (i + 1) % n, (i - 1) % n]),
                  np.full(3 * n, 1 / 3))  # fmt: skip
    seen: dict[int, list] = {}

    def worker(k):
        ex = Exchanger(Placement(n, n, k), comms[k])
        state, rows = x0[k : k + 1].clone(), []
        for t in range(rounds):
            comms[k].set_tag(t, 0)
            new = ex.mix(state, ex.plan(phase, key=0))
            rows.append({**comms[k].last_links, "x": state[0], "out": new[0]})
            state = new
        seen[k] = rows

    comms = []
    try:
        comms += [zc.ZmqComm(k, peers, "cpu", 10, p2p=True, link_timeout_s=lt, faults=faults)
                  for k in range(n)]  # fmt: skip
    except BaseException:
        for c in comms:
            c.close()
        raise
    run_threads(worker, n, comms, 30)
    assert sorted(seen) == list(range(n))
    disagree, lost_ends, total = 0, 0, torch.zeros(7, dtype=torch.float64)
    for t in range(rounds):
        row = {k: seen[k][t] for k in range(n)}
        counted = {k: set(r["links"]) - set(r["lost"]) for k, r in row.items()}
        explained = torch.zeros(7, dtype=torch.float64)
        for k, r in row.items():
            assert r["round"] == t and sorted(r["links"]) == sorted({(k + 1) % n, (k - 1) % n})
            lost_ends += len(r["lost"])
            hand = r["x"] + sum(((row[j]["x"] - r["x"]) / 3 for j in counted[k]), 0 * r["x"])
            torch.testing.assert_close(r["out"], hand, rtol=0, atol=1e-12)
            for j in counted[k] - {j for j in r["links"] if k in counted[j]}:
                disagree += 1  # k counted j, j did not count k
                explained += (row[j]["x"] - r["x"]) / 3
        change = sum(r["out"] - r["x"] for r in row.values())
        torch.testing.assert_close(change, explained, rtol=0, atol=1e-12)
        total += change
    injected = sum(c.stats["injected"] for c in comms)
    if ack_drop:
        # each dropped ack (sender j -> receiver k) costs k its end of that link
        assert disagree > 0 and lost_ends >= injected > 0 and total.norm() > 1e-6
    else:
        assert disagree == lost_ends == injected == 0
    # merge reads the rows each process writes to links.jsonl (PeerTrainer._log_mix)
    folders = []
    for k in range(n):
        folder = tmp_path / "merge" / str(k)
        folder.mkdir(parents=True)
        lines = [json.dumps({"round": r["round"], "phase": r["phase"], "links": r["links"],
                             "lost": r["lost"], "before": r["x"].tolist(),
                             "change": (r["out"] - r["x"]).tolist()}) for r in seen[k]]  # fmt: skip
        (folder / "links.jsonl").write_text("\n".join(lines) + "\n")
        folders.append(folder)
    report = cli_peer._merge_links(folders)
    last = sum(seen[k][-1]["x"] for k in range(n))
    assert report["exchanges"] == rounds and report["link_ends"] == 2 * n * rounds
    assert report["disagreements"] == disagree and report["link_ends_lost"] == lost_ends
    assert report["drift_total"] == pytest.approx(float(total.norm() / last.norm()), abs=1e-12)


def test_ctrl_c_while_the_figures_are_drawn_says_the_run_is_finished(tmp_path, capsys,
                                                                     monkeypatch):  # fmt: skip
    """A Ctrl-C while the figures were drawn ended with "interrupted" alone: no results table
    (printed after the figures), no word that the run was finished. The results come first;
    the message names the summary and the command that draws the figures."""
    from gossip_pfl.train import Trainer

    def interrupted(run_dir):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "write_plots", staticmethod(interrupted))
    cfg, out = write_cfg(tmp_path), tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out)]) == 130
    captured = capsys.readouterr()
    assert "results (" in captured.out and (out / "summary.json").is_file()
    err = captured.err.strip().splitlines()
    assert err == [f"gossip-pfl: interrupted while drawing the figures; the run is finished "
                   f"({out / 'summary.json'}): draw them with gossip-pfl plot {out}"]  # fmt: skip


def test_sigterm_while_the_figures_are_drawn_says_the_run_is_finished(tmp_path, capsys,
                                                                      monkeypatch):  # fmt: skip
    """SIGTERM there killed the process without a word (exit 143, no figures): it now says
    as a Ctrl-C does, with SIGTERM's code."""
    import os

    from gossip_pfl.train import Trainer

    def terminated(run_dir):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # (the handler raises before this ends)

    class Unhandled(Exception):
        pass

    def unhandled(signum, frame):  # (what the run's own handler must replace: without it, a
        raise Unhandled  # test failure, not the default action, which killed the test worker)

    monkeypatch.setattr(Trainer, "write_plots", staticmethod(terminated))
    cfg, out = write_cfg(tmp_path), tmp_path / "run"
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        assert main(["run", str(cfg), "--out", str(out)]) == 143
        assert signal.getsignal(signal.SIGTERM) is unhandled  # (given back)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert "interrupted while drawing the figures" in capsys.readouterr().err


def test_the_command_ends_at_a_second_ctrl_c_while_it_winds_down(monkeypatch):
    """After a stop (its checkpoint saved) the process joins its threads at exit (the next
    batch plan, drawn ahead): a Ctrl-C then printed their traceback. The command's entry
    leaves SIGINT to the system once main returns."""
    from gossip_pfl import cli as cli_module

    monkeypatch.setattr(cli_module, "main", lambda: 0)
    before = signal.getsignal(signal.SIGINT)
    try:
        assert cli_module.entry() == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, before)


def test_two_writers_of_one_file_do_not_take_each_others_temporary(tmp_path):
    """A plot written beside a finishing run's own plots: both wrote .NAME.tmp.png, one moved
    the other's away (No such file or directory) or put its half-written file in place.
    Both writers are held after writing until the other has written too."""
    import threading

    from gossip_pfl.rundir import replace_all

    both, errors, path = threading.Barrier(2, timeout=10), [], tmp_path / "fig.png"

    def writer(text: str) -> None:
        def save(tmp: Path) -> None:
            tmp.write_text(text)
            both.wait()

        try:
            replace_all({path: save})
        except OSError as err:
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(t,)) for t in ("a" * 99, "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and path.read_text() in ("a" * 99, "b")
    assert [p.name for p in tmp_path.iterdir()] == ["fig.png"]
