"""Generate docs/config.md, the configuration reference, from the code that defines it.

Every run-config key comes from the dataclasses in :mod:`gossip_pfl.config` (type, default and
the ``#:`` comment beside or above the field), the dataset options from the loaders' defaults,
the model options from the model constructors, and the schedule keys from
:mod:`topologies.spec`. A key the code has but this module cannot explain is an error, so the
reference cannot fall behind the code: ``tests/test_docs.py`` fails when docs/config.md differs
from what this module writes.

    python -m gossip_pfl.config_doc --write     # regenerate docs/config.md
    python -m gossip_pfl.config_doc --check     # exit 1 if docs/config.md is stale
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from gossip_pfl import config as _config
from gossip_pfl.data.images import EMNIST_SPLITS

#: the generated page, relative to the repository root
DOC_PATH = Path("docs/config.md")

#: meanings of fields whose definition carries no ``#:`` comment (key path -> text)
MEANINGS: dict[str, str] = {
    "seed": "seeds model initialization, minibatch order, participation and schedule draws "
    "(every draw derives from it and a counter, never from the rank)",
    "rounds": "communication rounds to train",
    "out": "output folder: config.yaml, metrics.jsonl, summary.json, plots/, checkpoint.pt "
    "(`--out DIR` overrides it)",
    "checkpoint_every": "save `checkpoint.pt` every k rounds (always after the last round)",
    "algorithm.lr": "local step size (the solver's learning rate)",
    "algorithm.momentum": "local SGD momentum, in [0, 1)",
    "algorithm.weight_decay": "L2 weight decay of the local solver",
    "algorithm.batch_size": "minibatch size of a local step",
    "algorithm.local_epochs": "passes over the data per round (left unset with `local_steps`)",
    "algorithm.local_steps": "fixed local steps per round instead of epochs (0: pure gossip)",
    "eval.every": "evaluate every k rounds and after the last",
    "rule.beta2": "FedAdam / FedYogi / FedAdagrad: second-moment decay",
    "schedule": "the topology: a spec mapping (keys below) or the path of a schedule YAML "
    "(relative to the config file); unset for server and local algorithms. `n` is filled in "
    "from the data",
    "participation": "clients per round: a count (int) or a fraction in (0, 1]; sampled "
    "from (seed, round)",
}

#: keys whose value is a name from a registry: the meaning lists the registry
REGISTRY_KEYS = {
    "data.name": ("the dataset, options below", "gossip_pfl.data", "DATASETS"),
    "model.name": ("the model, options below", "gossip_pfl.models", "MODELS"),
    "algorithm.name": ("the algorithm (docs/algorithms.md)", "gossip_pfl.algorithms", "ALGORITHMS"),
    "rule.name": (
        "the aggregation rule (docs/rules.md); unset: the algorithm's",
        "gossip_pfl.algorithms.rules",
        "RULE_NAMES",
    ),
}

#: dataset options (``data: {name: X, <option>: ...}``)
DATA_OPTIONS: dict[str, str] = {
    # synthetic (make_synthetic)
    "n_clients": "number of clients (peers); LEAF: a seeded choice of writers, null: all",
    "dim": "input dimension d",
    "n_components": "number of true mixture components",
    "alpha": "Dirichlet parameter of each client's mixture weights pi_t",
    "n_test": "test samples per client (the test inputs take n_clients * n_test * dim * 4 bytes)",
    "noise_std": "standard deviation of the logit noise eps",
    "seed": "seed of the data (generation, partition and split; not the run's seed)",
    "clustered": "one-hot pi_t: every client draws from a single component",
    "val_fraction": "share of each client's training samples moved to validation",
    "unseen_fraction": "share of clients held out of training, evaluated apart",
    "cache_dir": "where the generated data is cached (default `$GOSSIP_PFL_CACHE` or "
    "`~/.cache/gossip-pfl`; relative to the config file)",
    "cache": "read and write the cache",
    # image datasets
    "root": "folder holding the dataset's files (docs/data.md), relative to the config file; "
    "fashion_mnist defaults to `/usr/share/datasets/fashion-mnist`, the others need it",
    "partition": "how samples are spread over clients: `{kind: dirichlet, alpha, min_size}`, "
    "`{kind: fedem_mixture, n_components, alpha, min_size}`, "
    "`{kind: pathological, classes_per_client}`; LEAF: `{kind: natural}` (by writer)",
    "split": "each client's train / validation / test shares",
    "fraction": "seeded share of the pooled images kept before partitioning",
    "emnist.split": "EMNIST's own split: "
    + ", ".join(EMNIST_SPLITS)
    + "; EMNIST keeps the 60/20/20 client split",
    # LEAF
    "writer_fraction": "seeded share of the writers with min_samples drawn: round(f x those), "
    "at least one, less those the split cannot cut (FedEM used 0.15 on FEMNIST)",
    "min_samples": "writers with fewer samples are dropped (and, with a warning, those the "
    "split cannot cut: docs/data.md)",
    "leaf_split": "keep LEAF's own test files as the test sets (train / val from `split`); "
    "writers missing from either are left out",
}

#: model options (``model: {name: X, <option>: ...}``): "model.option" -> meaning
MODEL_OPTIONS: dict[str, str] = {
    "mlp.hidden": "widths of the hidden ReLU layers",
    "cnn.channels": "output channels of the two 5x5 convolutions (the default is the paper's "
    "full width, slow on a small CPU: docs/simulate.md)",
    "cnn.hidden": "units of the dense ReLU layer",
    "lstm.embed": "token embedding size",
    "lstm.hidden": "LSTM hidden size",
    "lstm.layers": "stacked LSTM layers",
    "mobilenet_v2.**options": "passed to torchvision's `mobilenet_v2` (needs torchvision)",
}

#: schedule spec keys (topologies.spec.KNOWN_KEYS)
SCHEDULE_KEYS: dict[str, str] = {
    "n": "peers (filled in from the data in a run; optional for a graph file or object)",
    "graph": "a family (below), a file (edge list with integer ids or names, `.npy` "
    "adjacency, `.npz` matrices, `.graphml`, `.gml`; relative to the spec file) or, from "
    "Python, a networkx graph",
    "graph_args": "the family's arguments (below)",
    "weights": "metropolis (default), max_degree, best_constant, fmmc, uniform (none for a "
    "time_varying matching: it fixes its own)",
    "time_varying": "`{kind: link_failure, q}`, `{kind: random}`, `{kind: matching}`, "
    "`{kind: periodic, graphs: [...]}` or `{kind: periodic, file: W.npz}`; omitted: static",
    "seed": "seed of every random draw of the schedule (a run sets it to the run's seed)",
}

FAMILY_ARGS: dict[str, str] = {
    "rows": "grid rows",
    "cols": "grid columns",
    "k": "offset base (exponential), neighbours per side (small_world), degree bound (base)",
    "p": "edge probability (erdos_renyi), rewiring probability (small_world)",
    "d": "degree",
    "max_tries": "redraws until the graph is connected",
    "participation": "share of peers sampled per round",
    "hub": "`aggregator` (an extra node n) or `peer` (peer 0)",
    "sizes": "the peers' dataset sizes, the hub's weights (default: equal)",
}


# --------------------------------------------------------------------------- reading the code


def field_comments(cls) -> dict[str, str]:
    """``#:`` comments of a dataclass's fields: the lines right above a field and the one on
    its line, joined."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.string.startswith("#:"):
            comments[tok.start[0]] = tok.string[2:].strip()
    lines = source.splitlines()
    out = {}
    (node,) = ast.parse(source).body
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        above = []
        line = item.lineno - 1
        while line in comments and lines[line - 1].lstrip().startswith("#:"):
            above.insert(0, comments[line])
            line -= 1
        parts = above + ([comments[item.end_lineno]] if item.end_lineno in comments else [])
        if parts:
            out[item.target.id] = " ".join(parts)
    return out


def type_name(hint: Any) -> str:
    if hint is Any:
        return "any"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        names = " or ".join(type_name(a) for a in args)
        return f"{names} or null" if len(args) < len(typing.get_args(hint)) else names
    hint = origin or hint
    return {list: "list", dict: "mapping", tuple: "list"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def yaml_value(value: Any) -> str:
    """A default as it would be written in a YAML config."""
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, Path):
        value = str(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False)
    text = text.strip()
    return text.removesuffix("...").strip()


def _registry(key: str) -> str:
    what, module, name = REGISTRY_KEYS[key]
    names = getattr(__import__(module, fromlist=[name]), name)
    return f"{what}: " + ", ".join(f"`{n}`" for n in names)


def config_rows(cls=None, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key path, type, default, meaning) of every run-config key, sections depth first."""
    cls = cls or _config.RunConfig
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    open_key = _config._OPEN_SECTIONS.get(cls)
    rows, sections = [], []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            sections.append((hints[f.name], f"{key}."))
            continue
        if f.name == open_key:
            continue  # the section's other keys: the options listed below
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()
        if key in REGISTRY_KEYS:
            meaning = _registry(key)
        elif key in MEANINGS:
            meaning = MEANINGS[key]
        elif f.name in comments:
            meaning = comments[f.name]
        else:
            raise KeyError(
                f"config key '{key}' has no meaning: give its field a '#:' comment in "
                "gossip_pfl/config.py or add it to MEANINGS in gossip_pfl/config_doc.py"
            )
        rows.append((key, type_name(hints[f.name]), yaml_value(default), meaning))
    for sub, sub_prefix in sections:
        rows.extend(config_rows(sub, sub_prefix))
    return rows


def section_docs() -> dict[str, str]:
    """Docstrings of the config sections (first paragraph), by section name."""
    out = {}
    for f in dataclasses.fields(_config.RunConfig):
        hint = typing.get_type_hints(_config.RunConfig)[f.name]
        if dataclasses.is_dataclass(hint) and hint.__doc__ and "(" not in hint.__doc__[:20]:
            out[f.name] = " ".join(inspect.cleandoc(hint.__doc__).split("\n\n")[0].split())
    return out


def data_rows() -> list[tuple[str, str, str, str]]:
    """(option, datasets, default, meaning) of every dataset option."""
    from gossip_pfl import data as d
    from gossip_pfl.data.synthetic import make_synthetic

    per_set: dict[str, dict[str, Any]] = {}
    synthetic = {k: p.default for k, p in inspect.signature(make_synthetic).parameters.items()}
    images = dict(d._IMAGE_DEFAULTS)
    leaf = dict(d._LEAF_DEFAULTS)
    for name in d.DATASETS:
        if name == "synthetic":
            per_set[name] = synthetic
        elif name in ("femnist", "shakespeare"):
            per_set[name] = {**leaf, "min_samples": 2 if name == "shakespeare" else 1}
        elif name == "emnist":
            per_set[name] = {**images, "fraction": 0.1, "split": "byclass"}
        elif name == "cifar10":
            per_set[name] = {**images, "n_clients": 80}
        else:
            per_set[name] = images
    # one row per (option, default), listing the datasets that share it
    rows: dict[tuple[str, str], list[str]] = {}
    for name, options in per_set.items():
        for option, default in options.items():
            rows.setdefault((option, yaml_value(default)), []).append(name)
    out = []
    order = list(dict.fromkeys(option for option, _ in rows))  # variants of an option together
    for (option, default), names in sorted(rows.items(), key=lambda r: order.index(r[0][0])):
        own = f"{names[0]}.{option}" if len(names) == 1 else None
        meaning = DATA_OPTIONS.get(own) or DATA_OPTIONS.get(option)
        if meaning is None:
            raise KeyError(
                f"dataset option '{option}' has no meaning: add it to DATA_OPTIONS in "
                "gossip_pfl/config_doc.py"
            )
        where = "all" if len(names) == len(per_set) else ", ".join(names)
        out.append((option, where, default, meaning))
    return out


def model_rows() -> list[tuple[str, str, str]]:
    """(model.option, default, meaning) of every model option."""
    from gossip_pfl.models import MODELS

    out = []
    for name, build in MODELS.items():
        params = list(inspect.signature(build).parameters.values())[2:]  # after shape, outputs
        for p in params:
            key = f"{name}.**{p.name}" if p.kind is p.VAR_KEYWORD else f"{name}.{p.name}"
            if key not in MODEL_OPTIONS:
                raise KeyError(
                    f"model option '{key}' has no meaning: add it to MODEL_OPTIONS in "
                    "gossip_pfl/config_doc.py"
                )
            default = "" if p.default is p.empty else yaml_value(p.default)
            out.append((key.replace("**", ""), default, MODEL_OPTIONS[key]))
    return out


def schedule_rows() -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """Schedule spec keys, and every graph family with its arguments."""
    from topologies import graphs
    from topologies.spec import KNOWN_KEYS, TIME_VARYING_FAMILIES

    for key in KNOWN_KEYS:
        if key not in SCHEDULE_KEYS:
            raise KeyError(f"schedule key '{key}' has no meaning: add it to SCHEDULE_KEYS")
    keys = [(k, SCHEDULE_KEYS[k]) for k in KNOWN_KEYS]
    families = []
    for name, build in graphs.GRAPH_FAMILIES.items():
        params = [p for p in list(inspect.signature(build).parameters.values())[1:]]
        args = []
        for p in params:
            if p.name == "seed":
                continue
            if p.name not in FAMILY_ARGS:
                raise KeyError(f"graph argument '{name}.{p.name}' has no meaning: add it")
            args.append(p.name if p.default is p.empty else f"{p.name}={yaml_value(p.default)}")
        doc = (build.__doc__ or "").strip().splitlines()[0].rstrip(".")
        families.append((name, ", ".join(args) or "-", doc))
    from topologies import schedules

    classes = {
        "one_peer_exponential": schedules.OnePeerExponentialSchedule,
        "base": schedules.BaseGraphSchedule,
        "server": schedules.ServerSchedule,
    }
    for name, params in TIME_VARYING_FAMILIES.items():
        signature = inspect.signature(classes[name].__init__).parameters
        shown = []
        for p in params:
            if p not in FAMILY_ARGS:
                raise KeyError(f"graph argument '{name}.{p}' has no meaning: add it")
            if p == "sizes":  # the schedule's `weights` argument
                shown.append("sizes=null")
            else:
                shown.append(f"{p}={yaml_value(signature[p].default)}")
        what = {
            "one_peer_exponential": "time-varying: one peer per round, exact average after "
            "log2(n) rounds (Ying et al., Exponential Graph is Provably Efficient for "
            "Decentralized Deep Training, 2021)",
            "base": "time-varying: Base-(k+1) graph, exact average for any n "
            "(Takezawa et al., Beyond Exponential Graph: Communication-Efficient Topologies "
            "for Decentralized Learning via Finite-time Convergence, 2023)",
            "server": "a hub and two phases per round (up, down)",
        }.get(name)
        if what is None:
            raise KeyError(f"time-varying family '{name}' has no description: add it")
        families.append((name, ", ".join(shown) or "-", what))
    return keys, families


# --------------------------------------------------------------------------- the page


def _cell(text: str) -> str:
    return text.replace("``", "`").replace("|", "\\|")


def render() -> str:
    """The whole of docs/config.md."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m gossip_pfl.config_doc --write` from gossip_pfl/config.py,",
        "     the dataset loaders, the models and topologies/spec.py; do not edit by hand.",
        "     tests/test_docs.py fails when this page is stale. -->",
        "",
        "A run config is a YAML file of the keys below; every key has a default, so a config",
        "names only what it changes. `--set a.b=value` overrides any key from the command line",
        "(the value is read as YAML). Precedence: `--set` > the file > the defaults (no file",
        "on the command line: the embedded demo, `gossip_pfl/defaults/demo.yaml`; from Python,",
        "`load_config(None, overrides)` starts from the defaults alone). An unknown key is an",
        "error with a did-you-mean, a key given twice names its line, a wrong type names the key,",
        "cross-field checks name the key to change, and a key the run does not read (another",
        "algorithm's, rule's or dataset's) names what reads it ([rules.md](rules.md)). Paths",
        "in a config are relative to it, given with `--set` relative to the working folder;",
        "the run's `config.yaml` holds them absolute. `out` is the exception: it is read from",
        "the working folder and kept as written (`out: runs/x` writes `./runs/x`).",
        "",
        "## Run config",
        "",
    ]
    docs = section_docs()
    current = None
    for key, typ, default, meaning in config_rows():
        section = key.split(".")[0] if "." in key else ""
        if section != current:
            current = section
            if section:
                lines += ["", f"### `{section}`", ""]
                if section in docs:
                    lines += [docs[section].replace("``", "`"), ""]
            lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        lines.append(f"| `{key}` | {typ} | `{_cell(default)}` | {_cell(meaning)} |")
    lines += [
        "",
        "## Dataset options",
        "",
        "Every key of `data:` besides `name` goes to the dataset's loader (docs/data.md);",
        "an option the dataset does not take is an error naming it.",
        "",
        "| option | datasets | default | meaning |",
        "|---|---|---|---|",
    ]
    for option, where, default, meaning in data_rows():
        lines.append(f"| `{option}` | {where} | `{_cell(default)}` | {_cell(meaning)} |")
    lines += [
        "",
        "## Model options",
        "",
        "Every key of `model:` besides `name` goes to the model's constructor.",
        "",
        "| option | default | meaning |",
        "|---|---|---|",
    ]
    for key, default, meaning in model_rows():
        shown = f"`{_cell(default)}`" if default else "-"
        lines.append(f"| `{key}` | {shown} | {_cell(meaning)} |")
    keys, families = schedule_rows()
    lines += [
        "",
        "## Schedule keys",
        "",
        "The value of `schedule:` in a run config, or a schedule YAML file (docs/topologies.md).",
        "",
        "| key | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{k}` | {_cell(m)} |" for k, m in keys]
    lines += [
        "",
        "Graph families (`graph:`) and their `graph_args` (`name=default`; no default: required):",
        "",
        "| family | graph_args | what |",
        "|---|---|---|",
    ]
    lines += [f"| `{n}` | {_cell(a)} | {_cell(w)} |" for n, a, w in families]
    lines += [
        "",
        "Arguments: " + "; ".join(f"`{k}`: {v}" for k, v in FAMILY_ARGS.items()) + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gossip_pfl.config_doc",
        description="Print the configuration reference generated from the code.",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"write it to {DOC_PATH}")
    group.add_argument("--check", action="store_true", help=f"exit 1 if {DOC_PATH} differs")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.write_text(text)
        print(f"wrote {DOC_PATH}")
    elif args.check:
        if not DOC_PATH.is_file() or DOC_PATH.read_text() != text:
            print(f"{DOC_PATH} is stale: run python -m gossip_pfl.config_doc --write")
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
