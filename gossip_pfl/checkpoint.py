"""Checkpoints: the whole run's state in one file, written atomically by rank 0.

Per-peer tensors are stored in peer order (not per rank), so a run can resume on a different
number of ranks. Randomness is counter-based (every draw derives from the seed, the peer and
the round), so the round counter is the RNG state: nothing else needs saving for the resumed
run to draw exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gossip_pfl.errors import GossipError

FILE = "checkpoint.pt"


def save(state: dict, run_dir: str | Path) -> Path:
    """Write ``state`` to RUN_DIR/checkpoint.pt via a temporary file and an atomic rename, so
    an interrupted write never leaves a truncated checkpoint behind."""
    path = Path(run_dir) / FILE
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load(run_dir: str | Path) -> dict:
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise GossipError(f"--resume {run_dir}: no {FILE} there (the run saved no checkpoint)")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same message
        raise GossipError(f"{path}: unreadable checkpoint ({str(err).splitlines()[0]})") from None


def config_differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved configs (ignoring 'out')."""
    keys = sorted(set(saved) | set(current))
    diffs = []
    for key in keys:
        path = f"{prefix}{key}"
        if path in ("out", "rounds", "checkpoint_every") or path.startswith("runtime."):
            # where to write, how long to go on, how often to save, and how to run (device,
            # backend, batching, call sizes: like the number of ranks, these change float
            # rounding, not the algorithm) may change
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += config_differences(a, b, f"{path}.")
        elif a != b:
            diffs.append(path)
    return diffs
