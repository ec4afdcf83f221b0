"""YAML schedule files: a small dict spec -> :class:`~topologies.MixingSchedule`.

The keys and family names are a contract (see ``docs/topologies.md``)::

    n: 16                  # optional when graph is a file or a networkx graph
    graph: ring            # a family name, a file (edge list, .npy, .npz, .graphml, .gml)
                           #   or, in Python, a networkx graph
    graph_args: {}         # family arguments, e.g. {p: 0.5}, {d: 4}, {k: 1}
    weights: metropolis    # metropolis | max_degree | best_constant | fmmc | uniform
    time_varying:          # optional; omitted means static
      kind: link_failure   # random | link_failure | periodic | matching
      q: 0.1
    seed: 0

Every error is a one-line :class:`~topologies.TopologyError` that names the key (and the file,
for :func:`load_schedule`).
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import zipfile
from collections.abc import Hashable
from pathlib import Path

import networkx as nx
import numpy as np
import yaml

from topologies import graphs as _graphs
from topologies import schedules as _s
from topologies._base import MixingSchedule, TopologyError, _npy_why
from topologies.validation import check_nonnegative, check_row_stochastic, check_square
from topologies.weights import SYMMETRIC_RULES, WEIGHT_RULES

__all__ = [
    "KNOWN_KEYS",
    "KNOWN_FAMILIES",
    "TIME_VARYING_KINDS",
    "schedule_from_spec",
    "load_schedule",
    "save_npz",
    "load_npz",
]

#: top-level keys of a schedule file
KNOWN_KEYS = ("n", "graph", "graph_args", "weights", "time_varying", "seed")
#: families that are time-varying by nature (named directly as ``graph``) and their arguments
TIME_VARYING_FAMILIES = {
    "one_peer_exponential": (),
    "base": ("k",),
    "server": ("participation", "hub", "sizes"),
}
#: every family name accepted as ``graph``
KNOWN_FAMILIES = tuple(_graphs.GRAPH_FAMILIES) + tuple(TIME_VARYING_FAMILIES)
#: ``time_varying.kind`` values and the keys each accepts
TIME_VARYING_KINDS = {
    "random": ("kind",),
    "link_failure": ("kind", "q"),
    "periodic": ("kind", "graphs", "file"),
    "matching": ("kind",),
}
_ENTRY_KEYS = ("graph", "graph_args", "weights")


# ----------------------------------------------------------------------------- helpers


def _unknown(what: str, name, known) -> TopologyError:
    close = difflib.get_close_matches(str(name), list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return TopologyError(f"unknown {what} {name!r}{hint}; known: {', '.join(known)}")


def _check_keys(d: dict, known, where: str) -> None:
    for key in d:
        if key not in known:
            raise _unknown(f"key {where}" if where else "key", key, known)


def _as_int(value, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"{key}: must be an int, got {value!r}")
    if value < minimum:
        raise TopologyError(f"{key}: must be >= {minimum}, got {value}")
    return value


def _family_params(family: str) -> tuple[list[str], list[str]]:
    """(all, required) argument names of a static family beyond ``n`` and ``seed``."""
    params = list(inspect.signature(_graphs.GRAPH_FAMILIES[family]).parameters.values())[1:]
    params = [p for p in params if p.name != "seed"]
    return [p.name for p in params], [p.name for p in params if p.default is p.empty]


def _check_graph_args(family: str, args) -> dict:
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise TopologyError(f"graph_args: must be a mapping, got {args!r}")
    if family in TIME_VARYING_FAMILIES:
        known, required = list(TIME_VARYING_FAMILIES[family]), []
    else:
        known, required = _family_params(family)
    for key in args:
        if key not in known:
            if not known:
                raise TopologyError(f"graph_args: {family} takes no arguments, got {key!r}")
            raise _unknown(f"argument of {family} in graph_args:", key, known)
    missing = [r for r in required if r not in args]
    if missing:
        raise TopologyError(f"graph_args: {family} needs {', '.join(missing)}")
    return dict(args)


def _wrap(prefix: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except TopologyError as e:
        raise TopologyError(f"{prefix}: {e}") from None


def _resolve_path(graph: str, base_dir) -> Path:
    p = Path(graph).expanduser()
    if not p.is_absolute() and base_dir is not None:
        p = Path(base_dir) / p
    return p


def _is_graph_file(graph: str) -> bool:
    """A ``graph`` value that is not a family name and looks like a path."""
    if graph in KNOWN_FAMILIES:
        return False
    return "/" in graph or "\\" in graph or Path(graph).suffix != ""


# ----------------------------------------------------------------------------- spec


def schedule_from_spec(spec: dict, base_dir: str | Path | None = None) -> MixingSchedule:
    """Build the schedule a spec dict describes.

    Parameters
    ----------
    spec : dict
        Keys ``n``, ``graph``, ``graph_args``, ``weights``, ``time_varying``, ``seed``.
        ``graph`` is a family name, a file path (edge list, ``.npy``, ``.npz``, ``.graphml``,
        ``.gml``) or a networkx graph; with a file or a graph ``n`` may be left out. Nodes are
        renumbered ``0 .. n-1``; their original labels are the schedule's ``labels`` (None
        when they were already ``0 .. n-1``).
    base_dir : path, optional
        Directory that relative file paths in the spec are relative to (default: the current
        directory; :func:`load_schedule` passes the spec file's folder).

    Examples
    --------
    >>> s = schedule_from_spec({"n": 16, "graph": "ring", "weights": "max_degree"})
    >>> s.name, float(s.matrix(0)[0, 1])
    ('ring(n=16) / max_degree', 0.333...)
    >>> import networkx as nx
    >>> s = schedule_from_spec({"graph": nx.les_miserables_graph(), "weights": "metropolis"})
    >>> s.n, s.labels[:2]
    (77, ['Anzelma', 'Babet'])
    >>> schedule_from_spec({"n": 8, "graph": "base", "graph_args": {"k": 1}}).period
    3
    >>> schedule_from_spec({"n": 8, "graph": "rnig"})
    Traceback (most recent call last):
    ...
    topologies._base.TopologyError: graph: unknown family 'rnig' (did you mean 'ring'?); ...
    """
    if not isinstance(spec, dict):
        raise TopologyError(f"schedule spec must be a mapping of keys, got {type(spec).__name__}")
    _check_keys(spec, KNOWN_KEYS, "")
    graph = spec.get("graph")
    loaded = None  # (graph, label) of a networkx graph object or a graph file
    if isinstance(graph, nx.Graph):
        if spec.get("graph_args"):
            raise TopologyError("graph_args: not used when graph is a networkx graph")
        loaded = _wrap("graph", _graphs.from_networkx, graph), _graph_label(graph)
    elif isinstance(graph, (str, Path)) and _is_graph_file(str(graph)):
        if spec.get("graph_args"):
            raise TopologyError("graph_args: not used when graph is a file")
        path = _resolve_path(str(graph), base_dir)
        if path.suffix.lower() != ".npz":
            loaded = _wrap("graph", _graphs.load_graph, path), path.name
    if "n" not in spec:
        if loaded is not None:
            spec = {**spec, "n": loaded[0].number_of_nodes()}
        elif isinstance(graph, (str, Path)) and str(graph).lower().endswith(".npz"):
            spec = {**spec, "n": load_npz(_resolve_path(str(graph), base_dir)).n}
        else:
            raise TopologyError("n: missing (the number of peers, an int >= 1)")
    n = _as_int(spec["n"], "n", 1)
    seed = _as_int(spec.get("seed", 0), "seed", 0)
    weights = spec.get("weights")
    if weights is not None and (not isinstance(weights, str) or weights not in WEIGHT_RULES):
        raise TopologyError(f"weights: {_unknown('weight rule', weights, WEIGHT_RULES)}")
    tv = spec.get("time_varying")
    if tv is not None:
        if not isinstance(tv, dict) or "kind" not in tv:
            raise TopologyError(
                f"time_varying: must be a mapping with a kind ({', '.join(TIME_VARYING_KINDS)}),"
                " e.g. {kind: link_failure, q: 0.1} (topologies.md)"
            )
        if not isinstance(tv["kind"], str) or tv["kind"] not in TIME_VARYING_KINDS:
            raise TopologyError(
                f"time_varying.kind: {_unknown('kind', tv['kind'], TIME_VARYING_KINDS)}"
            )
        _check_keys(tv, TIME_VARYING_KINDS[tv["kind"]], f"in time_varying ({tv['kind']})")
        if tv["kind"] == "periodic":
            return _periodic(spec, tv, n, weights, seed, base_dir)
        if tv["kind"] == "matching" and weights is not None:  # (it was ignored, unsaid)
            raise TopologyError(f"weights: time_varying matching fixes its own weights (1/2 on "
                                f"each matched pair); drop weights: {weights}")  # fmt: skip
    if "graph" not in spec:
        raise TopologyError(f"graph: missing (a family: {', '.join(KNOWN_FAMILIES)}; or a file)")
    if loaded is not None:
        return _from_graph(*loaded, n, weights, seed, tv)
    if isinstance(graph, Path):
        graph = str(graph)
    if not isinstance(graph, str):
        raise TopologyError(
            f"graph: must be a family name, a file path or a networkx graph, got {graph!r}"
        )
    if graph in TIME_VARYING_FAMILIES:
        return _time_varying_family(graph, spec, n, weights, seed, tv)
    if graph in _graphs.GRAPH_FAMILIES:
        args = _check_graph_args(graph, spec.get("graph_args"))
        return _from_family(graph, args, n, weights, seed, tv)
    if _is_graph_file(graph):  # .npz: explicit matrices
        return _from_npz(_resolve_path(graph, base_dir), n, weights, tv)
    raise TopologyError(f"graph: {_unknown('family', graph, KNOWN_FAMILIES)}")


def _default_weights(family: str | None, weights: str | None) -> str:
    directed = family == "exponential"
    if weights is None:
        return "uniform" if directed else "metropolis"
    if directed and weights in SYMMETRIC_RULES:
        raise TopologyError(
            f"weights: {weights!r} needs an undirected graph; graph 'exponential' is directed "
            "(use weights: uniform)"
        )
    return weights


def _from_family(family, args, n, weights, seed, tv) -> MixingSchedule:
    weights = _default_weights(family, weights)
    if tv is None:
        return _wrap("graph", _s.graph_schedule, n, family, args, weights, seed)
    kind = tv["kind"]
    if kind == "random":
        if family not in _s.RANDOM_FAMILIES:
            raise TopologyError(
                f"time_varying: kind random re-draws a random family "
                f"({', '.join(_s.RANDOM_FAMILIES)}) each round; graph {family!r} is not one"
            )
        return _wrap("graph", _s.RandomSchedule, n, family, args, weights, seed)
    graph = _wrap("graph", _s._make_graph, family, n, args, seed)
    label = _s._family_label(family, n, args)
    return _dynamic(graph, label, n, weights, seed, tv, plain_complete=family == "complete")


def _dynamic(graph, label, n, weights, seed, tv, plain_complete=False) -> MixingSchedule:
    kind = tv["kind"]
    if kind == "link_failure":
        if "q" not in tv:
            raise TopologyError("time_varying.q: missing (the failure probability in [0, 1])")
        if graph.is_directed():
            raise TopologyError("time_varying: link_failure needs an undirected graph")
        s = _wrap("time_varying", _s.LinkFailureSchedule, graph, weights, tv["q"], seed)
        s.name = f"link_failure(q={s.q}) over {label} / {weights}"
        return s
    if kind == "matching":
        if graph.is_directed():
            raise TopologyError("time_varying: matching needs an undirected graph")
        s = _s.MatchingSchedule(n, None if plain_complete else graph, seed)
        s.name = f"matching over {label}"
        return s
    raise TopologyError(f"time_varying: kind {kind} needs graph to be a random family")


def _time_varying_family(family, spec, n, weights, seed, tv) -> MixingSchedule:
    if tv is not None:
        raise TopologyError(f"time_varying: graph {family!r} is time-varying already; drop it")
    if weights is not None and family != "server":
        raise TopologyError(f"weights: graph {family!r} fixes its own weights; drop the key")
    if weights is not None:
        raise TopologyError("weights: for graph 'server' give dataset sizes as graph_args.sizes")
    args = _check_graph_args(family, spec.get("graph_args"))
    if family == "one_peer_exponential":
        return _wrap("graph", _s.OnePeerExponentialSchedule, n)
    if family == "base":
        return _wrap("graph_args", _s.BaseGraphSchedule, n, args.get("k", 1))
    sizes = args.pop("sizes", None)
    return _wrap("graph_args", _s.ServerSchedule, n, weights=sizes, seed=seed, **args)


def _from_npz(path: Path, n, weights, tv) -> MixingSchedule:
    if tv is not None or weights is not None:
        raise TopologyError(
            f"graph: {path.name} holds explicit matrices; drop weights/time_varying"
        )
    s = load_npz(path)
    if s.n != n:
        raise TopologyError(f"graph: {path} has n={s.n} but n is {n}")
    return s


def _graph_label(graph: nx.Graph) -> str:
    name = graph.graph.get("name") or type(graph).__name__
    return f"{name} (n={graph.number_of_nodes()})"


def _from_graph(graph: nx.Graph, label: str, n, weights, seed, tv) -> MixingSchedule:
    """The schedule of a loaded graph (nodes 0 .. n-1; original labels in graph.graph)."""
    if graph.number_of_nodes() != n:
        raise TopologyError(f"graph: {label} has {graph.number_of_nodes()} nodes but n is {n}")
    if weights is None:  # uniform for a directed graph, as for the exponential family
        weights = "uniform" if graph.is_directed() else "metropolis"
    if weights in SYMMETRIC_RULES and graph.is_directed():
        raise TopologyError(f"weights: {weights!r} needs an undirected graph; {label} is directed")
    if tv is None:
        s = _wrap(
            f"weights ({label})",
            _s.StaticSchedule.from_graph,
            graph,
            weights,
            name=f"{label} / {weights}",
        )
    elif tv["kind"] == "random":
        raise TopologyError("time_varying: kind random needs graph to be a random family")
    else:
        s = _dynamic(graph, label, n, weights, seed, tv)
    s.labels = _graphs.node_labels(graph)
    return s


def _periodic(spec, tv, n, weights, seed, base_dir) -> MixingSchedule:
    for key in ("graph", "graph_args"):
        if key in spec:
            raise TopologyError(
                f"{key}: not used with time_varying.kind periodic; list the rounds under "
                "time_varying.graphs (or give time_varying.file)"
            )
    if ("graphs" in tv) == ("file" in tv):
        raise TopologyError("time_varying: periodic needs exactly one of graphs (a list) or file")
    if "file" in tv:
        if weights is not None:
            raise TopologyError("weights: not used with an explicit .npz file")
        s = load_npz(_resolve_path(str(tv["file"]), base_dir))
        if s.n != n:
            raise TopologyError(f"time_varying.file: has n={s.n} but n is {n}")
        return s
    entries = tv["graphs"]
    if not isinstance(entries, list) or not entries:
        raise TopologyError("time_varying.graphs: must be a non-empty list of {graph: ...}")
    items = []
    for i, entry in enumerate(entries):
        where = f"time_varying.graphs[{i}]"
        if not isinstance(entry, dict):
            raise TopologyError(f"{where}: must be a mapping like {{graph: ring}}")
        _wrap(where, _check_keys, entry, _ENTRY_KEYS, "")
        sub = {"n": n, "seed": seed, **entry}
        if weights is not None and "weights" not in entry:
            if entry.get("graph") not in TIME_VARYING_FAMILIES:
                sub["weights"] = weights
        items.append(_wrap(where, schedule_from_spec, sub, base_dir))
    return _s.PeriodicSchedule(items)


# ----------------------------------------------------------------------------- files


#: the usual names of edge-list text files (load_graph reads any other name as one too)
_EDGE_LISTS = (".txt", ".edgelist", ".edges", ".csv", ".tsv")


def check_not_data_file(path: Path) -> None:
    """A graph or matrix file given where a schedule file (YAML) goes: say where it goes."""
    suffix = path.suffix.lower()
    if suffix in (*_graphs.GRAPH_FILE_READERS, *_EDGE_LISTS, ".npy", ".npz"):
        key = "time_varying: {kind: periodic, file: FILE}" if suffix == ".npz" else "graph: FILE"
        raise TopologyError(f"{path} is not a schedule file (YAML); a spec names it as {{{key}}}")


def load_schedule(path: str | Path) -> MixingSchedule:
    """Load a YAML schedule file; paths inside it are relative to the file.

    Examples
    --------
    >>> import tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "s.yaml")
    >>> _ = open(f, "w").write("n: 8\\ngraph: one_peer_exponential\\n")
    >>> load_schedule(f).period
    3
    """
    p = Path(path)
    if p.is_file():  # (a missing one: "not found", below)
        check_not_data_file(p)
    spec = read_mapping(p, "schedule file")
    if not spec:
        raise TopologyError(f"{p}: expected a mapping of keys ({', '.join(KNOWN_KEYS)})")
    return _wrap(str(p), schedule_from_spec, spec, p.parent)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last
    silently: a config's second ``rounds:`` or a peers file's second ``0:`` would win)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<``: merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):  # SafeLoader names that one
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes the strings :func:`load_yaml` would read as numbers."""


# YAML 1.1 reads a number written 1e-3 (no dot) as a string, YAML 1.2 and people as a number
# (--set data.alpha=1e-1 was "must be a number (got '1e-1')"); the dumper then quotes a string
# '1e-3', so that what a run writes reads back the same
for _cls in (_UniqueKeyLoader, _Dumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )


def load_yaml(text: str):
    """A YAML document as the spec files are read: a key given twice refused, 1e-3 a number.

    >>> load_yaml("p: 5e-1")
    {'p': 0.5}
    """
    return yaml.load(text, Loader=_UniqueKeyLoader)


def dump_yaml(data) -> str:
    """``data`` as YAML that :func:`load_yaml` reads back the same (keys in their order).

    >>> print(dump_yaml({"out": "1e-3", "lr": 0.001}), end="")
    out: '1e-3'
    lr: 0.001
    """
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def read_mapping(path: str | Path, what: str = "file") -> dict:
    """The YAML mapping in ``path`` ({} for an empty file). A missing file, a syntax error (with
    its line) or a non-mapping document is a one-line TopologyError naming the file.

    Examples
    --------
    >>> import tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "s.yaml")
    >>> _ = open(f, "w").write("n: [1, 2")
    >>> read_mapping(f)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    topologies._base.TopologyError: ...s.yaml line 1: malformed YAML (...)
    """
    p = Path(path)
    if p.is_dir():
        raise TopologyError(f"{what} {p} is a folder, not a file")
    if not p.is_file():
        raise TopologyError(f"{what} not found: {p}")
    try:
        data = load_yaml(p.read_text())
    except UnicodeDecodeError as e:
        raise TopologyError(f"{p}: not a text file (byte {e.start} is not UTF-8)") from None
    except OSError as e:
        raise TopologyError(f"cannot read {p}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise TopologyError(f"{p}{where}: malformed YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise TopologyError(f"{p}: expected a mapping of keys, got {type(data).__name__}")
    return data


def save_npz(schedule: MixingSchedule, path: str | Path, rounds: int | None = None) -> None:
    """Write ``W_0 .. W_{rounds-1}`` as an array ``W`` of shape ``(rounds, n, n)`` (and the
    schedule's node ``labels`` as an array ``labels``, when it has them).

    ``rounds`` defaults to the schedule's period; aperiodic schedules need it.

    Examples
    --------
    >>> import tempfile, os
    >>> from topologies.schedules import OnePeerExponentialSchedule
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz")
    >>> save_npz(OnePeerExponentialSchedule(4), f)
    >>> load_npz(f).period
    2
    """
    if rounds is None:
        rounds = schedule.period
        if rounds is None:
            raise TopologyError("save_npz: rounds is needed for an aperiodic schedule")
    rounds = _as_int(rounds, "rounds", 1)
    folder = Path(path).parent if isinstance(path, (str, os.PathLike)) else None  # (or a file)
    if folder is not None and not folder.is_dir():  # (numpy's error named no folder)
        what = "is not a folder" if folder.exists() else "does not exist"
        raise TopologyError(f"save_npz: {folder} {what}")
    w = np.empty((rounds, schedule.n, schedule.n))  # (a list, then its stack: twice this)
    for t in range(rounds):
        w[t] = schedule.matrix(t)
    labels = getattr(schedule, "labels", None)
    if labels is None:
        np.savez_compressed(path, W=w)
    else:  # the nodes' original names, kept for reports
        np.savez_compressed(path, W=w, labels=np.array([str(x) for x in labels]))


def load_npz(path: str | Path) -> _s.PeriodicSchedule:
    """Load matrices saved by :func:`save_npz` (array ``W``, shape ``(R, n, n)``, and
    optionally ``labels``, the nodes' names) as a periodic schedule; every ``W_t`` must be
    non-negative and row-stochastic.

    Examples
    --------
    >>> import tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz")
    >>> np.savez(f, W=np.stack([np.eye(3), np.full((3, 3), 1 / 3)]))
    >>> load_npz(f).matrix(1)[0]
    array([0.333..., 0.333..., 0.333...])
    """
    p = Path(path)
    if not p.is_file():
        raise TopologyError(f"matrix file not found: {p}")
    try:
        with np.load(p, allow_pickle=False) as data:
            if "W" not in data:
                raise TopologyError(f"{p}: no array 'W' (found {', '.join(data.files)})")
            raw = data["W"]  # (each read unzips it)
            if np.iscomplexobj(raw):  # (float() dropped the imaginary part, warned)
                raise TopologyError(f"{p}: W must be real, got complex numbers")
            w = np.asarray(raw, dtype=float)
            labels = data["labels"].tolist() if "labels" in data else None
    except TopologyError:  # a ValueError too: its message is whole
        raise
    # TypeError: a W of strings or objects; BadZipFile, EOFError: a cut or empty file
    except (ValueError, TypeError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise TopologyError(f"{p}: not a readable .npz file ({_npy_why(e)})") from None
    if w.ndim != 3 or w.shape[1] != w.shape[2] or w.shape[0] == 0:
        raise TopologyError(f"{p}: W must have shape (rounds, n, n), got {w.shape}")
    for t, wt in enumerate(w):
        _wrap(f"{p}: round {t}", _check_matrix, wt)
    if labels is not None and len(labels) != w.shape[1]:
        raise TopologyError(f"{p}: {len(labels)} labels for n={w.shape[1]}")
    items = [_s.StaticSchedule(wt, name=f"{p.name}[{t}]") for t, wt in enumerate(w)]
    s = _s.PeriodicSchedule(items, name=f"{p.name} ({len(items)} rounds)")
    s.labels = labels
    return s


def _check_matrix(w: np.ndarray) -> None:
    check_square(w)
    check_nonnegative(w)
    check_row_stochastic(w)
