"""Checkpoints: the whole run's state in one file, written atomically by rank 0.

Per-peer tensors are stored in peer order (not per rank), so a run can resume on a different
number of ranks. Randomness is counter-based (every draw derives from the seed, the peer and
the round), so the round counter is the RNG state: nothing else needs saving for the resumed
run to draw exactly what the uninterrupted one would have.

The file is a two-line text header followed by the ``torch.save`` payload::

    gossip-pfl checkpoint v1
    sha256 <64 hex digits of the payload> bytes <payload length>
    <payload>

:func:`load` checks the header, the length and the digest before unpickling anything, so a file
altered or truncated after it was written is refused instead of resuming with garbage;
:func:`check_structure` then checks the keys, types and shapes against the run before the
trainer touches its own state. :func:`save` writes a temporary file, fsyncs it, renames it over
the previous checkpoint and fsyncs the folder: at every instant ``checkpoint.pt`` is either the
old complete checkpoint or the new one, and a failed write leaves no temporary file behind.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from gossip_pfl.errors import GossipError
from gossip_pfl.rundir import CHECKPOINT_FILE as FILE
from gossip_pfl.rundir import is_number

FORMAT_VERSION = 1
_MAGIC_PREFIX = b"gossip-pfl checkpoint "
MAGIC = _MAGIC_PREFIX + b"v%d\n" % FORMAT_VERSION
_FIELDS = re.compile(rb"sha256 ([0-9a-f]{64}) bytes ([0-9]{1,20})")
_MAX_FIELDS_LINE = 128  # the second header line is about 90 bytes

#: The keys Trainer.checkpoint writes and Trainer.restore reads.
REQUIRED_KEYS = (
    "rounds_done",
    "config",
    "shared",
    "aux",
    "personal",
    "momentum",
    "eta",
    "rule_state",
    "client_state",
    "times",
    "kind_bytes",
    "traffic",
    "rows",
)


# ---- writing -------------------------------------------------------------------------------
def save(state: dict, run_dir: str | Path) -> Path:
    """Write ``state`` to RUN_DIR/checkpoint.pt with a content digest; returns the path.

    Tensors that do not own their whole storage (views, slices) are copied first, so the file
    holds only the bytes the state needs. The bytes go to ``checkpoint.pt.tmp``, which is
    flushed and fsynced, then renamed over ``checkpoint.pt`` (atomic), and the folder is fsynced
    where the OS allows it. If any step fails (full disk, no permission, ...) the temporary file
    is removed, the previous ``checkpoint.pt`` is left as it was, and a one-line
    :class:`GossipError` says so.
    """
    path = Path(run_dir) / FILE
    tmp = path.with_suffix(".pt.tmp")
    had_previous = path.is_file()
    try:
        buffer = io.BytesIO()
        torch.save(_own_storage(state), buffer)
        payload = buffer.getbuffer()
        digest = hashlib.sha256(payload).hexdigest()
        header = MAGIC + f"sha256 {digest} bytes {len(payload)}\n".encode("ascii")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        _discard(tmp)
        kept = "the previous checkpoint is kept" if had_previous else "no checkpoint was written"
        raise GossipError(
            f"{path}: could not write the checkpoint ({_reason(err)}); {kept}"
        ) from None
    except BaseException:  # an interrupt or a bug mid-write: no orphan temporary file
        _discard(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def _own_storage(obj):
    """``obj`` (nested dicts, lists, tuples) with every tensor that does not own its whole
    storage replaced by a copy: ``torch.save`` writes a tensor's entire storage, so a slice of
    a large block (the hub's rows ``nodes[L:]``, even an empty one) would otherwise save the
    whole block. Tensors whose storage is smaller than their size (``expand``) are kept: they
    are already cheaper than a copy. The input is not modified."""
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:
            return obj
        needed = obj.numel() * obj.element_size()
        if obj.storage_offset() != 0 or obj.untyped_storage().nbytes() > needed:
            return obj.detach().clone()
        return obj
    if isinstance(obj, dict):
        return {k: _own_storage(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_own_storage(v) for v in obj]
    if isinstance(obj, tuple):
        items = [_own_storage(v) for v in obj]
        return type(obj)._make(items) if hasattr(obj, "_fields") else tuple(items)
    return obj


def _reason(err: OSError) -> str:
    text = err.strerror or str(err) or type(err).__name__
    return text.splitlines()[0] if text else type(err).__name__


def _discard(tmp: Path) -> None:
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass  # nothing more can be done; the error being raised says what went wrong


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable: fsync the folder (POSIX); a no-op where folders cannot be
    opened or fsynced (Windows, some network file systems)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- reading -------------------------------------------------------------------------------
def load(run_dir: str | Path, name: str = FILE) -> dict:
    """Read RUN_DIR/checkpoint.pt (or RUN_DIR/``name``), check its header, length and SHA-256
    digest, and return the state. Raises a one-line :class:`GossipError` for a missing,
    unreadable, foreign, altered or truncated file. The structure is not checked here: see
    :func:`check_structure`."""
    payload = _read_verified(Path(run_dir), name)
    try:
        # weights_only: tensors and plain containers only, so a crafted file (the digest is
        # no signature) cannot run code when it is loaded
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable payload gets the same message
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise GossipError(f"{Path(run_dir) / name}: unreadable checkpoint ({first})") from None


def verify(run_dir: str | Path, name: str = FILE) -> str | None:
    """None if RUN_DIR/``name`` is a whole checkpoint (header, length, digest), else why not
    (one line); nothing is unpickled."""
    try:
        _read_verified(Path(run_dir), name)
    except GossipError as err:
        return str(err)
    return None


def _read_verified(run_dir: Path, name: str) -> memoryview:
    path = run_dir / name
    if not path.is_file():
        raise GossipError(f"--resume {run_dir}: no {name} there (the run saved no checkpoint)")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise GossipError(f"{path}: unreadable checkpoint ({_reason(err)})") from None
    return _verified_payload(path, data)


def _verified_payload(path: Path, data: bytes) -> memoryview:
    corrupt = GossipError(
        f"{path}: checkpoint is corrupt (content digest mismatch: altered or truncated after "
        "it was written)"
    )
    if not data.startswith(MAGIC):
        if MAGIC.startswith(data):  # empty, or cut inside the first line
            raise corrupt
        if data.startswith(_MAGIC_PREFIX):
            found = data[len(_MAGIC_PREFIX) :].split(b"\n", 1)[0][:20].decode("ascii", "replace")
            raise GossipError(
                f"{path}: checkpoint format {found!r}; this gossip-pfl reads format "
                f"'v{FORMAT_VERSION}': resume with the gossip-pfl that wrote it, or start anew"
            )
        raise GossipError(
            f"{path}: not a gossip-pfl checkpoint of this version (no "
            f"'{MAGIC.decode().strip()}' header: written by an older gossip-pfl or another "
            "program): start the run anew"
        )
    end = data.find(b"\n", len(MAGIC), len(MAGIC) + _MAX_FIELDS_LINE)
    fields = _FIELDS.fullmatch(data, len(MAGIC), end) if end >= 0 else None
    if fields is None:
        raise corrupt
    payload = memoryview(data)[end + 1 :]
    if len(payload) != int(fields[2]) or hashlib.sha256(payload).hexdigest() != fields[1].decode():
        raise corrupt
    return payload


# ---- structure -----------------------------------------------------------------------------
def check_structure(
    state: object,
    n_peers: int,
    shape: Sequence[int],
    required: Iterable[str] = REQUIRED_KEYS,
    *,
    where: str = "checkpoint",
) -> None:
    """Check a loaded checkpoint against the run before any of the run's state is touched.

    ``state``: what :func:`load` returned; ``n_peers``: the run's number of peers n;
    ``shape``: one peer's shared block, ``(M, P)`` (components, parameters); ``required``: the
    keys that must be present (default :data:`REQUIRED_KEYS`); ``where``: the prefix of the
    messages (e.g. ``f"--resume {out}"``).

    Checks: ``state`` is a dict holding every required key; ``shared`` and ``momentum`` are
    tensors of shape ``(n_peers, *shape)``; ``eta`` has shape ``(n_peers,)``; ``personal`` and
    ``client_state`` are dicts of tensors with ``n_peers`` rows; ``rule_state`` is a dict of
    tensors or None; ``aux`` is a tensor or None; ``config``, ``times``, ``kind_bytes`` and
    ``traffic`` are dicts, ``rows`` a list and ``rounds_done`` a non-negative int. Only keys
    that are present are type-checked (so a caller may require fewer). Raises a one-line
    :class:`GossipError` naming the key; returns None when everything fits.
    """
    shape = tuple(int(s) for s in shape)
    if not isinstance(state, dict):
        raise GossipError(
            f"{where}: the checkpoint holds {_kind(state)}, not a dict of run state: "
            "start the run anew"
        )
    missing = [k for k in required if k not in state]
    if missing:
        raise GossipError(
            f"{where}: the checkpoint lacks {', '.join(missing)} (written by another "
            "gossip-pfl version, or altered): start the run anew"
        )

    def bad(key: str, found: str, expected: str) -> GossipError:
        return GossipError(f"{where}: checkpoint key '{key}' is {found}, expected {expected}")

    if "rounds_done" in state:
        r = state["rounds_done"]
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise bad("rounds_done", _kind(r), "a non-negative int")
    for key in ("config", "times", "kind_bytes", "traffic"):
        if key in state and not isinstance(state[key], dict):
            raise bad(key, _kind(state[key]), "a dict")
    if "rows" in state and not (isinstance(state["rows"], list)
                                and all(isinstance(r, dict) for r in state["rows"])):  # fmt: skip
        raise bad("rows", _kind(state["rows"]), "a list of metrics rows (dicts)")
    if (key := _first_nan(state)) is not None:  # (a resume went on from it, exit 0)
        raise GossipError(f"{where}: checkpoint key '{key}' holds NaN: it was altered, or "
                          "saved by a run gone bad; resume from a good copy")  # fmt: skip

    if "shared" in state:
        shared = state["shared"]
        if not isinstance(shared, torch.Tensor):
            raise bad("shared", _kind(shared), f"a tensor of shape {(n_peers, *shape)}")
        found, expected = tuple(shared.shape), (n_peers, *shape)
        if found != expected:
            if len(found) == len(expected) == 3:  # the usual case: say it in words
                raise GossipError(
                    f"{where}: checkpoint has {found[0]} peers x {found[1]} components x "
                    f"{found[2]} parameters, this run {' x '.join(map(str, expected))} "
                    "(key 'shared')"
                )
            raise bad("shared", _kind(shared), f"a tensor of shape {expected}")
    for key, expected in (("momentum", (n_peers, *shape)), ("eta", (n_peers,))):
        if key in state:
            value = state[key]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected:
                raise bad(key, _kind(value), f"a tensor of shape {tuple(expected)}")
    for key in ("personal", "client_state"):
        if key in state:
            _check_rows(state[key], key, n_peers, bad)
    if "rule_state" in state and state["rule_state"] is not None:
        rule = state["rule_state"]
        if not isinstance(rule, dict):
            raise bad("rule_state", _kind(rule), "a dict of tensors or None")
        for name, value in rule.items():
            if not isinstance(value, torch.Tensor):
                raise bad(f"rule_state.{name}", _kind(value), "a tensor")
    if "aux" in state and state["aux"] is not None and not isinstance(state["aux"], torch.Tensor):
        raise bad("aux", _kind(state["aux"]), "a tensor or None")


def check_like(value: object, like: object, key: str, where: str = "checkpoint") -> None:
    """A checkpoint's ``value`` at ``key`` has the structure of the run's own ``like``: a
    dict holding (at least) like's keys, each checked in turn; a tensor of like's shape and
    dtype (``like`` may be on the meta device); a list of numbers; a number (not a bool).
    Raises a one-line :class:`GossipError` naming the dotted key (what the restore read was a
    KeyError's or a shape's traceback)."""

    def bad(found: str, expected: str) -> GossipError:
        return GossipError(f"{where}: checkpoint key '{key}' is {found}, this run's is {expected}")

    if isinstance(like, dict):
        if not isinstance(value, dict) or not set(like) <= set(value):
            found = f"a dict of {sorted(value)}" if isinstance(value, dict) else _kind(value)
            raise bad(found, f"a dict of {sorted(like)}")
        for k, v in like.items():
            check_like(value[k], v, f"{key}.{k}", where)
    elif isinstance(like, torch.Tensor):
        if not isinstance(value, torch.Tensor) or value.shape != like.shape:
            raise bad(_kind(value), _kind(like))
        if value.dtype != like.dtype:
            raise bad(f"of {value.dtype}", f"of {like.dtype}")
    elif isinstance(like, list):
        if not (isinstance(value, list) and all(is_number(v) for v in value)):
            raise bad(_kind(value), "a list of numbers")
    elif is_number(like) and not is_number(value):
        raise bad(_kind(value), "a number")


def _first_nan(value: object, key: str = "") -> str | None:
    """The dotted key of the first tensor in ``value`` (nested dicts) holding a NaN."""
    if isinstance(value, torch.Tensor):
        return key if value.is_floating_point() and bool(torch.isnan(value).any()) else None
    if isinstance(value, dict):
        for k, v in value.items():
            if (found := _first_nan(v, f"{key}.{k}" if key else str(k))) is not None:
                return found
    return None


def _check_rows(value: object, key: str, n_peers: int, bad) -> None:
    if not isinstance(value, dict):
        raise bad(key, _kind(value), f"a dict of per-peer tensors ({n_peers} rows each)")
    for name, t in value.items():
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n_peers:
            raise bad(f"{key}.{name}", _kind(t), f"a tensor with {n_peers} rows (one per peer)")


def _kind(value: object) -> str:
    """A short description of a value for a message: 'a tensor of shape (8, 2, 6)', 'a list'."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if value is None:
        return "None"
    name = type(value).__name__
    return f"an {name}" if name[:1] in "aeiou" else f"a {name}"


#: the runtime keys that may differ between the ranks or processes of one run: how each runs
#: (its device, threads, call sizes, timeouts, address: float rounding at most) ...
RUNTIME_PER_PROCESS = (
    "device", "backend", "batching", "cpu_kernels", "cuda_graphs", "cuda_graph_steps",
    "timeout_s", "metrics_every", "step_chunk", "deterministic", "threads", "transport", "peers",
    "link_timeout_s",
)  # fmt: skip
#: ... and those that may not: the precision of the products and the simulated link faults
#: change what all of them compute (a rank's --set runtime.precision=bf16 trained a mix of two
#: runs, exit 0). Every runtime key is in one of the two (a test checks it).
RUNTIME_SHARED = ("precision", "tf32", "faults")
#: what may differ between the ranks or processes of one run: where each reads and writes
#: (node-local data and caches), and how it runs
PER_PROCESS = ("out", *(f"runtime.{k}" for k in RUNTIME_PER_PROCESS), "data.root",
               "data.cache_dir", "eval.chunk")  # fmt: skip
#: ... and between the processes of a peer-to-peer run, each saving its own checkpoints
PEER_PROCESS = (*PER_PROCESS, "checkpoint_every")
#: what a resume may change: where to write, how long to go on, how often to save, where the
#: data is read and cached (the data's digest is checked: RoundLoop.check_data; a torchrun
#: rank with its own data.cache_dir could not resume), and how to run (device, backend,
#: batching, call sizes: like the number of ranks, these change float rounding, not the
#: algorithm; a runtime key since removed too), but RUNTIME_SHARED (a resume in bf16 moved the
#: parameters by 6e-4, unsaid), which RoundLoop.check_config compares
RESUMABLE = ("out", "rounds", "checkpoint_every", "eval.chunk", "data.root", "data.cache_dir",
             "data.cache", "runtime")  # fmt: skip


def config_differences(
    saved: dict,
    current: dict,
    before: dict | None = None,
    prefix: str = "",
    skip: tuple[str, ...] = RESUMABLE,
) -> list[str]:
    """Dotted keys whose values differ between two resolved configs, but for those in
    ``skip`` (and under them); ``before`` gives the value of a key the saved config predates."""
    before = before or {}
    keys = sorted(set(saved) | set(current))
    diffs = []
    for key in keys:
        path = f"{prefix}{key}"
        if path in skip or path.split(".")[0] in skip:
            continue
        a, b = saved.get(key, before.get(path)), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += config_differences(a, b, before, f"{path}.", skip)
        elif a != b:
            diffs.append(path)
    return diffs


def saved_value(saved: dict, path: str, before: dict | None = None):
    """The checkpoint's value of a dotted key (for a key it predates, ``before``'s)."""
    node = saved
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return (before or {}).get(path)
        node = node[part]
    return node
