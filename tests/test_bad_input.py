"""Bad input found by trying the command with broken files and values (each gave a traceback,
a crash or a silently wrong run): now one line naming the problem, exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from gossip_pfl import cli, cli_peer
from gossip_pfl.cli import main
from gossip_pfl.errors import GossipError
from gossip_pfl.runtime import threads
from topologies.weights import _cached_fmmc

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--set", "rounds=1", "--set", "data.n_clients=6", "--set", "data.n_test=20"]


def _one_line_error(capsys, argv: list[str], pattern: str) -> None:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert re.search(pattern, err), err


@pytest.mark.parametrize(
    ("sets", "pattern"),
    [  # each was a traceback deep in numpy, numba or torch (exit 1), or a crash of every peer
        (
            ["algorithm.batch_size=99999999999999999999"],
            r"'algorithm.batch_size' is 9+, beyond "
            r"2,147,483,647",
        ),
        (["algorithm.local_steps=99999999999999999999"], r"'algorithm.local_steps' is 9+"),
        (["seed=99999999999999999999"], r"'seed' is 9+, beyond 9,223,372,036,854,775,807"),
        (["rule.name=fedadagrad", "rule.tau=1e308"], r"rule.tau.*its square finite"),
        (["data.alpha=1e308"], r"synthetic: alpha must be a number > 0 \(times n_components"),
        (["runtime.faults.seed=-1", "runtime.transport=zmq"], r"runtime.faults.seed.*>= 0"),
        (["runtime.faults.seed=3"], r"runtime.faults.*needs runtime.transport zmq"),
        # a numpy overflow warning printed before the finite check's error
        (["algorithm.weight_decay=1e308"], r"'algorithm.weight_decay' must fit in float32"),
        (["rule.name=fedadam", "rule.eps=1e39"], r"'rule.eps' must fit in float32"),
    ],
)
def test_values_past_what_a_run_takes_are_named(tmp_path, capsys, sets, pattern):
    argv = ["run", str(ROOT / "configs/synthetic/dfedem.yaml"), *SMALL, "--out", str(tmp_path)]
    _one_line_error(capsys, argv + [x for s in sets for x in ("--set", s)], pattern)


def _files(tmp_path: Path) -> dict[str, Path]:
    good = tmp_path / "good.npz"
    np.savez(good, W=np.full((1, 4, 4), 0.25))
    files = {"cut.npz": good.read_bytes()[:100], "empty.npz": b"", "empty.npy": b"",
             "garbage.npy": bytes(range(256)) * 4}  # fmt: skip
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    nx.write_graphml(nx.cycle_graph(8), tmp_path / "ring.graphml")
    return {name: tmp_path / name for name in [*files, "ring.graphml"]}


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("cut.npz", r"cut\.npz: not a readable \.npz file \(File is not a zip file\)"),
        ("empty.npz", r"empty\.npz: not a readable \.npz file \(the file is empty\)"),
        ("empty.npy", r"empty\.npy: not a readable \.npy array \(the file is empty\)"),
        ("garbage.npy", r"garbage\.npy: .*not an array of numbers written by numpy's save"),
    ],
)
def test_broken_matrix_and_graph_files(tmp_path, capsys, name, pattern):
    path = _files(tmp_path)[name]
    _one_line_error(capsys, ["topology", "describe", str(path)], pattern)
    cfg = str(ROOT / "configs/synthetic/dfedem.yaml")
    key = "time_varying: {kind: periodic, file: F}" if name.endswith(".npz") else "graph: F"
    spec = "schedule={" + key.replace("F", str(path)) + "}"
    out = ["--out", str(tmp_path / "run"), "--quiet"]
    _one_line_error(capsys, ["run", cfg, *SMALL, "--set", spec, *out], pattern)


def test_a_graph_of_another_size_says_what_n_is(tmp_path, capsys):
    """6 clients, a ring of 8 in a file: 'n is 5' (the demo holds a client out) said nothing
    of where 5 came from."""
    ring = _files(tmp_path)["ring.graphml"]
    argv = ["run", *SMALL, "--set", f"schedule={{graph: {ring}}}", "--out", str(tmp_path / "r")]
    says = r"has 8 nodes but n is 5 \(the run's training peers: its clients less those data"
    _one_line_error(capsys, argv, says + r"\.unseen_fraction holds out\)")


def test_an_em_graph_of_another_size_says_its_n_is_its_workers(tmp_path, capsys):
    """EM reads no data.* key: its n is expfam.clients."""
    (tmp_path / "tri.txt").write_text("0 1\n1 2\n2 0\n")
    argv = ["run", str(ROOT / "configs/expfam/gmm2d_fedem.yaml"), "--set",
            "algorithm.name=gossip_fedem_em", "--set", f"schedule={{graph: {tmp_path}/tri.txt}}",
            "--out", str(tmp_path / "r")]  # fmt: skip
    _one_line_error(capsys, argv, r"has 3 nodes but n is \d+ \(the run's training peers: its "
                                  r"workers, expfam.clients\)$")  # fmt: skip


def test_a_graph_file_where_a_schedule_file_goes_says_where_it_goes(tmp_path, capsys):
    files = _files(tmp_path)
    cfg = str(ROOT / "configs/synthetic/dfedem.yaml")
    for name, key in [("ring.graphml", "graph: FILE"), ("empty.npz", "time_varying: ")]:
        argv = ["run", cfg, *SMALL, "--set", f"schedule={files[name]}", "--out", str(tmp_path)]
        _one_line_error(capsys, argv, f"is not a schedule file .*{re.escape(key)}")


def test_a_missing_graph_file_is_said_missing(tmp_path, capsys):
    argv = ["topology", "describe", str(tmp_path / "typo.npz")]
    _one_line_error(capsys, argv, r"not found: .*typo\.npz$")


def test_an_empty_fmmc_cache_file_is_solved_again(tmp_path):
    (tmp_path / "w.npy").write_bytes(b"")
    u, v = np.array([0, 1, 0]), np.array([1, 2, 2])  # a triangle
    assert _cached_fmmc(tmp_path / "w.npy", 3, u, v) is None


@pytest.mark.parametrize(("w", "kept"), [
    ([1 / 3, 1 / 3, 1 / 3], True),  # the triangle's fastest-mixing weights
    ([1 / 3, 1 / 3, 1 / 3 + 1e-7], True),  # the solver's noise (cleaned up after the read)
    ([0.502, 0.5, 0.5], True),  # SCS at its iteration cap: a node's weights at 1.002
    ([0.6, 0.6, 0.6], False),  # each node's weights sum past 1: another rho, unsaid
    ([np.nan, 0.2, 0.2], False),  # was blamed on the spec's graph ("entry is not finite")
    ([-0.2, 0.3, 0.3], False),
])  # fmt: skip
def test_cached_fmmc_weights_that_are_no_weights_are_solved_again(tmp_path, w, kept):
    np.save(tmp_path / "w.npy", np.array(w))
    got = _cached_fmmc(tmp_path / "w.npy", 3, np.array([0, 1, 0]), np.array([1, 2, 2]))
    assert (got is not None) == kept


@pytest.mark.parametrize(
    ("sets", "pattern"),
    [
        # every client's 50+ samples went to validation: NaN, then blamed on the lr
        (["data.val_fraction=0.999"], r"client 0 has no training sample \(nor do 5 more\)"),
        # the LSTM cast the features to token ids (all 0) and trained on nothing
        (["model.name=lstm"], r"model.name 'lstm' reads token ids .* shape \(150,\)"),
        (["data.noise_std=.nan"], r"noise_std must be a number >= 0, got nan"),
        (["data.noise_std=.inf"], r"noise_std must be a number >= 0, got inf"),
        (["data.cache_dir=5"], r"synthetic: option 'cache_dir' must be a folder \(got 5\)"),
        # pathlib's RuntimeError: a traceback
        (["data.cache_dir=~no_such_user_x/c"], r"'data.cache_dir': cannot expand '~no_such_us"),
    ],
)
def test_runs_refused_before_training(tmp_path, capsys, sets, pattern):
    argv = ["run", str(ROOT / "configs/synthetic/fedavg.yaml"), *SMALL, "--quiet"]
    argv += [x for s in sets for x in ("--set", s)] + ["--out", str(tmp_path / "run")]
    _one_line_error(capsys, argv, pattern)
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize(
    ("sets", "pattern"),
    [
        (["rule.lr=5"], r"rule.lr is set but rule 'average' does not read it \(it reads no rule"),
        (["rule.name=fedavgm", "rule.beta2=0.5"], r"'fedavgm' .* reads rule.lr, rule.momentum"),
        (["rule.tol1=0.1"], r"rule.tol1 is for clustered\)"),
        (["line_search.c=0.5"], r"line_search.c are for FedLi-LS's line search"),
        (["rule.name=fedli_ls", "algorithm.momentum=0.9"], r"line search .* takes plain steps"),
        # the search sets the steps: a schedule went unread, unsaid
        (["rule.name=fedli_ls", "algorithm.lr_decay=[0.5]"], r"lr_decay' is \[0.5\] but the line"),
        (["algorithm.mu=5"], r"'algorithm.mu' is 5.0 but 'fedavg' has no proximal term"),
        (["pefll.lr=0.1"], r"pefll.lr are for algorithm 'pefll'"),
        (["algorithm.components=5"], r"'algorithm.components' is 5 but 'fedavg' trains one model"),
        (["algorithm.client_weighting=gossip"], r"'fedavg' does not gossip"),
        (["algorithm.name=local", "aggregation=uniform"], r"'local' has no hub that averages"),
        (
            ["algorithm.name=dfedem", "schedule={graph: ring}", "aggregation=uniform"],
            r"'dfedem' has no hub that averages",
        ),
        (
            ["algorithm.q_smoothing=0.5"],
            r"'algorithm.q_smoothing' is 0.5 but 'fedavg' does not "
            r"read it \(the mixtures' loss weights",
        ),
        (["algorithm.pi_init=random"], r"'algorithm.pi_init' is 'random' but 'fedavg' does not"),
        (["algorithm.name=apfl", "algorithm.inner_steps=9"], r"inner_steps' is 9 but 'apfl'"),
        (["algorithm.name=pfedme", "algorithm.alpha_lr=0.5"], r"alpha_lr' is 0.5 but 'pfedme'"),
        (["algorithm.personal_lr=0.5"], r"personal_lr' is 0.5 but 'fedavg' does not read it"),
        (
            ["algorithm.local_steps=2", "algorithm.local_epochs=3"],
            r"'algorithm.local_epochs' is 3 but algorithm.local_steps \(2\) sets the round's",
        ),
        (["eval.unseen_em=one_step"], r"'one_step' but 'fedavg' fits no mixture weights"),
        (
            ["algorithm.name=fedem", "algorithm.components=1", "eval.unseen_em=one_step"],
            r"'one_step' but 'fedem' fits no mixture weights \(M = 1\)$",
        ),
        # each ran as if unset: no mixture weights with M = 1, no schedule on a server
        (
            ["algorithm.name=fedem", "algorithm.components=1", "algorithm.q_smoothing=0.5"],
            r"'algorithm.q_smoothing' is 0.5 but 'fedem' with algorithm.components 1 has no",
        ),
        (
            ["algorithm.name=fedem", "algorithm.components=1", "algorithm.pi_init=random"],
            r"'algorithm.pi_init' is 'random' but 'fedem' with algorithm.components 1",
        ),
        (["check_schedule=false"], r"'check_schedule' is false but 'fedavg' builds no gossip"),
        (
            ["algorithm.name=fedem", "data.unseen_fraction=0", "eval.unseen_em=one_step"],
            r"'eval.unseen_em' is 'one_step' but the data holds no unseen clients",
        ),
    ],
)
def test_keys_no_part_of_the_run_reads_are_refused(tmp_path, capsys, sets, pattern):
    """Each ran FedAvg (or the algorithm named) to the bit, the key unheeded."""
    argv = ["run", str(ROOT / "configs/synthetic/fedavg.yaml"), *SMALL, "--out", str(tmp_path)]
    _one_line_error(capsys, argv + [x for s in sets for x in ("--set", s)], pattern)


@pytest.mark.parametrize(
    ("sets", "pattern"),
    [
        (
            ["aggregation=uniform"],
            r"'aggregation' is 'uniform' but 'fedem_em' does not read "
            r"it \(it is for the hub's average",
        ),
        (["eval.finetune_epochs=2"], r"'eval.finetune_epochs' is 2 but 'fedem_em'"),
        (
            ["eval.unseen_em=one_step"],
            r"'eval.unseen_em' is 'one_step' but 'fedem_em' .* "
            r"unseen clients: fedem, dfedem\)$",
        ),
        (["expfam.k_in=3"], r"'expfam.k_in' is 3 but this run does not read it \(it is for VR"),
        (["expfam.pca=5"], r"'expfam.pca' is 5 .* for expfam.data fashion_mnist\)$"),
        (["expfam.rank=3"], r"'expfam.rank' is 3 .* \(it is for expfam.model imputation\)$"),
    ],
)
def test_keys_an_em_run_does_not_read_are_refused(tmp_path, capsys, sets, pattern):
    """Each gave the EM run's numbers to the bit, the key unheeded. Set to what the run does
    anyway (no fine-tuning), a key passes: a sweep may set it for every config."""
    argv = ["run", str(ROOT / "configs/expfam/gmm2d_fedem.yaml"), "--set", "rounds=1", "--out",
            str(tmp_path)]  # fmt: skip
    _one_line_error(capsys, argv + [x for s in sets for x in ("--set", s)], pattern)
    from gossip_pfl.config import load_config

    for noop in ("eval.finetune_epochs=0", "aggregation=size", "eval.unseen_em=converge"):
        load_config(ROOT / "configs/expfam/gmm2d_fedem.yaml", [noop])


@pytest.mark.parametrize(
    "sets",
    [["rule.lr=5"], ["algorithm.name=fedem", "data.unseen_fraction=0", "eval.unseen_em=one_step"]],
)
def test_a_run_made_before_the_unread_keys_check_resumes(tmp_path, monkeypatch, sets):
    """Its checkpoint's config holds the key, which a resume must not change (the second is
    checked where the data is known, by the trainer)."""
    from gossip_pfl import config
    from gossip_pfl.loop import RoundLoop
    from gossip_pfl.train import Trainer

    cfg, out = str(ROOT / "configs/synthetic/fedavg.yaml"), str(tmp_path / "run")
    argv = ["run", cfg, *SMALL, "--quiet", "--no-plots", "--out", out]
    argv += [x for s in sets for x in ("--set", s)]
    with monkeypatch.context() as m:
        m.setattr(config, "_check_read", lambda cfg, spec: None)  # as before the checks
        m.setattr(Trainer, "run", RoundLoop.run)
        assert main(argv) == 0
    assert main(["run", "--resume", out, "--set", "rounds=2", "--quiet", "--no-plots"]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["rounds"] == 2


def test_em_reads_only_the_algorithms_name(tmp_path, capsys):
    argv = ["run", str(ROOT / "configs/expfam/gmm2d_fedem.yaml"), "--set", "algorithm.lr=5",
            "--out", str(tmp_path)]  # fmt: skip
    _one_line_error(capsys, argv, r"algorithm.lr: '\w+' reads only algorithm.name .*expfam")


def test_keys_the_run_reads_are_taken(tmp_path):
    argv = ["run", str(ROOT / "configs/synthetic/fedavg.yaml"), *SMALL, "--quiet", "--no-plots"]
    for sets in (["rule.name=fedadam", "rule.lr=0.1", "rule.tau=0.01"],
                 ["algorithm.name=fedprox", "algorithm.mu=0.5"],
                 ["aggregation=uniform", "algorithm.components=1"],
                 ["algorithm.name=dfedem", "schedule={graph: ring}",
                  "algorithm.client_weighting=none"]):  # fmt: skip
        out = ["--out", str(tmp_path / sets[0])]
        assert main(argv + [x for s in sets for x in ("--set", s)] + out) == 0


def test_an_empty_out_is_refused_not_replaced_by_the_configs(capsys):
    """An empty path (a script's unset $RUN_DIR) is refused where a path is read: `run
    --resume ''` trained the demo from scratch, `merge ''` merged the current folder, `plot
    --out ''` and `consensus --out ''` wrote elsewhere than asked."""
    cfg = str(ROOT / "configs/synthetic/p2p_small.yaml")
    spec = str(ROOT / "configs/topologies/ring16.yaml")
    for argv, name in [(["run", cfg, "--out", ""], "--out"),
                       (["peers-local", cfg, "--out", ""], "--out"),
                       (["run", "--resume", ""], "--resume"),
                       (["peers-local", "--resume", ""], "--resume"),
                       (["merge", ""], "run_dir"),
                       (["plot", ""], "RUN_DIR"),
                       (["plot", "runs/x", "--out", ""], "--out"),
                       (["consensus", spec, "--out", ""], "--out"),
                       (["topology", "export", spec, "--rounds", "2", "-o", ""],
                        "-o/--output")]:  # fmt: skip
        with pytest.raises(SystemExit) as stop:  # (argparse's exit)
            main(argv)
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and len(err.splitlines()) == 1, err
        assert f"argument {name}: an empty path" in err, err


@pytest.mark.parametrize(
    ("sets", "pattern"),
    [
        # a kill past the last round never fired: the run did not test what it said
        (["runtime.transport=zmq", "runtime.faults.kill=[{id: 1, round: 3}]"],
         r"kill rounds must be < rounds = 3"),
        (["algorithm.name=clustered", "rule.tol1=-1"], r"'rule.tol1' must be >= 0"),
        # dim 10^9 was killed for memory with no message
        (["data.dim=1000000000"], r"at least n_clients x \(50 \+ n_test\) x dim x 4 bytes = "
         r"300 x 5,050 x 1,000,000,000 x 4 = .* GiB of samples"),
        # (was told as "schedule has n = abc but the run has 300 training peers")
        (["algorithm.name=dfedem", "schedule={graph: ring, n: abc}", "data.n_clients=6",
          "data.n_test=20"],  # (checked after the data: the full draw wrote 900 MB)
         r"'schedule.n' must be an int, got 'abc'"),
    ],
)  # fmt: skip
def test_settings_that_cannot_run_as_asked(tmp_path, capsys, sets, pattern):
    argv = ["run", str(ROOT / "configs/synthetic/fedavg.yaml"), "--set", "rounds=3"]
    argv += [x for s in sets for x in ("--set", s)] + ["--out", str(tmp_path / "run")]
    _one_line_error(capsys, argv, pattern)


def test_a_resume_with_other_clients_names_the_key_not_the_shape(tmp_path, capsys):
    cfg, out = str(ROOT / "configs/synthetic/fedavg.yaml"), str(tmp_path / "run")
    assert main(["run", cfg, *SMALL, "--quiet", "--no-plots", "--out", out]) == 0
    argv = ["run", "--resume", out, "--set", "rounds=3", "--set", "data.n_clients=7"]
    _one_line_error(capsys, argv, r"keys differ: data.n_clients; the checkpoint's: "
                    r"data.n_clients=6\)$")  # fmt: skip


def test_complex_matrices_are_refused_not_cast(tmp_path, capsys):
    np.save(tmp_path / "a.npy", np.ones((3, 3)) + 1j)
    np.savez(tmp_path / "w.npz", W=np.full((1, 3, 3), 1 / 3) + 0j)
    for name, what in (("a.npy", "adjacency matrix"), ("w.npz", "W")):
        argv = ["topology", "describe", str(tmp_path / name)]
        _one_line_error(capsys, argv, f"{what} must be real, got complex numbers")


def test_a_peer_to_peer_folder_is_not_offered_to_run_resume(tmp_path, capsys):
    """`run --out` on a peers-local folder offered --resume, which then said its config file
    was not found."""
    (tmp_path / "peers" / "0").mkdir(parents=True)
    (tmp_path / "peers.yaml").write_text("0: 127.0.0.1:5000\n")
    (tmp_path / "summary.json").write_text("{}")
    cfg = str(ROOT / "configs/synthetic/fedavg.yaml")
    taken = (r"holds another run \(summary.json\); choose another --out, continue it with "
             r"gossip-pfl peers-local --resume .*, or replace it with --overwrite")  # fmt: skip
    _one_line_error(capsys, ["run", cfg, "--out", str(tmp_path)], taken)
    peers = rf"a peer-to-peer run \(peers-local\); continue it with gossip-pfl peers-local " \
            rf"--resume {re.escape(str(tmp_path))}$"  # fmt: skip
    _one_line_error(capsys, ["run", "--resume", str(tmp_path)], peers)
    # and peers-local --resume: what it cannot continue, and what it does not take
    cfg = str(ROOT / "configs/synthetic/p2p_small.yaml")
    for argv, message in [
        (["--resume", str(tmp_path)], r"process 0 never started \(no .*peers/0/config.yaml\)"),
        (["--resume", str(tmp_path / "peers")], "not a peers-local run's folder"),
        ([cfg, "--resume", str(tmp_path), "-n", "2"], "drop CONFIG, -n"),
        ([cfg], r"peers-local needs CONFIG and -n N \(or --resume RUN_DIR\)"),
    ]:
        _one_line_error(capsys, ["peers-local", *argv], message)
    # while its launcher still runs (it holds the folder), neither a new launch nor a run
    # written over it deletes its processes' folders
    from gossip_pfl.rundir import RunLock

    for held in (tmp_path, tmp_path / "peers" / "0"):  # its launcher, or (a launcher
        lock = RunLock(held).acquire()  # stopped alone) a process that still runs
        try:
            for argv in (["peers-local", cfg, "-n", "2"], ["run", cfg, "--quiet", *SMALL]):
                _one_line_error(capsys, [*argv, "--out", str(tmp_path), "--overwrite"],
                                "is in use by another run")  # fmt: skip
            # and merge: a run still going was merged as if it had ended
            _one_line_error(capsys, ["merge", str(tmp_path)], "is in use by another run")
        finally:
            lock.release()
    assert (tmp_path / "peers" / "0").is_dir() and (tmp_path / "peers.yaml").is_file()
    # written over: the processes' folders go (merge put them over the new run's results, and
    # its --resume was refused as a peer-to-peer run's)
    assert main(["run", cfg, "--out", str(tmp_path), "--overwrite", "--quiet", "--no-plots",
                 *SMALL]) == 0  # fmt: skip
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["checkpoint.pt", "config.yaml", "metrics.jsonl", "summary.json"]
    _one_line_error(capsys, ["merge", str(tmp_path)], "no process outputs")


def test_a_folder_without_a_checkpoint_is_not_offered_to_resume(tmp_path, capsys):
    """A run killed before any checkpoint (checkpoint_every 0) left its metrics: a new run
    there was told to continue it with --resume, which found no checkpoint."""
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n')
    cfg = str(ROOT / "configs/synthetic/fedavg.yaml")
    _one_line_error(capsys, ["run", cfg, "--out", str(tmp_path)],
                    r"holds another run \(metrics.jsonl\); choose another --out or replace it "
                    r"with --overwrite$")  # fmt: skip


def test_the_lstm_takes_token_ids_stored_as_floats(tmp_path):
    """A user's own arrays (ids as float32) trained before the check; they still do."""
    from gossip_pfl.data.base import ClientData, FederatedDataset
    from gossip_pfl.models import check_model_reads

    x = np.arange(24, dtype=np.float32).reshape(6, 4) % 5
    y = x[:, -1].astype(np.int64)
    data = FederatedDataset("mine", [ClientData(x, y, x[:0], y[:0], x, y)], (4,), 5, "multiclass")
    check_model_reads("lstm", data)
    data.clients[0].x_train[0, 0] = 0.5  # not an id
    with pytest.raises(GossipError, match="reads token ids"):
        check_model_reads("lstm", data)


def test_a_dataset_folder_must_be_a_path(tmp_path, capsys):
    argv = ["run", str(ROOT / "configs/fashion_mnist/fedavg.yaml"), "--set", "data.root=[a]",
            "--out", str(tmp_path / "run")]  # fmt: skip
    _one_line_error(capsys, argv, r"fashion_mnist: option 'root' must be a folder \(got \['a'\]\)")


def test_thread_counts_past_the_cores_are_refused(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    with pytest.raises(GossipError, match=r"runtime.threads 9 is more than 4 x the 2 .*\(8\)"):
        threads.set_threads(9)
    monkeypatch.setenv("OMP_NUM_THREADS", "100000")
    with pytest.raises(GossipError, match=r"^OMP_NUM_THREADS 100000 is more than 4 x the 2"):
        threads.set_threads(0)


def test_export_refuses_more_rounds_than_memory_holds(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(threads, "physical_memory", lambda: 10 * 16 * 16 * 8)
    ring = str(ROOT / "configs/topologies/ring16.yaml")
    argv = ["topology", "export", ring, "--rounds", "11", "-o", str(tmp_path / "w.npz")]
    _one_line_error(capsys, argv, r"--rounds 11 x n\^2 = 16\^2 x 8 bytes = .* GiB of W")
    assert not (tmp_path / "w.npz").exists()
    assert main([*argv[:3], "--rounds", "10", "-o", str(tmp_path / "w.npz")]) == 0  # it fits


def test_out_of_memory_is_one_line(capsys, monkeypatch):
    def too_big(args):
        raise MemoryError("Unable to allocate 559. GiB for an array with shape (10,)")

    monkeypatch.setattr(cli.argparse.ArgumentParser, "parse_args", lambda *a, **k: _Args(too_big))
    code = main(["run"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        "gossip-pfl: error: out of memory: Unable to allocate 559. GiB for an array with "
        "shape (10,) (a smaller problem fits)"
    )


class _Args:
    def __init__(self, func):
        self.func = func


@pytest.mark.parametrize("text", ["{bad", "[1]", '{"wall_seconds": "x"}', "{}"])
def test_merge_names_a_damaged_process_summary(tmp_path, text):
    path = tmp_path / "summary.json"
    path.write_text(text)
    with pytest.raises(GossipError, match=re.escape(str(path))):
        cli_peer._wall_seconds(path)
    path.write_text(json.dumps({"wall_seconds": 1.5}))
    assert cli_peer._wall_seconds(path) == 1.5


def _peer_run(tmp_path: Path) -> Path:
    """A peer-to-peer run's outputs as merge reads them: two processes of two peers each."""
    run = tmp_path / "run"
    for k, peers in enumerate(([0, 1], [2, 3])):
        folder = run / "peers" / str(k)
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text("algorithm: {name: dfedem}\nrounds: 4\n")
        row = {"round": 4, "peers": peers, "bytes_sent": 10, "messages_sent": 2,
               "peer_train_accuracy": [0.5, 1.0], "peer_train_loss": [1.0, 2.0],
               "peer_train_count": [10, 30], "peer_test_accuracy": [0.25 * k, 0.5],
               "peer_test_loss": [1.0, 1.0], "peer_test_count": [5, 5]}  # fmt: skip
        (folder / "metrics.jsonl").write_text(json.dumps(row) + "\n")
        link = {"round": 0, "phase": 0, "links": [1 - k], "lost": [], "before": [1.0, 2.0],
                "change": [0.0, 0.0]}  # fmt: skip
        (folder / "links.jsonl").write_text(json.dumps(link) + "\n")
    return run


def _edit(path: Path, **changes) -> None:
    row = json.loads(path.read_text())
    row.update(changes)
    path.write_text(json.dumps(row) + "\n")


@pytest.mark.parametrize(
    "file, changes, says",
    [
        (
            "1/metrics.jsonl",
            {"peers": [0, 1]},
            r"round 4: peer 0 is reported by process 0 and by "
            r"process 1$",
        ),
        ("1/metrics.jsonl", {"peers": [-1, 3]}, r"1/metrics.jsonl, round 4: peers is \[-1, 3\]"),
        ("1/metrics.jsonl", {"peers": [2, 2]}, r"peers is \[2, 2\], not a list of distinct"),
        ("1/metrics.jsonl", {"round": "4"}, r"1/metrics.jsonl: a row's round is '4', not a round"),
        (
            "0/metrics.jsonl",
            {"peer_test_accuracy": [0.5]},
            r"0/metrics.jsonl, round 4: peer_test_accuracy is not 2 numbers \(one per peer\)$",
        ),
        ("0/metrics.jsonl", {"peer_train_count": None}, r"peer_train_count is not 2 numbers"),
        ("0/metrics.jsonl", {"bytes_sent": "x"}, r"round 4: bytes_sent is 'x', not a count$"),
        ("0/metrics.jsonl", {"peer_pi": [[0.5, 0.5]]}, r"peer_pi is not 2 lists of mixture"),
        ("1/links.jsonl", {"change": [0.0]}, r"1/links.jsonl, round 0: change is not 2 numbers"),
        ("1/links.jsonl", {"lost": None}, r"round 0: lost is None, not a list of ids$"),
        ("1/links.jsonl", {"phase": None}, r"round 0: a row without a round and phase number$"),
    ],
)
@pytest.mark.filterwarnings("ignore:merge. no consensus distance")  # (no checkpoints here)
def test_merge_names_a_damaged_process_row(tmp_path, file, changes, says):
    """A process's metrics or links row that merge cannot use is named by file, round and key
    (it was a KeyError or an IndexError; a peer reported by two processes was counted twice,
    a negative one overwrote another's entry)."""
    run = _peer_run(tmp_path)
    summary = cli_peer.merge(run)  # the undamaged run: the mean over its four peers
    assert summary["peers_reporting"] == 4 and summary["test_accuracy"] == pytest.approx(0.3125)
    assert summary["train_accuracy"] == pytest.approx((5 + 30 + 5 + 30) / 80)
    _edit(run / "peers" / file, **changes)
    with pytest.raises(GossipError, match=says):
        cli_peer.merge(run)


@pytest.mark.filterwarnings("ignore:merge. no consensus distance")
def test_merge_refuses_processes_that_ran_different_configs(tmp_path):
    """Processes started with different --set trained together and merged into one run's
    figures, exit 0: merge names the process and the keys (where each wrote aside)."""
    run = _peer_run(tmp_path)
    cfg = run / "peers" / "1" / "config.yaml"
    cfg.write_text(cfg.read_text() + "out: elsewhere\ncheckpoint_every: 7\n")
    cli_peer.merge(run)  # (its own folder and checkpoints, as a resume may set: no difference)
    cfg.write_text("algorithm: {name: dfedem, lr: 0.3}\nrounds: 4\n")
    with pytest.raises(GossipError, match=r"merge: process 1 ran another config than process 0 "
                                          r"\(keys differ: algorithm.lr\)$"):  # fmt: skip
        cli_peer.merge(run)


@pytest.mark.filterwarnings("ignore:merge. no consensus distance")
def test_merge_refuses_a_folder_for_a_metrics_file(tmp_path):
    """A folder where a process's metrics.jsonl should be read as no rows: the merge left that
    process's peers out and said nothing."""
    run = _peer_run(tmp_path)
    (run / "peers/1/metrics.jsonl").unlink()
    (run / "peers/1/metrics.jsonl").mkdir()
    with pytest.raises(GossipError, match=r"cannot read .*1/metrics.jsonl: not a file$"):
        cli_peer.merge(run)
    (run / "config.yaml").mkdir(exist_ok=True)
    (run / "peers/1/metrics.jsonl").rmdir()
    (run / "metrics.jsonl").mkdir()  # where the merged rows go
    with pytest.raises(GossipError, match=r"out: could not write .*run/metrics.jsonl"):
        cli_peer.merge(run)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--wait-round", "3"], "--wait-round 3 is a restart's option: add --resume"),
        (["--after-pid", "1"], "--after-pid 1 is a restart's option: add --resume"),
        (["--resume", "--wait-round", "-1"], "--wait-round -1: must be >= 0"),
    ],
)
def test_a_restarts_options_need_a_restart(flags, says, capsys):
    """A fresh `peer` ignored --wait-round and --after-pid."""
    argv = ["peer", str(ROOT / "configs/synthetic/dfedem.yaml"), "--id", "0", *flags]
    _one_line_error(capsys, argv, re.escape(says) + "$")


EXPORT = ["topology", "export", "--rounds", "2", "-o", "w.npz"]


@pytest.mark.parametrize("command", [["topology", "describe"], ["consensus"], EXPORT])
def test_a_spec_that_is_not_text_is_one_line(tmp_path, capsys, command):
    """A spec file with bytes that are not UTF-8 was a UnicodeDecodeError's traceback."""
    spec = tmp_path / "s.yaml"
    spec.write_bytes(b"n: 5\ngraph: ring\n\xff\xfe\n")
    argv = [*command[:2], str(spec), *command[2:]] if command[0] == "topology" else [
        *command, str(spec), "--out", str(tmp_path / "o")]  # fmt: skip
    _one_line_error(capsys, argv, re.escape(f"{spec}: not a text file (byte 17 is not UTF-8)"))


def test_describe_refuses_more_trials_than_window_positions(capsys):
    """A random schedule's p samples distinct window positions among 2^20: more trials was
    numpy's 'Cannot take a larger sample than population' after the scan."""
    spec = str(ROOT / "configs/topologies/ring16_link_failure.yaml")
    _one_line_error(capsys, ["topology", "describe", spec, "--trials", "1048577"],
                    r"trials must be at most 1,048,576 for a random schedule")  # fmt: skip


def test_consensus_names_each_schedule_once(tmp_path):
    """Names from file stems with -2, -3 for repeats, unique among all of them: a file named
    a-2 beside two named a gave two columns called a-2."""
    from gossip_pfl.cli_topology import _named

    names = [name for name, _ in _named(["x/a.yaml", "a-2.yaml", "y/a.yaml", "z/a.yaml"])]
    assert names == ["a", "a-2", "a-3", "a-4"]


def test_matching_refuses_weights_it_would_ignore():
    """A matching averages each matched pair with weight 1/2: weights: fmmc was accepted and
    never used."""
    from topologies import TopologyError
    from topologies.spec import schedule_from_spec

    spec = {"n": 8, "graph": "ring", "time_varying": {"kind": "matching"}}
    assert schedule_from_spec(spec).matrix(0).max() <= 1  # without weights it runs
    with pytest.raises(TopologyError, match="weights: time_varying matching fixes its own"):
        schedule_from_spec({**spec, "weights": "max_degree"})


def test_edge_list_ids_are_digits_only(tmp_path):
    """int() reads '1_0' as 10, so '1_0' and '10' were one node: such a token is a name."""
    from topologies import TopologyError
    from topologies.graphs import load_graph, node_labels

    f = tmp_path / "g.txt"
    f.write_text("1_0 1\n10 2\n1 2\n")
    assert sorted(node_labels(load_graph(f))) == ["1", "10", "1_0", "2"]
    f.write_text("0 1\n+1 2\n")  # a sign is still an id's
    assert load_graph(f).number_of_nodes() == 3
    folder = tmp_path / "d.txt"
    folder.mkdir()
    with pytest.raises(TopologyError, match=r"graph file .*d.txt is a folder, not a file"):
        load_graph(folder)


def test_plot_names_a_metric_that_is_not_a_number(tmp_path, capsys):
    """A string where a number should be was plotted as a gap, and nothing said."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"round": r, "test_accuracy": 0.5, "test_accuracy_p10": 0.4, "train_loss": 1.0,
             "model_bytes": 8 * r} for r in (1, 2)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plot", str(run), "--out", str(tmp_path / "plots")]) == 0
    rows[1]["test_accuracy"] = "high"
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    _one_line_error(capsys, ["plot", str(run), "--out", str(tmp_path / "plots")],
                    r"metrics.jsonl, round 2: test_accuracy is 'high', not a number$")  # fmt: skip


def test_torchs_out_of_memory_is_one_line(capsys, monkeypatch):
    """torch's CPU allocator raises a RuntimeError, not a MemoryError: its traceback ran 40
    lines. Another RuntimeError is still a bug's traceback."""
    import torch  # noqa: F401  (loaded, as in a run)

    def too_big(args):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't "
                           "allocate memory: you tried to allocate 60000000000 bytes.")  # fmt: skip

    monkeypatch.setattr(cli.argparse.ArgumentParser, "parse_args", lambda *a, **k: _Args(too_big))
    assert main(["run"]) == 2
    assert capsys.readouterr().err.strip() == (
        "gossip-pfl: error: out of memory: torch could not allocate 55.9 GiB (a smaller "
        "problem fits)"
    )

    def bug(args):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(cli.argparse.ArgumentParser, "parse_args", lambda *a, **k: _Args(bug))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main(["run"])


@pytest.mark.parametrize(
    ("sets", "pattern"),
    [
        (["out=''"], r"config key 'out' must name a folder, not be empty"),
        (
            ["data.unseen_fraction=0.01"],
            r"unseen_fraction 0.01 of 6 clients holds out none \(it "
            r"rounds to 0; more than 0.0833 holds out one\)",
        ),
        (["data.seed=-1"], r"synthetic: option 'seed' must be in \[0, 2\*\*63\) \(got -1\)"),
        # (the hint above named 0.5 for one client, and more than 0.5 then failed too)
        (
            ["data.n_clients=1", "data.unseen_fraction=0.5"],
            r"unseen_fraction 0.5 of 1 client: holding it out leaves none for training",
        ),
    ],
)
def test_runs_that_went_on_unsaid_are_refused(tmp_path, capsys, sets, pattern, monkeypatch):
    """out: '' wrote the run into the current folder; a held-out share that rounds to no
    client dropped the unseen clients' figures without a word."""
    monkeypatch.chdir(tmp_path)  # (where out: '' wrote)
    argv = ["run", str(ROOT / "configs/synthetic/fedavg.yaml"), *SMALL, "--out", str(tmp_path)]
    if sets == ["out=''"]:
        argv = argv[:-2]  # (the config's out, not --out)
    _one_line_error(capsys, argv + [x for s in sets for x in ("--set", s)], pattern)


@pytest.mark.parametrize("split", [[0.5, float("nan"), 0.5], [0.6, 0.2, None], ["a", "b", "c"],
                                   [[0.6], 0.2, 0.2], [0.8, 0.2, float("nan")]])  # fmt: skip
def test_a_split_of_anything_but_three_fractions_is_refused(split):
    """A NaN passed the sum check (the run used 0.5/0/0.5); None was a TypeError."""
    from gossip_pfl.data import partition

    with pytest.raises(GossipError, match=r"split must be three non-negative fractions"):
        partition._check_split(split, official_test=False)
    with pytest.raises(GossipError, match=r"dirichlet: alpha must be a finite number > 0, got inf"):
        partition.dirichlet(np.repeat(np.arange(4), 10), n_clients=4, alpha=float("inf"))


def test_numbers_written_with_an_exponent_are_numbers(tmp_path):
    """YAML 1.1 reads 4e-1 as a string: data options, participation and a schedule's p were
    refused as 'not a number' where the typed keys took it."""
    from gossip_pfl.config import load_config

    cfg = load_config(ROOT / "configs/synthetic/dfedem.yaml",
                      ["data.alpha=4e-1", "participation=5e-1",
                       "schedule={graph: erdos_renyi, graph_args: {p: 5e-1}}"])  # fmt: skip
    assert cfg.data.options["alpha"] == 0.4 and cfg.participation == 0.5
    assert cfg.schedule["graph_args"]["p"] == 0.5
    with pytest.raises(GossipError, match=r"--set schedule: .*\(key 'p' given twice\)"):
        load_config(ROOT / "configs/synthetic/dfedem.yaml", ["schedule={p: 1, p: 2}"])


@pytest.mark.parametrize(
    ("schedule", "pattern"),
    [
        ("{folder}", r"config key 'schedule': .* is a folder, not a schedule file$"),
        ("configs/topologies/lesmis.txt", r"lesmis.txt is not a schedule file \(YAML\); a spec "
                                          r"names it as \{graph: FILE\}$"),
        ("configs/synthetic/fedavg.yaml", r"schedule file \S*configs/synthetic/fedavg.yaml: "
                                          r"unknown key 'rounds'"),
    ],
)  # fmt: skip
def test_a_schedule_path_that_is_no_schedule_says_what_it_is(tmp_path, capsys, monkeypatch,
                                                             schedule, pattern):  # fmt: skip
    """A folder was 'not found', an edge list 'expected a mapping of keys, got str', and a run
    config's keys were refused without naming the file they came from."""
    monkeypatch.chdir(ROOT)  # (the paths as a user in the checkout writes them)
    argv = ["run", "configs/synthetic/dfedem.yaml", *SMALL, "--out", str(tmp_path / "run"),
            "--set", f"schedule={schedule.format(folder=tmp_path)}"]  # fmt: skip
    _one_line_error(capsys, argv, pattern)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"RANK": "1"}, r"RANK is set but WORLD_SIZE is not: start the ranks with torchrun"),
        ({"WORLD_SIZE": "2"}, r"WORLD_SIZE is set but RANK is not"),
        ({"RANK": "abc", "WORLD_SIZE": "2"}, r"RANK='abc' is not a whole number"),
        ({"RANK": "0", "WORLD_SIZE": "1.5"}, r"WORLD_SIZE='1.5' is not a whole number"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK=2 does not fit WORLD_SIZE=2 \(ranks are 0..1"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, r"RANK=-1 does not fit WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"RANK=0 does not fit WORLD_SIZE=0"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, r"WORLD_SIZE=2 needs MASTER_ADDR and a MASTER_PORT"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
         r"MASTER_PORT in 1..65535 \(got 'h' and '70000'\)"),
    ],
)  # fmt: skip
def test_a_launch_environment_that_cannot_be_a_group_is_one_line(env, says):
    """Each was a traceback (torch's ValueError), a wait of twice the timeout (a rank no
    group has), or a run of one process that printed nothing (RANK alone)."""
    from gossip_pfl.runtime.comm import world_from_env

    with pytest.raises(GossipError, match=says):
        world_from_env(env)
    assert world_from_env({}) == (0, 1)
    ok = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert world_from_env(ok) == (1, 2)


def test_a_rank_whose_group_never_forms_stops_within_the_timeout(tmp_path, capsys, monkeypatch):
    """Rank 1 of 2 started alone: one line naming the address and the timeout after about
    runtime.timeout_s (torch's store client tried twice: 2x the timeout, then a traceback)."""
    import time

    from gossip_pfl.cli_peer import free_ports

    (port,) = free_ports(1)
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    argv = ["run", str(ROOT / "configs/synthetic/fedavg.yaml"), *SMALL, "--out",
            str(tmp_path / "run"), "--set", "runtime.timeout_s=2"]  # fmt: skip
    start = time.monotonic()
    _one_line_error(capsys, argv, rf"rank 1: could not join the 2 ranks' group at 127.0.0.1:"
                                  rf"{port} within runtime.timeout_s = 2 s")  # fmt: skip
    assert time.monotonic() - start < 2 * 2


@pytest.mark.filterwarnings("ignore:merge. no consensus distance")
def test_merge_takes_a_null_peer_pi_as_no_weights(tmp_path):
    """A process's "peer_pi": null passed the row check (no weights) and then broke the
    merge (numpy's ValueError): the merged rows have no mixture weights, as without the key."""
    run = _peer_run(tmp_path)
    _edit(run / "peers" / "0" / "metrics.jsonl", peer_pi=None)
    _edit(run / "peers" / "1" / "metrics.jsonl", peer_pi=[[0.25, 0.75], [0.5, 0.5]])
    summary = cli_peer.merge(run)
    assert summary["peers_reporting"] == 4 and "mixture_weights" not in summary


def test_merge_gives_a_peer_without_test_samples_no_accuracy(tmp_path):
    """Its 0.0 stood in the merged client_test_accuracy (one process's run has null there),
    while the mean left it out."""
    run = _peer_run(tmp_path)
    _edit(run / "peers" / "1" / "metrics.jsonl", peer_test_count=[5, 0])
    with pytest.warns(UserWarning, match="no consensus distance"):  # (no checkpoints here)
        summary = cli_peer.merge(run)
    assert summary["client_test_accuracy"] == [0.0, 0.5, 0.25, None]
    assert summary["test_accuracy"] == pytest.approx((0.0 + 0.5 + 0.25) / 3)
