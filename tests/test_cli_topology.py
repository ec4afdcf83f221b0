"""End to end: ``gossip-pfl consensus`` and ``gossip-pfl topology {describe,export}``."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from gossip_pfl import cli_topology
from gossip_pfl.cli import main
from topologies.analysis import ExplicitSchedule

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "topologies"
RING = str(CONFIGS / "ring16.yaml")
EXP = str(CONFIGS / "exp16.yaml")

DESCRIBE_KEYS = [
    "n",
    "edges_per_round",
    "max_degree",
    "doubly_stochastic",
    "symmetric",
    "nonnegative",
    "rho",
    "tau",
    "contraction",
    "is_random",
    "period",
    "p",
]
ROW_KEYS = {
    "name",
    "spec",
    "n",
    "rho",
    "tau",
    "messages_per_round",
    "rounds_to_1e-3",
    "rounds_to_1e-6",
    "final_error",
    "csv",
    "json",
    "png",
}


@pytest.fixture
def spec_module():
    return pytest.importorskip("topologies.spec")


def ring_matrix(n: int) -> np.ndarray:
    return (np.eye(n) + np.roll(np.eye(n), 1, 1) + np.roll(np.eye(n), -1, 1)) / 3


def matching(n: int, offset: int) -> np.ndarray:
    W = np.eye(n)
    for i in range(offset, n + offset, 2):
        a, b = i % n, (i + 1) % n
        W[[a, a, b, b], [a, b, a, b]] = 0.5
    return W


@pytest.fixture
def fake_load(monkeypatch):
    """Spec files named after small explicit schedules, without the spec module."""
    schedules = {
        "ring8": ExplicitSchedule([ring_matrix(8)]),
        "matchings8": ExplicitSchedule([matching(8, 0), matching(8, 1)]),
        "half8": ExplicitSchedule([matching(8, 0)]),
    }
    monkeypatch.setattr(cli_topology, "load", lambda path: schedules[Path(path).stem])
    return schedules


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gossip-pfl: error: "), err
    return err


# --------------------------------------------------------------------------- consensus


def test_consensus_table_and_files(tmp_path, capsys, fake_load):
    out = tmp_path / "c"
    assert (
        main(["consensus", "ring8.yaml", "matchings8.yaml", "--rounds", "40", "--out", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("schedule"))
    assert header.split() == [
        "schedule",
        "n",
        "rho",
        "tau",
        "msgs/round",
        "to",
        "1e-3",
        "to",
        "1e-6",
        "final",
        "error",
    ]
    assert "ring8" in text and "matchings8" in text and str(out / "consensus.png") in text
    rows = list(csv.reader(open(out / "consensus.csv")))
    assert rows[0] == ["round", "ring8", "matchings8"] and len(rows) == 42
    assert float(rows[1][1]) == 1.0
    doc = json.loads((out / "consensus.json").read_text())
    assert doc["rounds"] == 40 and len(doc["schedules"][0]["errors"]) == 41
    assert (out / "consensus.png").stat().st_size > 1000


def test_consensus_json_only(tmp_path, capsys, fake_load):
    args = ["consensus", "ring8.yaml", "matchings8.yaml", "ring8.yaml", "--rounds", "300"]
    assert main(args + ["--out", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)  # nothing but JSON on stdout
    assert [r["name"] for r in rows] == ["ring8", "matchings8", "ring8-2"]
    assert all(set(r) == ROW_KEYS for r in rows)
    ring = rows[0]
    rho = 1 / 3 + 2 / 3 * np.cos(2 * np.pi / 8)
    assert ring["rho"] == pytest.approx(rho) and ring["tau"] == 1 and ring["n"] == 8
    assert ring["messages_per_round"] == 16
    assert ring["rounds_to_1e-6"] <= np.ceil(np.log(1e-6) / np.log(rho))
    assert rows[1]["tau"] == 2 and rows[1]["rho"] == pytest.approx(1)
    assert Path(ring["csv"]).is_file() and Path(ring["png"]).is_file()


def test_consensus_not_connected_within_horizon(tmp_path, capsys, fake_load):
    assert main(["consensus", "half8.yaml", "--out", str(tmp_path)]) == 2
    err = one_error_line(capsys)
    assert "half8: schedule is not connected within the horizon of 100 rounds" in err
    assert "increase --horizon" in err
    assert main(["consensus", "matchings8.yaml", "--horizon", "1", "--out", str(tmp_path)]) == 2
    assert "(no tau <= 1)" in one_error_line(capsys)


def test_consensus_of_one_node_names_the_spec(tmp_path, capsys, spec_module):
    one = tmp_path / "one.yaml"
    one.write_text("n: 1\ngraph: complete\n")
    assert main(["consensus", str(one), RING, "--out", str(tmp_path)]) == 2
    assert f"{one}: n = 1: a single node is always in consensus" in one_error_line(capsys)


def test_consensus_missing_file(tmp_path, capsys, spec_module):
    assert main(["consensus", str(tmp_path / "nope.yaml"), "--out", str(tmp_path)]) == 2
    assert "nope.yaml" in one_error_line(capsys)
    assert main(["topology", "describe", str(tmp_path)]) == 2  # a folder
    one_error_line(capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["consensus", "--rounds", "0"],
        ["consensus", "--rounds", "ten"],
        ["consensus", "--horizon", "-3"],
        ["topology"],
        ["topology", "export", "x.yaml", "-o", "w.npz"],
        ["topology", "describe"],
        ["consensus", "--seed", "-1"],  # was NumPy's traceback
        ["topology", "describe", "configs/topologies/ring16_link_failure.yaml", "--seed", "-2"],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error: " in err and "--help)" in err, err


def test_consensus_real_specs(tmp_path, capsys, spec_module):
    out = tmp_path / "real"
    assert main(["consensus", RING, EXP, "--rounds", "60", "--out", str(out), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["ring16"]["rho"] == pytest.approx(1 / 3 + 2 / 3 * np.cos(2 * np.pi / 16))
    assert rows["ring16"]["rounds_to_1e-6"] is None  # the ring is slow: rho ~ 0.95
    assert rows["exp16"]["tau"] == 4 and rows["exp16"]["rounds_to_1e-6"] == 4
    assert rows["exp16"]["messages_per_round"] == 16


def test_consensus_all_example_specs(tmp_path, capsys, spec_module):
    specs = sorted(str(p) for p in CONFIGS.glob("*.yaml"))
    if any("fmmc" in p for p in specs):
        pytest.importorskip("cvxpy")
    assert main(["consensus", *specs, "--rounds", "30", "--out", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == len(specs) >= 6
    assert all(r["final_error"] < 1 for r in rows)


def test_consensus_demo(tmp_path, capsys, spec_module):
    assert main(["consensus", "--rounds", "80", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("no SPEC given: built-in demo")
    for name in cli_topology.DEMO_SPECS:
        assert name in text
    assert (tmp_path / "consensus.csv").is_file()


def test_malformed_yaml(tmp_path, capsys, spec_module):
    bad = tmp_path / "bad.yaml"
    bad.write_text("n: [16\ngraph: ring\n")
    assert main(["topology", "describe", str(bad)]) == 2
    one_error_line(capsys)
    worse = tmp_path / "worse.yaml"
    worse.write_text("n: 16\ngraph: no_such_family\n")
    assert main(["consensus", str(worse), "--out", str(tmp_path)]) == 2
    one_error_line(capsys)


# --------------------------------------------------------------------------- topology


def test_describe_json_keys(capsys, fake_load):
    assert main(["topology", "describe", "ring8.yaml", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert list(info) == DESCRIBE_KEYS
    assert info["tau"] == 1 and info["doubly_stochastic"] is True and info["max_degree"] == 2


def test_describe_text(capsys, fake_load):
    assert main(["topology", "describe", "matchings8.yaml", "--horizon", "10"]) == 0
    lines = capsys.readouterr().out.splitlines()
    fields = dict(line.split(None, 1) for line in lines[1:])
    assert list(fields) == DESCRIBE_KEYS
    assert fields["tau"] == "2" and fields["period"] == "2" and fields["rho"] == "1"


def test_describe_not_connected(capsys, fake_load):
    assert main(["topology", "describe", "half8.yaml"]) == 2
    assert "not connected within the horizon" in one_error_line(capsys)


def test_describe_real_spec(capsys, spec_module):
    assert main(["topology", "describe", EXP, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert list(info) == DESCRIBE_KEYS
    assert info["tau"] == 4 and info["contraction"] == pytest.approx(0, abs=1e-9)
    assert info["edges_per_round"] == 16 and info["symmetric"] is False


def test_export(tmp_path, capsys, spec_module):
    out = tmp_path / "sub" / "W.npz"
    assert main(["topology", "export", RING, "--rounds", "3", "-o", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    with np.load(out) as z:
        W = z["W"]
    assert W.shape == (3, 16, 16)
    np.testing.assert_allclose(W[0], ring_matrix(16))


def test_export_names_the_file_it_writes(tmp_path, capsys):
    """NumPy appends .npz to a name without it; the message used to name the other file."""
    assert main(["topology", "export", RING, "--rounds", "2", "-o", str(tmp_path / "W")]) == 0
    assert f"wrote {tmp_path / 'W.npz'}:" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["W.npz"]
    (tmp_path / "w.yaml").write_text("")  # a file where a folder would go: "File exists"
    assert (
        main(["topology", "export", RING, "--rounds", "2", "-o", str(tmp_path / "w.yaml" / "x")])
        == 2
    )
    assert f"{tmp_path / 'w.yaml'} is a file, not a folder" in capsys.readouterr().err


def test_export_into_a_folder_writes_the_specs_name_in_it(tmp_path, capsys):
    """`-o DIR` and `-o NEW/` wrote DIR.npz and NEW.npz beside the folder; into the spec's
    own folder, an exported .npz replaced the file it was read from."""
    assert main(["topology", "export", RING, "--rounds", "2", "-o", str(tmp_path)]) == 0
    assert f"wrote {tmp_path / 'ring16.npz'}:" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["ring16.npz"]
    new = tmp_path / "new"
    assert main(["topology", "export", RING, "--rounds", "2", "-o", f"{new}/"]) == 0
    assert [p.name for p in new.iterdir()] == ["ring16.npz"] and not new.with_suffix(
        ".npz"
    ).exists()
    saved = tmp_path / "ring16.npz"
    before = saved.read_bytes()
    argv = ["topology", "export", str(saved), "--rounds", "1", "-o", str(tmp_path)]
    assert main(argv) == 2 and saved.read_bytes() == before
    assert "it is the schedule being exported" in capsys.readouterr().err


def test_describe_says_its_rates_are_against_an_average_the_rounds_move(tmp_path, capsys):
    """A hub weighted by uneven sizes is not doubly stochastic: its windows move the plain
    average, their distance to it grows (p < 0) and the table says why under it."""
    spec = tmp_path / "hub.yaml"
    spec.write_text("graph: server\nn: 6\ngraph_args: {participation: 0.5, "
                    "sizes: [1, 1, 1, 1, 1, 100]}\n")  # fmt: skip
    for path, moved in ((spec, True), (RING, False)):
        assert main(["topology", "describe", str(path)]) == 0
        out = capsys.readouterr().out
        fields = dict(line.split(None, 1) for line in out.splitlines()[1:] if line[2] != "(")
        assert (float(fields["p"]) < 0) is moved and (
            fields["doubly_stochastic"] == "False"
        ) is moved
        assert ("average, which these rounds move" in out) is moved


def test_an_n_too_large_for_dense_matrices_is_refused_before_numpy_tries(tmp_path, capsys):
    """n = 300,000: describe and consensus hold dense n x n matrices (670 GiB each); n = 30,000
    was killed for memory and n = 100,000 a numpy traceback."""
    spec = tmp_path / "big.yaml"
    spec.write_text("n: 300000\ngraph: ring\n")
    for argv in (["topology", "describe", str(spec)], ["consensus", str(spec), "--out",
                                                        str(tmp_path / "c")]):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "n = 300,000: the analysis holds three dense n x n" in err[0], err


def test_export_of_a_graph_too_large_is_refused_before_it_is_built(tmp_path, capsys):
    """A complete graph of 300,000 nodes: describe refused it at once, export built it for
    minutes (a fuzz run's timeout)."""
    spec = tmp_path / "huge.yaml"
    spec.write_text("n: 300000\ngraph: complete\n")
    argv = ["topology", "export", str(spec), "--rounds", "2", "-o", str(tmp_path / "w.npz")]
    assert main(argv) == 2
    assert "--rounds 2 x n^2 = 300,000^2 x 8 bytes" in one_error_line(capsys)


@pytest.mark.parametrize("graph", ["complete", "erdos_renyi"])
def test_a_dense_graph_too_large_to_build_is_refused_before_networkx_tries(
    graph, tmp_path, capsys, monkeypatch
):
    """A complete graph of 30,000 nodes fitted the three dense matrices (20 GiB of 23.5) and
    built its 4.5 x 10^8 edges for minutes towards 148 GB. Here 2,000 nodes (2 x 10^6 edges,
    about 0.6 GiB to build) on a machine of 0.2 GiB: refused before anything is built."""
    from gossip_pfl.runtime import threads

    monkeypatch.setattr(threads, "physical_memory", lambda: 200 * 2**20)
    monkeypatch.setattr(cli_topology, "load", lambda path: pytest.fail("the graph was built"))
    spec = tmp_path / "dense.yaml"
    spec.write_text(
        f"n: 2000\ngraph: {graph}\n" + ("graph_args: {p: 0.9}\n" if graph != "complete" else "")
    )
    edges = f"{round((0.9 if graph != 'complete' else 1) * 2000 * 1999 / 2):,}"
    assert main(["topology", "describe", str(spec)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the {graph} graph's {edges} edges take about 330 bytes" in err[0]
    sparse = tmp_path / "sparse.yaml"  # (an n whose ring fits is built)
    sparse.write_text("n: 2000\ngraph: ring\n")
    with pytest.raises(pytest.fail.Exception, match="the graph was built"):
        main(["topology", "describe", str(sparse)])


@pytest.mark.parametrize("p", [".nan", ".inf", "40", "true"])
def test_a_bad_p_is_named_not_estimated(p, tmp_path, capsys):
    """The edges' estimate took round(NaN) (a traceback) and told p = 40 as memory."""
    spec = tmp_path / "er.yaml"
    spec.write_text(f"n: 20000\ngraph: erdos_renyi\ngraph_args: {{p: {p}}}\n")
    assert main(["topology", "describe", str(spec)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "p must be" in err[0], err


def test_files_a_user_names_in_their_own_way_are_read(tmp_path, capsys):
    """An upper-case .NPZ is matrices (refused as a graph, with a hint that then failed); a
    weighted adjacency with a symmetric pattern is an undirected graph whatever its values
    (read as directed, no weight rule took it); a directed irregular graph is told what to
    give instead (told "use metropolis", which refuses directed graphs), with its file."""
    np.savez(tmp_path / "w.npz", W=np.stack([ring_matrix(4), matching(4, 0)]))
    (tmp_path / "w.npz").rename(tmp_path / "W.NPZ")
    (tmp_path / "spec.yaml").write_text("graph: W.NPZ\n")
    for path in ("W.NPZ", "spec.yaml"):
        assert main(["topology", "describe", str(tmp_path / path), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["n"] == 4
    np.save(tmp_path / "path.npy", [[0, 1, 0], [2, 0, 3], [0, 1, 0.0]])
    assert main(["topology", "describe", str(tmp_path / "path.npy"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["edges_per_round"] == 4  # 2 edges, both ways
    np.save(tmp_path / "dir.npy", [[0, 1, 1], [0, 0, 1], [1, 0, 0.0]])
    assert main(["topology", "describe", str(tmp_path / "dir.npy")]) == 2
    err = one_error_line(capsys)
    assert "weights (dir.npy): uniform needs a regular graph" in err and ".npz" in err, err


def test_a_link_failure_seed_beyond_64_bits_is_named(tmp_path, capsys):
    """The failures' hash takes 64 bits: a larger seed was an OverflowError traceback."""
    spec = tmp_path / "lf.yaml"
    spec.write_text(f"n: 8\ngraph: ring\ntime_varying: {{kind: link_failure, q: 0.1}}\n"
                    f"seed: {2**64}\n")  # fmt: skip
    assert main(["topology", "describe", str(spec)]) == 2
    assert "seed must be < 2**64" in one_error_line(capsys)


def test_a_folder_where_consensus_writes_a_file_is_one_line(tmp_path, capsys, spec_module):
    (tmp_path / "consensus.csv").mkdir()
    spec = str(Path(__file__).resolve().parents[1] / "configs" / "topologies" / "ring16.yaml")
    assert main(["consensus", spec, "--out", str(tmp_path), "--rounds", "5"]) == 2
    assert "consensus.csv: it is a folder" in capsys.readouterr().err


def test_a_closed_pipe_ends_quietly():
    """`gossip-pfl topology describe ... | head -1`: the reader goes away; no traceback."""
    import subprocess
    import sys

    spec = Path(__file__).resolve().parents[1] / "configs" / "topologies" / "ring16.yaml"
    cmd = [sys.executable, "-m", "gossip_pfl", "topology", "describe", str(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # nothing will read what it prints
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_schedule_that_never_links_says_so(tmp_path, capsys, spec_module):
    """A ring whose links all fail (q = 1): the message said only "increase --horizon"."""
    spec = tmp_path / "q1.yaml"
    spec.write_text("n: 8\ngraph: ring\ntime_varying: {kind: link_failure, q: 1}\n")
    assert main(["topology", "describe", str(spec), "--horizon", "2000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "links join the 8 peers into 8 components" in err[0], err


def _cut_write(write, at: int = 0, after: int = 100):
    """``write`` (its file: positional argument ``at``) that leaves ``after`` bytes in its
    file, then fails as a full disk."""
    import errno

    def cut(*args, **kw):
        write(*args, **kw)
        with open(args[at], "r+b") as fh:
            fh.truncate(after)
        raise OSError(errno.ENOSPC, "No space left on device")

    return cut


def test_a_full_disk_leaves_no_cut_figure(tmp_path, capsys, fake_load, monkeypatch):
    """consensus's files on a full disk: one line naming the file, and the file that was
    there is kept whole (a traceback, and a cut file, before)."""
    out = tmp_path / "c"
    args = ["consensus", "ring8.yaml", "--rounds", "20", "--out", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    before = (out / "consensus.png").read_bytes()
    monkeypatch.setattr(cli_topology, "_plot", _cut_write(cli_topology._plot))
    assert main([*args[:3], "30", *args[4:]]) == 2
    assert f"cannot write {out / 'consensus.png'}: " in one_error_line(capsys)
    assert (out / "consensus.png").read_bytes() == before
    # and the set stays one run's: the new table and curves wait for the figure
    assert json.loads((out / "consensus.json").read_text())["rounds"] == 20
    assert sorted(p.name for p in out.iterdir()) == ["consensus.csv", "consensus.json",
                                                     "consensus.png"]  # fmt: skip


def test_a_full_disk_leaves_no_cut_export(tmp_path, capsys, spec_module, monkeypatch):
    """export's matrices on a full disk: one line naming the file, no cut .npz."""
    from topologies import spec

    monkeypatch.setattr(spec, "save_npz", _cut_write(spec.save_npz, at=1))
    w = tmp_path / "W.npz"
    assert main(["topology", "export", RING, "--rounds", "2", "-o", str(w)]) == 2
    assert f"cannot write {w}: " in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []
