"""Checkpoints and resume: an interrupted-and-resumed run ends with exactly the numbers of an
uninterrupted one, also on a different number of ranks."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from _helpers import run_ranks, stop_after_checkpoint, toy_dataset

from gossip_pfl import checkpoint
from gossip_pfl.config import load_config
from gossip_pfl.errors import GossipError
from gossip_pfl.train import Trainer


def quiet(*_args, **_kw):
    pass


def cfg_for(out, rounds=6, **over):
    base = {
        "seed": 5,
        "rounds": rounds,
        "algorithm": {"name": "dfedem", "components": 2, "lr": 0.2, "momentum": 0.5,
                      "batch_size": 16},
        "schedule": {"graph": "ring", "weights": "metropolis",
                     "time_varying": {"kind": "link_failure", "q": 0.2}},
        "eval": {"every": 2},
        "checkpoint_every": 2,
        "out": str(out),
        **over,
    }  # fmt: skip
    return load_config(base=base)


def run_until(cfg, stop_after: int | None):
    """Run, stopping (like a killed job) right after round ``stop_after``'s checkpoint."""
    trainer = Trainer(cfg, dataset=toy_dataset(8), log=lambda *a: None)
    if stop_after is not None:
        stop_after_checkpoint(trainer, stop_after)
        return None
    trainer.run()
    return trainer.shared_parameters(), trainer.personal["pi"].cpu().numpy()


def resume(cfg):
    trainer = Trainer(cfg, dataset=toy_dataset(8), log=lambda *a: None)
    trainer.run(resume=True)
    theta, pi = trainer.shared_parameters(), trainer.personal["pi"].cpu().numpy()
    return {int(p): (theta[i], pi[i]) for i, p in enumerate(trainer.peers)}


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path):
    theta, pi = run_until(cfg_for(tmp_path / "full"), None)
    run_until(cfg_for(tmp_path / "cut"), stop_after=4)
    resumed = resume(cfg_for(tmp_path / "cut"))
    for p, (th, q) in resumed.items():
        np.testing.assert_array_equal(th, theta[p])
        np.testing.assert_array_equal(q, pi[p])
    full = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    cut = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in cut] == [2, 4, 6]
    for a, b in zip(full, cut):
        assert a["test_accuracy"] == b["test_accuracy"]
        assert a["consensus_distance"] == b["consensus_distance"]


def test_resume_on_more_ranks(tmp_path):
    theta, _ = run_until(cfg_for(tmp_path / "full"), None)
    run_until(cfg_for(tmp_path / "cut"), stop_after=2)
    results = run_ranks(2, resume, cfg_for(tmp_path / "cut"))
    merged = {}
    for status, value in results:
        assert status == "ok", value
        merged.update(value)
    for p, (th, _) in merged.items():
        np.testing.assert_allclose(th, theta[p], rtol=1e-6, atol=1e-7)


def _resume_own(cfgs):
    """Rank r resumes from its own folder, cfgs[r] (a node's copy of the run folder)."""
    return resume(cfgs[int(os.environ["RANK"])])


def test_ranks_that_read_different_checkpoints_stop_before_training(tmp_path):
    """Each rank reads its own RUN_DIR: ranks at rounds 4 and 2 trained together (one
    aborted inside Gloo, the other saved a mix a later resume finished, exit 0); same round,
    another run's (lr 0.3; and one of no metrics rows yet) is named too. A rank without a
    checkpoint says so, the other names it (it said a peer probably died). Nothing is
    written."""
    run_until(cfg_for(tmp_path / "a"), stop_after=4)
    run_until(cfg_for(tmp_path / "b"), stop_after=2)
    lr = {"name": "dfedem", "components": 2, "lr": 0.3, "momentum": 0.5, "batch_size": 16}
    run_until(cfg_for(tmp_path / "c", algorithm=lr), stop_after=4)
    run_until(cfg_for(tmp_path / "d", eval={"every": 6}), stop_after=2)  # (no rows yet)
    run_until(cfg_for(tmp_path / "e", eval={"every": 6}, algorithm=lr), stop_after=2)
    (tmp_path / "f").mkdir()  # no checkpoint
    before = (tmp_path / "a" / "metrics.jsonl").read_text()
    other_run = "rank 1 read another run's checkpoint of round {} than rank 0"
    cases = {
        ("a", "b"): ["rank 1 read a checkpoint of round 2, rank 0 one of round 4", "same folder"],
        ("a", "c"): [other_run.format(4), "same folder"],
        ("d", "e"): [other_run.format(2), "same folder"],
        ("a", "f"): ["rank 1 could not read its checkpoint", "its own message says why"],
    }
    for (mine, other), says in cases.items():
        results = run_ranks(2, _resume_own, [cfg_for(tmp_path / mine), cfg_for(tmp_path / other)])
        for rank, (status, value) in enumerate(results):
            words = ["f: no checkpoint.pt there"] if (other, rank) == ("f", 1) else says
            assert status == "error" and all(w in value for w in words), value
    assert (tmp_path / "a" / "metrics.jsonl").read_text() == before


def test_resume_with_other_runtime_settings(tmp_path):
    """The per-peer loop and small step and evaluation calls instead of one batched call:
    same algorithm, so the resumed run ends where the uninterrupted one does (to float
    rounding; eval.chunk, a call size too, was refused). Another precision changes what is
    computed: refused (bf16 moved the parameters by 6e-4, unsaid)."""
    theta, _ = run_until(cfg_for(tmp_path / "full"), None)
    run_until(cfg_for(tmp_path / "cut"), stop_after=2)
    calls = cfg_for(tmp_path / "cut", runtime={"batching": "loop", "step_chunk": 16},
                    eval={"every": 2, "chunk": 5})  # fmt: skip
    says = (r"keys differ: runtime.precision, runtime.tf32; the checkpoint's: "
            r"runtime.precision=float32, runtime.tf32=False\)")  # fmt: skip
    with pytest.raises(GossipError, match=says):
        resume(cfg_for(tmp_path / "cut", runtime={"precision": "bf16", "tf32": True}))
    state = checkpoint.load(tmp_path / "cut")  # made before those keys were compared: it ran
    for key in ("precision", "tf32", "faults"):  # under their defaults, and resumes
        del state["config"]["runtime"][key]
    state["config"]["runtime"]["overlap"] = True  # a runtime key since removed: how it ran
    checkpoint.save(state, tmp_path / "cut")
    resumed = resume(calls)
    for p, (th, _) in resumed.items():
        np.testing.assert_allclose(th, theta[p], rtol=1e-6, atol=1e-7)


def test_resume_reads_its_data_from_another_place(tmp_path, capsys):
    """Where the data is read and cached may differ per rank (docs/distributed.md) and on
    resume: a torchrun rank with its own data.cache_dir could not resume (keys differ). The
    data's digest still guards what is read."""
    from gossip_pfl.cli import main

    run = ["run", "--quiet", "--no-plots", "--set", "rounds=2", "--set", "data.n_clients=6",
           "--set", "data.n_test=20", "--set", "data.dim=10"]  # fmt: skip
    out = ["--out", str(tmp_path / "run")]
    assert main([*run, *out, "--set", f"data.cache_dir={tmp_path / 'a'}"]) == 0
    again = [
        "run",
        "--resume",
        str(tmp_path / "run"),
        "--quiet",
        "--no-plots",
        "--set",
        "rounds=3",
        "--set",
        f"data.cache_dir={tmp_path / 'b'}",
        "--set",
        "data.cache=false",
    ]
    assert main(again) == 0, capsys.readouterr().err
    assert main([*again[:-4], "--set", "rounds=4", "--set", "data.dim=11"]) == 2
    assert "keys differ: data.dim" in capsys.readouterr().err


def test_resume_with_other_config_names_keys(tmp_path):
    run_until(cfg_for(tmp_path / "cut"), stop_after=2)
    changed = cfg_for(tmp_path / "cut", seed=6)
    changed.algorithm.lr = 0.3
    changed.runtime.batching = "loop"  # how to run may change; only lr and seed are named
    with pytest.raises(GossipError, match=r"keys differ: algorithm.lr, seed; the checkpoint's: "
                       r"algorithm.lr=0.2, seed=5\)"):  # fmt: skip
        Trainer(changed, dataset=toy_dataset(8), log=lambda *a: None).run(resume=True)
    # nothing was overwritten by the refused resume
    rows = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["round"] for r in rows] == [2]


def test_resume_on_other_data_under_the_same_config_is_refused(tmp_path):
    """Same config, other data (a dataset of one's own that changed, a Python run resumed from
    the command line): refused by the checkpoint's data digest, nothing overwritten. One label
    flipped is other data; the same data renamed is not."""
    run_until(cfg_for(tmp_path / "cut"), stop_after=2)
    other = toy_dataset(8)
    other.clients[3].y_train[5] = 1 - other.clients[3].y_train[5]
    with pytest.raises(GossipError, match=r"--resume .*cut: the checkpoint was trained on other "
                       r"data than this run's 'toy' \(the checkpoint's: 'toy'; "):  # fmt: skip
        Trainer(cfg_for(tmp_path / "cut"), dataset=other, log=lambda *a: None).run(resume=True)
    rows = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["round"] for r in rows] == [2]
    renamed = toy_dataset(8)
    renamed.name = "mine"
    Trainer(cfg_for(tmp_path / "cut"), dataset=renamed, log=lambda *a: None).run(resume=True)


def test_a_checkpoint_from_before_loss_divisor_resumes_as_it_ran(tmp_path):
    """A checkpoint made before ``algorithm.loss_divisor`` existed divided every minibatch by
    B: it resumes under ``loss_divisor: batch_size`` and equals the uninterrupted run, and is
    refused under the new default (which would change its numbers halfway), naming the key."""

    def old(out):
        cfg = cfg_for(out)
        cfg.algorithm.loss_divisor = "batch_size"
        return cfg

    theta, _ = run_until(old(tmp_path / "full"), None)
    run_until(old(tmp_path / "cut"), stop_after=2)
    state = checkpoint.load(tmp_path / "cut")
    del state["config"]["algorithm"]["loss_divisor"]  # as such a checkpoint was written
    checkpoint.save(state, tmp_path / "cut")
    with pytest.raises(GossipError, match=r"keys differ: algorithm.loss_divisor; the "
                       r"checkpoint's: algorithm.loss_divisor=batch_size\)"):  # fmt: skip
        resume(cfg_for(tmp_path / "cut"))
    for p, (th, _) in resume(old(tmp_path / "cut")).items():
        np.testing.assert_array_equal(th, theta[p])


def test_resume_without_checkpoint(tmp_path):
    with pytest.raises(GossipError, match="no checkpoint.pt"):
        Trainer(cfg_for(tmp_path), dataset=toy_dataset(8), log=lambda *a: None).run(resume=True)


def test_resume_of_a_finished_run_says_where_its_checkpoint_is(tmp_path):
    run_until(cfg_for(tmp_path), None)  # all 6 rounds, the last checkpointed
    with pytest.raises(GossipError, match=r"already finished its 6 rounds \(raise 'rounds'"):
        resume(cfg_for(tmp_path))
    # fewer rounds than the checkpoint's: it read "already finished its 4 rounds"
    with pytest.raises(GossipError, match=r"checkpoint is of round 6, past rounds = 4 \(set"):
        resume(cfg_for(tmp_path, rounds=4))


def test_a_run_stopped_before_its_summary_is_finished_by_its_resume(tmp_path):
    """Killed between its last checkpoint and its summary (a cut summary.json, or none): the
    resume writes the summary from the checkpoint, training nothing, equal to the
    uninterrupted run's (wall time aside). It refused ('already finished'), and merge and
    plot refused the cut file, so a checkpointed run could not be finished."""
    want = Trainer(cfg_for(tmp_path / "full"), dataset=toy_dataset(8), log=quiet).run()
    cut = tmp_path / "cut"
    stop_after_checkpoint(Trainer(cfg_for(cut), dataset=toy_dataset(8), log=quiet), 6)
    assert not (cut / "summary.json").exists()
    (cut / "summary.json").write_text('{"algorithm": "dfe')  # cut while written
    got = Trainer(cfg_for(cut), dataset=toy_dataset(8), log=quiet).run(resume=True)
    on_disk = json.loads((cut / "summary.json").read_text())
    for summary in (got, on_disk):
        assert {k: v for k, v in summary.items() if k != "wall_seconds"} == {
            k: v for k, v in want.items() if k != "wall_seconds"
        }
    with pytest.raises(GossipError, match=r"already finished its 6 rounds .* figures again: "
                       r"gossip-pfl plot .*cut --out .*cut/plots\)"):  # fmt: skip
        resume(cfg_for(cut))  # once the summary is there


def test_a_finished_run_taken_further_drops_its_old_summary_at_once(tmp_path):
    """A finished 6-round run resumed with rounds = 10 and killed after round 8: its folder
    no longer holds the 6-round summary beside metrics of 8 rounds; the next resume ends
    with the 10-round run's summary."""
    out = tmp_path / "run"
    Trainer(cfg_for(out), dataset=toy_dataset(8), log=quiet).run()
    assert json.loads((out / "summary.json").read_text())["rounds"] == 6
    longer = Trainer(cfg_for(out, rounds=10), dataset=toy_dataset(8), log=quiet)
    original = longer.checkpoint

    def checkpoint_then_stop(where, done, rows):
        original(where, done, rows)
        if done == 8:
            raise KeyboardInterrupt  # killed

    longer.checkpoint = checkpoint_then_stop
    with pytest.raises(KeyboardInterrupt):
        longer.run(resume=True)
    assert not (out / "summary.json").exists()
    assert [json.loads(r)["round"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [
        2, 4, 6, 8]  # fmt: skip
    Trainer(cfg_for(out, rounds=10), dataset=toy_dataset(8), log=quiet).run(resume=True)
    assert json.loads((out / "summary.json").read_text())["rounds"] == 10


def test_an_output_cut_while_written_leaves_the_old_file():
    """rundir.replace_with: a write stopped midway (a kill, a full disk) leaves the file as it
    was and no temporary beside it (summary.json, config.yaml, metrics and figures go through
    it)."""
    import tempfile
    from pathlib import Path

    from gossip_pfl.rundir import replace_with

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "summary.json"
        path.write_text('{"rounds": 6}')

        def cut(tmp):
            tmp.write_text('{"rou')
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            replace_with(path, cut)
        assert path.read_text() == '{"rounds": 6}' and list(Path(folder).iterdir()) == [path]
        replace_with(path, lambda tmp: tmp.write_text('{"rounds": 8}'))
        assert path.read_text() == '{"rounds": 8}' and list(Path(folder).iterdir()) == [path]
