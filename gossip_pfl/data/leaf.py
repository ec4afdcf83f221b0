"""Readers for LEAF-format JSON (FEMNIST, Shakespeare): one client per writer / speaking role.

Layout: ``ROOT/train/*.json`` and ``ROOT/test/*.json``, each file holding
``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}``;
a user's samples may be spread over several files. Nothing is downloaded; produce the files
with LEAF's own preprocessing scripts (``data/femnist`` or ``data/shakespeare``, e.g.
``./preprocess.sh -s niid --sf 1.0 -k 0 -t sample``) and copy ``data/train`` and ``data/test``.

FEMNIST: ``x`` is a list of 784 floats in [0, 1], returned as float32 (N, 1, 28, 28); 62 classes.
Shakespeare: ``x`` is a string of 80 characters and ``y`` the next character; both are mapped
to indices in :data:`SHAKESPEARE_VOCAB` (80 characters). Shakespeare inputs are returned as
int64 token ids of shape (N, seq_len), since they feed an embedding, not a linear layer.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np

from gossip_pfl.errors import GossipError

# The 80 characters LEAF's Shakespeare models use, in index order.
SHAKESPEARE_VOCAB = (
    "\n !\"&'(),-.0123456789:;>?"
    + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    + "[]"
    + "abcdefghijklmnopqrstuvwxyz"
    + "}"
)
_CHAR_INDEX = {c: i for i, c in enumerate(SHAKESPEARE_VOCAB)}
LEAF_KINDS = ("femnist", "shakespeare")


@dataclass
class LeafSplit:
    """All samples of one LEAF split, pooled, with the writer of each sample."""

    x: np.ndarray
    y: np.ndarray  # int64 (N,)
    writer: np.ndarray  # int64 (N,), index into LeafData.users


@dataclass
class LeafData:
    """Both LEAF splits of one dataset, writers numbered consistently across them."""

    name: str
    users: list[str]
    train: LeafSplit
    test: LeafSplit
    input_shape: tuple[int, ...]
    num_classes: int
    meta: dict = field(default_factory=dict)


def load_leaf(root: str | os.PathLike, kind: str) -> LeafData:
    """Read ``ROOT/train/*.json`` and ``ROOT/test/*.json`` of a LEAF dataset ``kind``."""
    if kind not in LEAF_KINDS:
        raise GossipError(f"leaf: unknown dataset {kind!r}; known: {', '.join(LEAF_KINDS)}")
    if root is None:
        raise GossipError(
            f"{kind}: no root given; pass root=FOLDER holding train/*.json, test/*.json"
        )
    root = Path(root)
    train_raw = _read_split(kind, root / "train")
    test_raw = _read_split(kind, root / "test")
    users = list(train_raw) + [u for u in test_raw if u not in train_raw]
    number = {u: i for i, u in enumerate(users)}
    convert = _femnist_arrays if kind == "femnist" else _shakespeare_arrays
    train = _pool(kind, root / "train", train_raw, number, convert)
    test = _pool(kind, root / "test", test_raw, number, convert)
    if train.x.shape[1:] != test.x.shape[1:]:  # (a traceback, or test inputs of another length)
        raise GossipError(f"{kind}: train samples have shape {train.x.shape[1:]} but test ones "
                          f"{test.x.shape[1:]} ({root / 'train'}, {root / 'test'})")  # fmt: skip
    if kind == "femnist":
        return LeafData(kind, users, train, test, (1, 28, 28), 62)
    seq_len = train.x.shape[1] if len(train.x) else test.x.shape[1]
    meta = {"vocab": SHAKESPEARE_VOCAB, "input_kind": "tokens"}
    return LeafData(kind, users, train, test, (seq_len,), len(SHAKESPEARE_VOCAB), meta)


def _read_split(kind: str, folder: Path) -> dict[str, dict]:
    """Merge ``user_data`` of every JSON file in ``folder``, in file-name order."""
    files = sorted(folder.glob("*.json"))
    if not files:
        raise GossipError(
            f"{kind}: no *.json files in {folder}; copy LEAF's data/{folder.name}/*.json there"
        )
    merged: dict[str, dict] = {}
    for path in files:
        for user, data in _read_file(kind, path).items():
            if user in merged:
                old = merged[user]
                merged[user] = {"x": old["x"] + data["x"], "y": old["y"] + data["y"],
                                "files": [*old["files"], str(path)]}  # fmt: skip
            else:
                merged[user] = {**data, "files": [str(path)]}
    return merged


def _read_file(kind: str, path: Path) -> dict[str, dict]:
    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f, object_pairs_hook=_unique_keys)
    except (OSError, ValueError, RecursionError) as e:
        raise GossipError(f"{kind}: cannot parse {path} ({e})") from None
    if not isinstance(content, dict) or not isinstance(content.get("user_data"), dict):
        raise GossipError(f"{kind}: {path} has no 'user_data' object; is it a LEAF JSON file?")
    user_data = content["user_data"]
    for user, data in user_data.items():
        if not isinstance(data, dict) or "x" not in data or "y" not in data:
            raise GossipError(f"{kind}: {path}: user {user!r} lacks the 'x' or 'y' key")
        if not (isinstance(data["x"], list) and isinstance(data["y"], list)):
            raise GossipError(f"{kind}: {path}: user {user!r}: 'x' and 'y' must be lists")
        if len(data["x"]) != len(data["y"]):
            raise GossipError(
                f"{kind}: {path}: user {user!r} has {len(data['x'])} x but {len(data['y'])} y"
            )
    return user_data


def _unique_keys(pairs: list[tuple]) -> dict:
    """A JSON object whose keys are distinct (json keeps the last of a user given twice, and
    the first's samples were dropped, unsaid)."""
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        twice = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"key {twice!r} given twice in one object")
    return dict(pairs)


def _pool(
    kind: str, folder: Path, raw: dict[str, dict], number: dict[str, int], convert
) -> LeafSplit:
    if not raw:
        raise GossipError(f"{kind}: the JSON files in {folder} hold no user (empty 'user_data')")
    xs, ys, ws, who = [], [], [], []
    for user, data in raw.items():
        if not data["x"]:  # (no sample in this split: nothing to add, and no shape to give)
            continue
        try:
            x, y = convert(kind, user, data)
        except GossipError as err:  # (named the user, not the files it is in)
            raise GossipError(f"{err} (in {', '.join(data['files'])})") from None
        xs.append(x)
        ys.append(y)
        ws.append(np.full(len(y), number[user], dtype=np.int64))
        who.append(user)
    if not xs:
        raise GossipError(f"{kind}: the JSON files in {folder} hold no sample (every 'x' is empty)")
    shapes = [x.shape[1:] for x in xs]
    counts = Counter(shapes)
    if len(counts) > 1:  # (each user's are checked alone; the odd one: not of the commonest)
        usual, n_usual = counts.most_common(1)[0]  # (a tie: the first user's shape)
        odd = next(i for i, s in enumerate(shapes) if s != usual)
        raise GossipError(
            f"{kind}: user {who[odd]!r} has samples of shape {shapes[odd]} but "
            f"{n_usual} other user(s) in {folder} have {usual} "
            f"(in {', '.join(raw[who[odd]]['files'])})"
        )
    return LeafSplit(np.concatenate(xs), np.concatenate(ys), np.concatenate(ws))


def _femnist_arrays(kind: str, user: str, data: dict) -> tuple[np.ndarray, np.ndarray]:
    try:
        x = np.asarray(data["x"], dtype=np.float32)
        labels = np.asarray(data["y"], dtype=np.float64)
    # TypeError: a sample that is a mapping; OverflowError: a number past float range
    except (ValueError, TypeError, OverflowError) as e:
        _no_text(kind, user, "pixel", data["x"])  # ("abc": a string, not a shapeless sample)
        _no_text(kind, user, "label", data["y"])
        raise GossipError(f"{kind}: user {user!r}: samples are not 784-pixel images ({e})") from e
    _no_text(kind, user, "pixel", data["x"], x.ndim)  # (read as numbers: "0.5" and true too)
    _no_text(kind, user, "label", data["y"], labels.ndim)
    labels = labels.reshape(-1)
    if len(x) != len(labels):  # (a label that is a list: ten labels for five images)
        raise GossipError(f"{kind}: user {user!r}: {len(x)} samples but {len(labels)} labels")
    if x.size != 784 * len(labels):  # (1,568 pixels a sample were cut into two images, the
        per = x.size / max(len(x), 1)  # labels no longer theirs)
        raise GossipError(f"{kind}: user {user!r}: samples of {per:g} pixels, expected 784 "
                          "(28 x 28)")  # fmt: skip
    x = x.reshape(-1, 1, 28, 28)
    if not np.isfinite(x).all():  # (null pixels: NaN, then "lower algorithm.lr")
        raise GossipError(f"{kind}: user {user!r}: pixels that are not numbers (null, NaN)")
    if len(x) and (x.min() < 0 or x.max() > 1):  # (0..255 trained on another scale, unsaid)
        raise GossipError(f"{kind}: user {user!r}: pixels span {x.min():g}..{x.max():g}; "
                          "LEAF's FEMNIST pixels are in [0, 1]")  # fmt: skip
    if (labels != np.round(labels)).any():  # (1.7 was class 1)
        raise GossipError(f"{kind}: user {user!r}: labels that are not whole numbers")
    if len(labels) and (labels.min() < 0 or labels.max() >= 62):  # (before the cast: 1e30
        raise GossipError(  # was numpy's warning, then a label of -2^63)
            f"{kind}: user {user!r}: labels span {labels.min():g}..{labels.max():g}, expected 0..61"
        )
    return x, labels.astype(np.int64)


def _no_text(kind: str, user: str, what: str, values: list, depth: int | None = None) -> None:
    """Refuse strings and booleans among ``values``, a JSON list nested ``depth`` deep
    (None: unknown, found element by element).

    numpy's float conversion reads "0.5" as 0.5 and true as 1, and a type numpy infers does
    not tell either: a ``true`` among numbers becomes 1.0. So the types of the elements are
    gathered in C, with no Python step per pixel (``set(map(type, ...))``: about 2 ms for 200
    images of 784 pixels, where parsing their JSON takes some 7 ms)."""
    if depth is None:
        leaves = _flat(values)
    else:
        leaves = values
        for _ in range(depth - 1):
            leaves = chain.from_iterable(leaves)
    types = set(map(type, leaves))
    for found, name in ((str, "string"), (bool, "boolean")):
        if found in types:
            example = next(v for v in _flat(values) if type(v) is found)
            raise GossipError(f"{kind}: user {user!r}: {what} {json.dumps(example)} is a JSON "
                              f"{name}, not a number")  # fmt: skip


def _flat(values):
    """The non-list elements of a nested list, in order."""
    for v in values:
        if isinstance(v, list):
            yield from _flat(v)
        else:
            yield v


def _shakespeare_arrays(kind: str, user: str, data: dict) -> tuple[np.ndarray, np.ndarray]:
    if not all(isinstance(s, str) for s in data["x"]):
        raise GossipError(f"{kind}: user {user!r}: inputs 'x' must be strings")
    if not all(isinstance(c, str) and len(c) == 1 for c in data["y"]):  # ("" failed, "ab" was a)
        raise GossipError(f"{kind}: user {user!r}: targets 'y' must be single characters")
    lengths = {len(s) for s in data["x"]}
    if len(lengths) > 1:
        raise GossipError(f"{kind}: user {user!r}: input strings have lengths {sorted(lengths)}")
    if lengths == {0}:  # (the LSTM's "sequence length to be larger than 0" traceback)
        raise GossipError(f"{kind}: user {user!r}: input strings are empty")
    x = np.array([encode(s, user) for s in data["x"]], dtype=np.int64).reshape(len(data["x"]), -1)
    y = np.array([encode(c, user)[0] for c in data["y"]], dtype=np.int64)
    return x, y


def encode(text: str, user: str = "?") -> list[int]:
    """Indices of ``text``'s characters in :data:`SHAKESPEARE_VOCAB`.

    >>> encode("Hi!")
    [32, 61, 2]
    """
    try:
        return [_CHAR_INDEX[c] for c in text]
    except KeyError as e:
        raise GossipError(
            f"shakespeare: user {user!r}: character {e.args[0]!r} is not in the "
            "80-character vocabulary"
        ) from None
