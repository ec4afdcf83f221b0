"""Graphs as users hold them: networkx objects, edge lists with names, GraphML and GML files,
and relative paths inside spec files."""

from __future__ import annotations

import json

import networkx as nx
import numpy as np
import pytest
import yaml

from gossip_pfl.cli import main
from topologies import TopologyError, from_networkx, load_graph, load_schedule
from topologies.graphs import node_labels
from topologies.spec import load_npz, save_npz, schedule_from_spec


def weights_by_label(schedule, t: int = 0) -> dict[tuple, float]:
    """Off-diagonal W_t entries keyed by the nodes' original labels."""
    w = schedule.matrix(t)
    labels = schedule.labels if schedule.labels is not None else list(range(schedule.n))
    return {(labels[i], labels[j]): float(w[i, j]) for i, j in zip(*np.nonzero(w)) if i != j}


def metropolis_by_label(graph: nx.Graph) -> dict[tuple, float]:
    """Metropolis-Hastings weights of a graph written out by hand: 1 / (1 + max degree)."""
    out = {}
    for u, v in graph.edges():
        if u != v:
            out[(u, v)] = out[(v, u)] = 1.0 / (1 + max(graph.degree(u), graph.degree(v)))
    return out


def write_spec(folder, spec: dict, name: str = "spec.yaml"):
    path = folder / name
    path.write_text(yaml.safe_dump(spec))
    return path


# --------------------------------------------------------------------------- networkx objects


def test_networkx_graph_object_in_a_spec():
    karate = nx.karate_club_graph()
    s = schedule_from_spec({"graph": karate, "weights": "metropolis"})
    assert s.n == 34 and s.labels is None  # nodes were 0 .. 33 already
    assert s.doubly_stochastic and s.symmetric
    assert weights_by_label(s) == pytest.approx(metropolis_by_label(karate))
    assert "Zachary's Karate Club" in s.name
    assert schedule_from_spec({"n": 34, "graph": karate}).n == 34  # n may be given too


def test_networkx_graph_with_names_keeps_the_labels():
    lesmis = nx.les_miserables_graph()
    s = schedule_from_spec({"graph": lesmis, "weights": "metropolis", "seed": 3})
    assert s.n == 77
    assert s.labels == sorted(lesmis.nodes())  # sortable names: sorted order
    assert weights_by_label(s) == pytest.approx(metropolis_by_label(lesmis))


def test_networkx_graph_under_link_failures_and_periodic():
    karate = nx.karate_club_graph()
    lf = schedule_from_spec({"graph": karate, "time_varying": {"kind": "link_failure", "q": 0.2}})
    assert lf.n == 34 and lf.is_random
    w = lf.matrix(5)  # failed links' weight moves to the diagonal: still doubly stochastic
    np.testing.assert_allclose(w.sum(axis=0), 1.0)
    np.testing.assert_allclose(w.sum(axis=1), 1.0)
    periodic = schedule_from_spec(
        {
            "n": 34,
            "time_varying": {"kind": "periodic", "graphs": [{"graph": karate}, {"graph": "ring"}]},
        }
    )
    np.testing.assert_allclose(periodic.matrix(0), schedule_from_spec({"graph": karate}).matrix(0))


def test_networkx_graph_errors():
    karate = nx.karate_club_graph()
    with pytest.raises(TopologyError, match="graph: .*has 34 nodes but n is 30"):
        schedule_from_spec({"n": 30, "graph": karate})
    with pytest.raises(TopologyError, match="graph_args: not used when graph is a networkx graph"):
        schedule_from_spec({"graph": karate, "graph_args": {"p": 0.5}})
    with pytest.raises(TopologyError, match="graph: graph is disconnected"):
        schedule_from_spec({"graph": nx.Graph([(0, 1), (2, 3)])})
    with pytest.raises(TopologyError, match="must be a family name, a file path or a networkx"):
        schedule_from_spec({"n": 3, "graph": 3})


def test_from_networkx_explicit_order():
    g = from_networkx(nx.Graph([("b", "c"), ("a", "b")]), order=["c", "b", "a"])
    assert node_labels(g) == ["c", "b", "a"] and sorted(g.edges()) == [(0, 1), (1, 2)]
    with pytest.raises(TopologyError, match="order must list every node"):
        from_networkx(nx.Graph([("a", "b")]), order=["a"])


# --------------------------------------------------------------------------- files


def test_edge_list_with_names(tmp_path):
    lesmis = nx.les_miserables_graph()
    f = tmp_path / "lesmis.txt"
    f.write_text(
        "# Les Miserables co-appearances\n" + "\n".join(f"{u} {v} 1" for u, v in lesmis.edges())
    )
    first_seen = list(dict.fromkeys(x for e in lesmis.edges() for x in e))
    g = load_graph(f)
    assert node_labels(g) == first_seen  # numbered in the order they first appear
    s = schedule_from_spec({"graph": str(f), "weights": "metropolis"})
    assert s.n == 77 and s.labels == first_seen
    assert weights_by_label(s) == pytest.approx(metropolis_by_label(lesmis))


def test_edge_list_integer_ids_not_from_zero_are_renumbered(tmp_path):
    f = tmp_path / "one_based.txt"
    f.write_text("1 2\n2 3\n3 1\n3 10\n")
    g = load_graph(f)
    assert node_labels(g) == [1, 2, 3, 10]
    assert sorted(g.edges()) == [(0, 1), (0, 2), (1, 2), (2, 3)]
    plain = tmp_path / "plain.txt"
    plain.write_text("0 1\n1 2\n")
    assert node_labels(load_graph(plain)) is None


def test_edge_list_mixing_ids_and_names_is_an_error(tmp_path):
    f = tmp_path / "mixed.txt"
    f.write_text("0 1\n1 Napoleon\n")
    with pytest.raises(TopologyError, match="mixed.txt: line 2: expected 'u v' with integer ids"):
        load_graph(f)
    short = tmp_path / "short.txt"
    short.write_text("Myriel\n")
    with pytest.raises(TopologyError, match="short.txt: line 1: expected 'u v'"):
        load_graph(short)


@pytest.mark.parametrize("suffix", [".graphml", ".gml"])
def test_graphml_and_gml_files(tmp_path, suffix):
    lesmis = nx.les_miserables_graph()
    f = tmp_path / f"lesmis{suffix}"
    (nx.write_graphml if suffix == ".graphml" else nx.write_gml)(lesmis, f)
    s = schedule_from_spec({"graph": str(f)})
    assert s.n == 77 and s.labels == list(lesmis.nodes())  # file order
    assert weights_by_label(s) == pytest.approx(metropolis_by_label(lesmis))
    karate = tmp_path / f"karate{suffix}"
    (nx.write_graphml if suffix == ".graphml" else nx.write_gml)(nx.karate_club_graph(), karate)
    assert schedule_from_spec({"graph": str(karate)}).labels is None  # "0" .. "33"


def test_unreadable_graphml_names_the_file(tmp_path):
    f = tmp_path / "broken.graphml"
    f.write_text("<graphml><graph")
    with pytest.raises(TopologyError, match="broken.graphml: not a readable GraphML file"):
        load_graph(f)


def test_relative_paths_are_read_from_the_spec_files_folder(tmp_path, monkeypatch):
    folder = tmp_path / "study"
    (folder / "graphs").mkdir(parents=True)
    nx.write_edgelist(nx.les_miserables_graph(), folder / "graphs" / "lesmis.txt", data=False)
    nx.write_graphml(nx.karate_club_graph(), folder / "graphs" / "karate.graphml")
    spec = write_spec(folder, {"graph": "graphs/lesmis.txt", "weights": "max_degree"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the current folder holds no graphs/
    s = load_schedule(spec)
    assert s.n == 77 and "Myriel" in s.labels
    periodic = write_spec(
        folder,
        {
            "n": 34,
            "time_varying": {
                "kind": "periodic",
                "graphs": [{"graph": "graphs/karate.graphml"}, {"graph": "ring"}],
            },
        },
        "periodic.yaml",
    )
    assert load_schedule(periodic).period == 2
    save_npz(load_schedule(periodic), folder / "graphs" / "two.npz")
    from_file = write_spec(
        folder, {"n": 34, "time_varying": {"kind": "periodic", "file": "graphs/two.npz"}}, "f.yaml"
    )
    assert load_schedule(from_file).period == 2


def test_npz_of_strings_is_one_line_error(tmp_path):
    np.savez(tmp_path / "w.npz", W=np.array([[["a", "b"], ["c", "d"]]]))
    with pytest.raises(TopologyError, match=r"w.npz: not a readable .npz file \(could not"):
        load_npz(tmp_path / "w.npz")


def test_npz_keeps_labels(tmp_path):
    s = schedule_from_spec({"graph": nx.les_miserables_graph()})
    save_npz(s, tmp_path / "w.npz", rounds=1)
    back = load_npz(tmp_path / "w.npz")
    assert back.labels == s.labels
    np.testing.assert_allclose(back.matrix(0), s.matrix(0))
    assert schedule_from_spec({"graph": str(tmp_path / "w.npz")}).n == 77  # n from the file


def test_topology_describe_takes_a_graph_file_and_shows_labels(tmp_path, capsys):
    f = tmp_path / "lesmis.txt"
    nx.write_edgelist(nx.les_miserables_graph(), f, data=False)
    assert main(["topology", "describe", str(f), "--json", "--horizon", "5", "--trials", "2"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["n"] == 77 and len(info["labels"]) == 77 and "Myriel" in info["labels"]
    out = tmp_path / "w.npz"
    assert main(["topology", "export", str(f), "--rounds", "2", "-o", str(out)]) == 0
    assert load_npz(out).labels == info["labels"]
    assert main(["topology", "describe", str(out), "--horizon", "5", "--trials", "2"]) == 0
    assert "labels" in capsys.readouterr().out


def test_a_run_checks_every_round_of_a_user_schedule_it_takes(tmp_path):
    """The run's check read the first 100 rounds of a periodic schedule whatever its rounds:
    a file whose W_100 onwards are row- but not column-stochastic ran on, the peers' average
    drifting. Now it reads the rounds the run takes (a period at most)."""
    from gossip_pfl.algorithms import get_algorithm
    from gossip_pfl.config import load_config
    from gossip_pfl.errors import GossipError
    from gossip_pfl.train import build_schedule

    n = 6
    ring = np.eye(n) / 3 + np.roll(np.eye(n), 1, axis=1) / 3 + np.roll(np.eye(n), -1, axis=1) / 3
    skew = np.eye(n)
    skew[0] = [0.5, 0.5, 0, 0, 0, 0]  # rows sum to 1; column 0 to 0.5, column 1 to 1.5
    np.savez(tmp_path / "late.npz", W=np.stack([ring] * 100 + [skew] * 20))

    def cfg(rounds):
        return load_config(base={"rounds": rounds, "algorithm": {"name": "dsgd"},
                                 "schedule": {"graph": str(tmp_path / "late.npz")},
                                 "out": str(tmp_path / "run")})  # fmt: skip

    assert build_schedule(cfg(100), n, get_algorithm("dsgd")).n == n  # the rounds it takes
    with pytest.raises(GossipError, match=r"not doubly stochastic: W_100 column 0 sums to 0.5"):
        build_schedule(cfg(101), n, get_algorithm("dsgd"))
