"""YAML schedule files: every form, round trips and one-line errors."""

import io

import numpy as np
import pytest
import yaml

from topologies import TopologyError, schedules
from topologies.spec import (
    KNOWN_FAMILIES,
    load_npz,
    load_schedule,
    read_mapping,
    save_npz,
    schedule_from_spec,
)


def same(a, b, rounds=4):
    return all(np.array_equal(a.matrix(t), b.matrix(t)) for t in range(rounds))


def write(tmp_path, spec, name="s.yaml"):
    f = tmp_path / name
    f.write_text(yaml.safe_dump(spec) if isinstance(spec, dict) else spec)
    return f


def test_known_families():
    assert {"ring", "exponential", "base", "server", "one_peer_exponential"} <= set(KNOWN_FAMILIES)


@pytest.mark.parametrize(
    "spec, cls",
    [
        ({"n": 16, "graph": "ring"}, schedules.StaticSchedule),
        ({"n": 16, "graph": "erdos_renyi", "graph_args": {"p": 0.5}, "weights": "fmmc"}, None),
        ({"n": 16, "graph": "exponential"}, schedules.StaticSchedule),
        ({"n": 16, "graph": "one_peer_exponential"}, schedules.OnePeerExponentialSchedule),
        ({"n": 12, "graph": "base", "graph_args": {"k": 2}}, schedules.BaseGraphSchedule),
        (
            {"n": 8, "graph": "server", "graph_args": {"participation": 0.5, "hub": "peer"}},
            schedules.ServerSchedule,
        ),
        (
            {"n": 16, "graph": "ring", "time_varying": {"kind": "link_failure", "q": 0.1}},
            schedules.LinkFailureSchedule,
        ),
        (
            {
                "n": 16,
                "graph": "random_regular",
                "graph_args": {"d": 4},
                "time_varying": {"kind": "random"},
            },
            schedules.RandomSchedule,
        ),
        (
            {"n": 9, "graph": "complete", "time_varying": {"kind": "matching"}},
            schedules.MatchingSchedule,
        ),
        (
            {
                "n": 8,
                "weights": "max_degree",
                "time_varying": {
                    "kind": "periodic",
                    "graphs": [{"graph": "ring"}, {"graph": "star", "weights": "metropolis"}],
                },
            },
            schedules.PeriodicSchedule,
        ),
    ],
)
def test_forms_and_yaml_round_trip(tmp_path, spec, cls):
    built = schedule_from_spec(spec)
    if cls is not None:
        assert isinstance(built, cls)
    loaded = load_schedule(write(tmp_path, spec))
    assert same(built, loaded)
    assert built.name == loaded.name


def test_periodic_entries_and_default_weights():
    spec = {
        "n": 8,
        "weights": "max_degree",
        "time_varying": {"kind": "periodic", "graphs": [{"graph": "ring"}, {"graph": "star"}]},
    }
    sched = schedule_from_spec(spec)
    assert sched.period == 2
    np.testing.assert_allclose(sched.matrix(0)[0, 1], 1 / 3)
    np.testing.assert_allclose(sched.matrix(1)[1, 0], 1 / 8)


def test_exponential_defaults_to_uniform():
    sched = schedule_from_spec({"n": 8, "graph": "exponential"})
    np.testing.assert_allclose(sched.matrix(0)[0, 0], 1 / 4)


def test_graph_files_relative_to_yaml(tmp_path):
    (tmp_path / "graphs").mkdir()
    (tmp_path / "graphs" / "sq.txt").write_text("0 1\n1 2\n2 3\n3 0\n")
    np.save(tmp_path / "graphs" / "tri.npy", np.ones((3, 3)) - np.eye(3))
    f = write(tmp_path, {"n": 4, "graph": "graphs/sq.txt", "weights": "max_degree"})
    np.testing.assert_allclose(load_schedule(f).matrix(0)[0, [0, 1, 3]], 1 / 3)
    f = write(tmp_path, {"n": 3, "graph": "graphs/tri.npy"}, "t.yaml")
    np.testing.assert_allclose(load_schedule(f).matrix(0), 1 / 3)


def test_npz_round_trip(tmp_path):
    base = schedules.BaseGraphSchedule(12, 1)
    save_npz(base, tmp_path / "w.npz")
    loaded = load_npz(tmp_path / "w.npz")
    assert loaded.period == base.period
    assert same(base, loaded, rounds=2 * base.period)
    random = schedule_from_spec(
        {"n": 6, "graph": "ring", "time_varying": {"kind": "link_failure", "q": 0.5}}
    )
    save_npz(random, tmp_path / "r.npz", rounds=3)
    by_file = load_schedule(write(tmp_path, {"n": 6, "graph": "r.npz"}))
    by_periodic = load_schedule(
        write(tmp_path, {"n": 6, "time_varying": {"kind": "periodic", "file": "r.npz"}}, "p.yaml")
    )
    assert same(random, by_file, 3) and same(random, by_periodic, 3)


def test_npz_import_validates(tmp_path):
    np.savez(tmp_path / "bad.npz", W=np.array([[[0.5, 0.5], [0.2, 0.2]]]))
    with pytest.raises(TopologyError, match="round 0: row 1 sums to 0.4"):
        load_npz(tmp_path / "bad.npz")
    with pytest.raises(TopologyError, match="aperiodic"):
        save_npz(schedules.MatchingSchedule(4), tmp_path / "m.npz")
    # (was numpy's FileNotFoundError, which named no folder)
    with pytest.raises(TopologyError, match=r"save_npz: .*/nope does not exist"):
        save_npz(schedules.BaseGraphSchedule(4, 1), tmp_path / "nope" / "w.npz")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(TopologyError, match=r"save_npz: .*/a_file is not a folder"):
        save_npz(schedules.BaseGraphSchedule(4, 1), tmp_path / "a_file" / "w.npz")
    buffer = io.BytesIO()  # (numpy writes to a file object: so does save_npz)
    save_npz(schedules.BaseGraphSchedule(4, 1), buffer)
    assert np.load(io.BytesIO(buffer.getvalue()))["W"].shape == (2, 4, 4)


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"n": 8, "graph": "ring", "wieghts": "metropolis"}, "unknown key 'wieghts' (did you mean"),
        ({"graph": "ring"}, "n: missing"),
        ({"n": "8", "graph": "ring"}, "n: must be an int"),
        ({"n": True, "graph": "ring"}, "n: must be an int"),
        ({"n": 2, "graph": "ring"}, "graph: ring needs n >= 3"),
        ({"n": 8, "graph": "rnig"}, "graph: unknown family 'rnig' (did you mean 'ring'?)"),
        ({"n": 8, "graph": "ring", "weights": "metropolise"}, "weights: unknown weight rule"),
        ({"n": 8, "graph": "exponential", "weights": "metropolis"}, "is directed"),
        ({"n": 8, "graph": "erdos_renyi"}, "graph_args: erdos_renyi needs p"),
        ({"n": 8, "graph": "erdos_renyi", "graph_args": {"pp": 0.5}}, "did you mean 'p'"),
        ({"n": 8, "graph": "ring", "graph_args": {"k": 2}}, "ring takes no arguments"),
        ({"n": 8, "graph": "ring", "time_varying": {"kind": "rnd"}}, "time_varying.kind"),
        ({"n": 8, "graph": "ring", "time_varying": {"kind": "random"}}, "random family"),
        ({"n": 8, "graph": "ring", "time_varying": {"kind": "link_failure"}}, "q: missing"),
        (
            {"n": 8, "graph": "ring", "time_varying": {"kind": "link_failure", "p": 0.1}},
            "unknown key in time_varying (link_failure) 'p'",
        ),
        ({"n": 8, "graph": "base", "weights": "metropolis"}, "fixes its own weights"),
        (
            {"n": 8, "graph": "base", "time_varying": {"kind": "matching"}},
            "time-varying already",
        ),
        ({"n": 8, "graph": "server", "graph_args": {"hub": "cloud"}}, "hub must be"),
        ({"n": 8, "graph": "missing.txt"}, "graph file not found"),
        ({"n": 8, "time_varying": {"kind": "periodic"}}, "exactly one of graphs"),
        (
            {"n": 8, "time_varying": {"kind": "periodic", "graphs": [{"graph": "rnig"}]}},
            "time_varying.graphs[0]: graph: unknown family",
        ),
        ({"n": 8, "graph": "ring", "seed": -1}, "seed: must be >= 0"),
    ],
)
def test_spec_errors(spec, words):
    with pytest.raises(TopologyError) as err:
        schedule_from_spec(spec)
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def test_file_errors(tmp_path):
    with pytest.raises(TopologyError, match="schedule file not found: .*nope.yaml"):
        load_schedule(tmp_path / "nope.yaml")
    bad = write(tmp_path, "n: 8\ngraph: ring\n  weights: [metropolis\n", "bad.yaml")
    with pytest.raises(TopologyError, match=r"bad.yaml line \d+: malformed YAML"):
        load_schedule(bad)
    # plain YAML keeps the last of two equal keys: the ring would silently win
    twice = write(tmp_path, "n: 8\ngraph: complete\ngraph: ring\n", "twice.yaml")
    with pytest.raises(TopologyError, match="twice.yaml line 3: .*key 'graph' given twice"):
        load_schedule(twice)
    merged = write(tmp_path, "base: &b {n: 8, graph: ring}\nx:\n  <<: *b\n  n: 6\n", "m.yaml")
    assert read_mapping(merged)["x"] == {"n": 6, "graph": "ring"}  # an override is no repeat
    f = write(tmp_path, {"n": 8, "graph": "rnig"}, "u.yaml")
    with pytest.raises(TopologyError, match="u.yaml: graph: unknown family"):
        load_schedule(f)
    (tmp_path / "g.txt").write_text("0 1\n1 2\n2 0\n")
    f = write(tmp_path, {"n": 8, "graph": "g.txt"}, "g.yaml")
    with pytest.raises(TopologyError, match="has 3 nodes but n is 8"):
        load_schedule(f)
    f = write(tmp_path, "- 1\n- 2\n", "list.yaml")
    with pytest.raises(TopologyError, match="expected a mapping"):
        load_schedule(f)


def test_import_topologies_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, topologies, topologies.analysis; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_time_varying_kind_alone_shows_the_full_form():
    """`time_varying: link_failure` (a name, not a mapping) took two tries to fix: the error
    now shows a whole mapping."""
    with pytest.raises(TopologyError, match=r"e\.g\. \{kind: link_failure, q: 0\.1\}"):
        schedule_from_spec({"n": 4, "graph": "ring", "time_varying": "link_failure"})
