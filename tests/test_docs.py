"""README.md and docs/ cannot rot: every command, config file, code block and link in them is
checked here.

* Every command of a ```bash block runs, page by page in document order, in a scratch folder
  that sees the repository's configs/, launch/ and benchmarks/ (so nothing a page writes lands
  in the repository). ``gossip-pfl`` commands run in this process (no interpreter start-up);
  ``gossip-pfl run`` gets a small round count and smaller data (``small_run_args``) and no
  figures (``--no-plots``; tests/test_plots.py checks them). Commands
  that need many torchrun ranks, a GPU, SLURM or many minutes are checked by parsing only: their
  script exists and compiles and takes the options given. ``RULES`` says, for every kind of
  command, what is done with it; a command no rule covers fails the test.
* Every ```python block runs (pages in ``PYTHON_PAGES``), in one namespace per page, after the
  bash blocks before it.
* Every config file a page names loads, and a run config runs for 2 rounds; every ```yaml block
  parses, and one that is a run config or a schedule spec builds.
* Every relative link points to a file (and a heading) that exists.
* docs/config.md is what ``python -m gossip_pfl.config_doc`` generates; every ``gossip-pfl``
  subcommand and argument has a help line; the README stays short and no page points to a path
  users do not have.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import py_compile
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
#: pages whose ```python blocks are scripts (docs/rules.md's are fragments of an interface)
PYTHON_PAGES = {p.name for p in PAGES} - {"rules.md"}
#: folders of the repository a scratch folder sees (read only by the commands)
SHARED = ("configs", "launch", "benchmarks")
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
README_MAX_LINES = 250

# --------------------------------------------------------------------------- reading pages


@dataclass
class Block:
    lang: str
    line: int  # line of the first line inside the fence
    text: str


def blocks(page: Path) -> list[Block]:
    """Fenced code blocks (``` or ~~~ at the start of a line), in order."""
    out, fence, lang, start, body = [], None, "", 0, []
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        stripped = line.strip()
        if fence is None:
            m = re.match(r"^\s{0,3}(`{3,}|~{3,})\s*([\w+-]*)", line)
            if m:
                fence, lang, start, body = m.group(1), m.group(2).lower(), number + 1, []
        elif stripped.startswith(fence) and not stripped.strip(fence[0]):
            out.append(Block(lang, start, "\n".join(body)))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{page.name}: a code fence opened at line {start - 1} never closes"
    return out


def commands(block: Block) -> list[tuple[int, list[str]]]:
    """(line, argv) of every simple command of a bash block: continuation lines joined, comments
    dropped, split at ``&&``, ``;`` and ``&`` (a background job runs in turn here)."""
    out, pending, first = [], "", 0
    for offset, line in enumerate(block.text.splitlines()):
        if not pending:
            first = block.line + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text, pending = pending + line, ""
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        argv: list[str] = []
        for token in lexer:
            if token in ("&&", ";", "&"):
                if argv:
                    out.append((first, argv))
                argv = []
            elif token in ("|", "||", ">", ">>", "<", "(", ")"):
                raise AssertionError(
                    f"line {first}: keep doc commands simple (no pipes, redirections or "
                    f"subshells): {text.strip()!r}"
                )
            else:
                argv.append(token)
        if argv:
            out.append((first, argv))
    return out


# --------------------------------------------------------------------------- running commands


class Workspace:
    """A scratch folder for one page's commands, with configs/, launch/ and benchmarks/ linked
    in; ``gossip-pfl`` runs in-process with the folder as the current directory."""

    def __init__(self, path: Path, monkeypatch):
        self.path = path
        self.monkeypatch = monkeypatch
        self.ran_configs: set[Path] = set()
        for name in SHARED:
            (path / name).symlink_to(ROOT / name)
        monkeypatch.chdir(path)
        monkeypatch.setenv("GOSSIP_PFL_CACHE", str(path.parent / "cache"))

    def gossip_pfl(self, argv: list[str], env: dict[str, str]) -> str:
        from gossip_pfl.cli import main

        out = io.StringIO()
        with self.environ(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(argv)
            except SystemExit as stop:  # argparse errors, --help
                code = stop.code or 0
        assert code == 0, f"exit status {code}:\n{out.getvalue()[-3000:]}"
        return out.getvalue()

    @contextlib.contextmanager
    def environ(self, env: dict[str, str]):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _sets(args: list[str]) -> dict[str, str]:
    """The ``--set KEY=VALUE`` pairs of a run command."""
    return dict(a.split("=", 1) for k, a in zip(args, args[1:]) if k == "--set" and "=" in a)


def small_run_args(args: list[str]) -> list[str]:
    """``--set`` overrides that make a ``gossip-pfl run`` take seconds: 2 rounds (3 when it
    resumes a 2-round run), one evaluation, and on the large data sets fewer clients and
    samples. The command's own values stand where a page sets them on purpose (clients to fit a
    graph)."""
    from gossip_pfl.cli_run import default_config
    from gossip_pfl.config import load_config

    if "--resume" in args:
        return ["--set", "rounds=3"]
    sets = _sets(args)
    config = next((a for a in args if a.endswith((".yaml", ".yml")) and "=" not in a), None)
    overrides = [f"{k}={v}" for k, v in sets.items()]
    cfg = (
        load_config(config, overrides)
        if config
        else load_config(None, overrides, base=default_config())
    )
    extra = {"rounds": "2", "eval.every": "2"}
    data = cfg.data.options
    from gossip_pfl.algorithms import get_algorithm

    spec = get_algorithm(cfg.algorithm.name)
    workload = spec.workload
    mixture = not spec.single_model and cfg.algorithm.components > 1
    # (the others' runs, and runs without unseen clients, refuse a key they do not read)
    if workload == "model" and mixture and data.get("unseen_fraction", 0) > 0:
        extra["eval.unseen_em"] = "one_step"
    if workload == "expfam":  # its data is expfam.*
        pass
    elif cfg.data.name == "synthetic":
        extra["data.n_test"] = "20"
        if data.get("n_clients", 300) > 100 and "data.n_clients" not in sets:
            extra["data.n_clients"] = "40"
    elif cfg.data.name == "fashion_mnist":
        if not FASHION_MNIST.is_dir():
            raise Unavailable(
                "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)"
            )
        extra.update({"data.fraction": "0.03", "data.n_clients": "10"})
    out = []
    for key, value in extra.items():
        out += ["--set", f"{key}={value}"]
    return out


class Unavailable(Exception):
    """What a command needs is not on this machine (the command is reported as skipped)."""


def parse_only_gossip_pfl(argv: list[str]) -> None:
    """The arguments parse, and the config files named exist."""
    from gossip_pfl.cli import build_parser

    build_parser().parse_args(argv)
    for arg in argv:
        if arg.endswith((".yaml", ".yml")):
            assert Path(arg).is_file(), f"{arg} does not exist"


def check_script(script: str, args: list[str]) -> None:
    """Parse-only check of a script command: it exists and compiles (bash -n for shell
    scripts), every --option given appears in its source, every config file given exists."""
    path = Path(script)
    assert path.is_file(), f"{script} does not exist"
    text = path.read_text()
    if path.suffix == ".py":
        py_compile.compile(str(path), doraise=True)
    else:
        assert os.access(path, os.X_OK) or script.endswith(".sbatch"), f"{script} not executable"
        subprocess.run(["bash", "-n", str(path)], check=True)
    for arg in args:
        if arg.startswith("--") and arg != "--set":
            option = arg.split("=", 1)[0]
            assert f'"{option}"' in text, f"{script} has no option {option}"
        elif arg.endswith((".yaml", ".yml")):
            assert Path(arg).is_file(), f"{arg} does not exist"


def torchrun_inner(argv: list[str]) -> tuple[int, list[str]]:
    """(ranks, the gossip-pfl arguments) of ``torchrun [...] -m gossip_pfl ARGS``."""
    assert "-m" in argv and argv[argv.index("-m") + 1] == "gossip_pfl", argv
    ranks = 1
    for arg in argv[: argv.index("-m")]:
        if arg.startswith("--nproc_per_node="):
            ranks = int(arg.split("=", 1)[1])
    return ranks, argv[argv.index("-m") + 2 :]


#: torchrun commands already run (by any page): the same command runs once
_TORCHRUN_DONE: set[str] = set()


def run_torchrun(ws: Workspace, argv: list[str]) -> str | None:
    """Two CPU ranks run for real (once per command text); more ranks or a GPU: parse only."""
    ranks, inner = torchrun_inner(argv)
    parse_only_gossip_pfl(inner)
    if ranks != 2 or "runtime.device=cuda" in inner:
        return f"parse only: {ranks} ranks / GPU"
    if shlex.join(argv) in _TORCHRUN_DONE:
        return "ran on another page"
    _TORCHRUN_DONE.add(shlex.join(argv))
    extra = small_run_args(inner[1:])
    cmd = ["torchrun", *argv[1 : argv.index("-m")], "-m", "gossip_pfl", *inner, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return None


SKIPPED = {
    # setup and CI commands: .ci/run runs them on a clean machine before this test
    ("pip", "install"): "installs (what .ci/run does)",
    ("python", "-m", "venv"): "makes the virtual environment (setup)",
    ("source",): "activates the virtual environment (setup)",
    ("python", "-m", "pytest"): "the test suite this test is part of",
    ("ruff",): "lint: .ci/run runs it before the tests",
    ("bash", ".ci/run"): "CI itself",
    ("wait",): "waits for background jobs, which run in turn here",
}

#: commands checked by parsing, not run, and why (matched on the start of the command)
PARSE_ONLY = {
    "python benchmarks/": "benchmarks take minutes (one study 22): script, options checked",
    "launch/": "launch scripts start torchrun with their own ranks: bash -n, config checked",
    "benchmarks/gpu_kit.sh": "for a lent GPU machine (prepare downloads wheels): bash -n",
    "sbatch ": "needs SLURM: bash -n, config checked",
    "gossip-pfl plot runs/fashion_mnist/": "plots the 22-minute study's runs: arguments parsed",
    "gossip-pfl peers-local configs/synthetic/p2p_small.yaml -n 4 --out runs/p2p_kill": "tests/"
    "test_zmq_p2p.py runs this command (14 s: four processes and a restart) and checks its output",
}

RULES = (
    """
gossip-pfl ...            run in this process (run: small_run_args)
torchrun ... -m gossip_pfl run: 2 CPU ranks for real, more ranks or CUDA parsed
python -m gossip_pfl.config_doc ...  run in this process (writes into the scratch folder)
"""
    + "\n".join(f"{k:<25} parse only: {v}" for k, v in PARSE_ONLY.items())
    + "\n"
    + "\n".join(f"{' '.join(k):<25} skipped: {v}" for k, v in SKIPPED.items())
)


def run_command(ws: Workspace, argv: list[str], done: set[str]) -> str:
    """Run or check one command; returns what was done with it."""
    text = shlex.join(argv)
    env = {}
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        key, value = argv[0].split("=", 1)
        env[key] = value
        argv = argv[1:]
    for prefix, why in SKIPPED.items():
        if tuple(argv[: len(prefix)]) == prefix:
            return f"skipped: {why}"
    bare = shlex.join(argv)  # without the environment: `X=1 python benchmarks/...` too
    for prefix, why in PARSE_ONLY.items():
        if bare.startswith(prefix):
            if argv[0] == "gossip-pfl":
                parse_only_gossip_pfl(argv[1:])
            elif argv[0] == "python":
                check_script(argv[1], argv[2:])
            else:
                script = argv[1] if argv[0] == "sbatch" else argv[0]
                check_script(script, argv[1:] if argv[0] != "sbatch" else argv[2:])
            return f"parse only: {why}"
    if text in done:
        return "ran above"
    done.add(text)
    try:
        return _run(ws, argv, env)
    except Unavailable as why:
        return f"skipped: {why}"


def _run(ws: Workspace, argv: list[str], env: dict[str, str]) -> str:
    if argv[0] == "gossip-pfl":
        args = [a for arg in argv[1:] for a in (sorted(Path().glob(arg)) if "*" in arg else [arg])]
        args = [str(a) for a in args]
        if args and args[0] == "run" and "--help" not in args:
            # figures cost a second a run (matplotlib); tests/test_cli_run.py and
            # tests/test_plots.py check them, and a page's `gossip-pfl plot` still draws its own
            args = args + small_run_args(args[1:]) + ["--no-plots"]
            ws.ran_configs.update(Path(a).resolve() for a in args if a.endswith(".yaml"))
        ws.gossip_pfl(args, env)
        return "ran"
    if argv[0] == "torchrun":
        return run_torchrun(ws, argv) or "ran (2 ranks)"
    if argv[:3] == ["python", "-m", "gossip_pfl.config_doc"]:
        from gossip_pfl import config_doc

        (ws.path / "docs").mkdir(exist_ok=True)
        assert config_doc.main(argv[3:]) == 0
        return "ran"
    raise AssertionError(f"no rule for this command; the rules:\n{RULES}")


def check_yaml(block: Block) -> None:
    """A YAML block parses; a run config or a schedule spec in it builds."""
    from gossip_pfl.config import RunConfig, from_dict, validate
    from topologies.spec import KNOWN_KEYS, schedule_from_spec

    data = yaml.safe_load(block.text)
    if not isinstance(data, dict):
        return
    run_keys = {f for f in RunConfig.__dataclass_fields__}
    if set(data) <= set(KNOWN_KEYS):
        spec = dict(data)
        periodic = (spec.get("time_varying") or {}).get("kind") == "periodic"
        if "graph" not in spec and not periodic:
            spec["graph"] = "ring"
        spec.setdefault("n", 16)
        schedule_from_spec(spec)
    elif set(data) <= run_keys:
        cfg = from_dict(RunConfig, data)  # key names and types
        if "algorithm" in data:  # a whole config, not a list of some keys: cross-field checks
            validate(cfg)


NAMED_FILE = re.compile(r"(?<![\w/.-])(configs/[\w/.-]+\.(?:yaml|yml|txt|graphml|gml|npy|npz))")


def check_named_files(ws: Workspace, page: Path) -> list[str]:
    """Every configs/... file the page names exists; run configs run for 2 rounds (unless a
    command of the page ran them, or the page names them only in ```text blocks: commands
    shown, too long for this test), schedule specs and graphs load."""
    from topologies import load_graph, load_schedule

    text = page.read_text()
    shown = {n for b in blocks(page) if b.lang == "text" for n in NAMED_FILE.findall(b.text)}
    for b in blocks(page):
        if b.lang == "text":
            text = text.replace(b.text, "")
    checked = []
    for name in sorted(set(NAMED_FILE.findall(page.read_text()))):
        path = ROOT / name
        assert path.is_file(), f"{page.name} names {name}, which does not exist"
        if name in shown and name not in NAMED_FILE.findall(text):
            continue  # exists; only shown
        if path.suffix in (".yaml", ".yml") and path.parent.name == "topologies":
            load_schedule(path)
        elif path.suffix in (".yaml", ".yml"):
            if path.resolve() in ws.ran_configs:
                continue
            args = ["run", name, "--out", f"runs/_named/{path.parent.name}_{path.stem}"]
            try:  # figures: checked by test_plots.py and test_cli_run.py
                ws.gossip_pfl(args + small_run_args(args[1:]) + ["--no-plots"], {})
            except Unavailable:
                continue
        else:
            load_graph(path)
        checked.append(name)
    return checked


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_commands_and_code_run(page, tmp_path, monkeypatch):
    if not page.is_file():
        pytest.skip(f"{page.name} is gone")
    work = tmp_path / "work"
    work.mkdir()
    ws = Workspace(work, monkeypatch)
    from gossip_pfl import algorithms

    # a page may register an algorithm (algorithms.md does): only for this page
    monkeypatch.setattr(algorithms, "ALGORITHMS", dict(algorithms.ALGORITHMS))
    namespace: dict = {"__name__": "__doc__"}
    done: set[str] = set()
    report = []  # what was done with each command (shown with -s, or -rA)
    for block in blocks(page):
        where = f"{page.name} line {block.line}"
        if block.lang in ("bash", "sh", "shell"):
            for line, argv in commands(block):
                try:
                    report.append(f"line {line}: {run_command(ws, argv, done)}: {shlex.join(argv)}")
                except pytest.skip.Exception:
                    raise
                except BaseException as err:
                    raise AssertionError(
                        f"{page.name} line {line}: `{shlex.join(argv)}` failed: {err}"
                    ) from err
        elif block.lang == "python" and page.name in PYTHON_PAGES:
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    exec(compile(block.text, f"{where} (python)", "exec"), namespace)
            except BaseException as err:
                raise AssertionError(f"{where}: the python block failed: {err!r}") from err
        elif block.lang in ("yaml", "yml"):
            try:
                check_yaml(block)
            except BaseException as err:
                raise AssertionError(f"{where}: the yaml block does not build: {err}") from err
    named = check_named_files(ws, page)
    print(f"{page.name}:", *report, f"named files checked: {', '.join(named) or '-'}", sep="\n  ")


# --------------------------------------------------------------------------- static checks


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose(page: Path) -> list[str]:
    """The lines of a page outside its code fences."""
    out, fence = [], None
    for line in page.read_text().splitlines():
        m = re.match(r"^\s{0,3}(`{3,}|~{3,})", line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            out.append(line)
    return out


def anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in prose(page) if line.startswith("#")}


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_point_to_files_and_headings(page):
    for target in LINK.findall("\n".join(prose(page))):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        assert dest.exists(), f"{page.name}: link to {target}: {dest} does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{page.name}: link to {target}: no such heading"


def test_no_page_points_to_paths_users_lack():
    for page in PAGES:
        assert "../shared" not in page.read_text(), f"{page.name} points to ../shared"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_config_reference_is_current():
    from gossip_pfl import config_doc

    assert (ROOT / "docs" / "config.md").read_text() == config_doc.render(), (
        "docs/config.md is stale: run python -m gossip_pfl.config_doc --write"
    )


def _parsers(parser: argparse.ArgumentParser, name: str):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for sub, subparser in action.choices.items():
                assert helps.get(sub), f"'{name} {sub}' has no help line"
                yield from _parsers(subparser, f"{name} {sub}")


def test_every_subcommand_and_argument_has_help():
    from gossip_pfl.cli import build_parser

    for name, parser in _parsers(build_parser(), "gossip-pfl"):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            what = "/".join(action.option_strings) or action.dest
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {what}: no help"


def test_command_splitting():
    block = Block(
        "bash", 1, "A=1 gossip-pfl run x.yaml --set 'k=a b' &\\\n  python y.py; wait  # c\n"
    )
    assert commands(block) == [
        (1, ["A=1", "gossip-pfl", "run", "x.yaml", "--set", "k=a b"]),
        (1, ["python", "y.py"]),
        (1, ["wait"]),
    ]
