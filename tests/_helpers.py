"""Test helpers: a tiny federated dataset and a way to run a function on k local Gloo ranks."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
from multiprocessing import forkserver
from pathlib import Path
from unittest import mock

import numpy as np

from gossip_pfl.data.base import ClientData, FederatedDataset


def toy_dataset(
    n: int = 8, dim: int = 5, seed: int = 0, task: str = "binary", sizes: list | None = None
) -> FederatedDataset:
    """``n`` clients of unequal size (20 + 13 i samples, or ``sizes``) labelled by two linear
    rules, so a mixture has something to find."""
    rng = np.random.default_rng(seed)
    rules = rng.normal(size=(2, dim))
    clients = []
    sizes = [20 + 13 * i for i in range(n)] if sizes is None else sizes
    for i, m in enumerate(sizes):
        z = i % 2

        def draw(k, z=z):
            x = rng.normal(size=(k, dim)).astype(np.float32)
            return x, (x @ rules[z] > 0).astype(np.int64)

        x, y = draw(m)
        xt, yt = draw(30)
        clients.append(ClientData(x, y, x[:0], y[:0], xt, yt))
    return FederatedDataset("toy", clients, (dim,), 2, task, {}, [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, out_dir, environ, env):
    # the parent's environment when it started this rank (a forked child has the fork server's)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **env,
    )
    import torch

    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        # the test hid the GPU (conftest.py): on the H200, ranks forked from a fork server
        # that a module-scoped fixture had started with the GPU visible still found CUDA
        # available, with 0 devices
        torch.cuda.is_available = lambda: False
    torch.set_num_threads(1)
    try:
        result = ("ok", fn(*args))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        result = ("error", f"{type(err).__name__}: {err}")
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


#: what the fork server imports once, before any rank forks from it: imports, and the compiled
#: CPU loops loaded (_forkserver); no torch computation (torch starts its thread pool at its
#: first parallel computation, which each rank does after the fork)
_PRELOAD = ["numpy", "torch", "torch.distributed", "gossip_pfl.train", "_helpers", "_forkserver"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    # The fork server is a new interpreter, and Python 3.11's ignores this process's sys.path
    # (CPython gh-117378, fixed in later 3.12 and 3.13 releases): it finds this folder's
    # modules on PYTHONPATH, set while it starts. A preload that does not import is skipped
    # without a word (tests/test_speed.py checks that a rank has them).
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.getenv("PYTHONPATH")]))
    # the server never sees a GPU, whichever test starts it (a module-scoped fixture runs
    # before conftest.py hides the GPU): its ranks are CPU ranks
    with mock.patch.dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES=""):
        forkserver.ensure_running()
    return ctx


def run_ranks(world: int, fn, *args, timeout: float = 120.0, env: dict | None = None) -> list:
    """Run ``fn(*args)`` on ``world`` new processes set up like torchrun's; returns each
    rank's ("ok", value) or ("error", message), or ("missing", exitcode) for a dead rank. The
    ranks are CPU ranks: their fork server never sees a GPU (a CUDA test of several ranks
    would need processes of its own, e.g. a spawn context).

    Each rank is a fresh process, as under torchrun (no state of this one: its function and
    arguments come pickled, its environment is this one's), forked from a fork server that has
    imported torch and the package once: a spawned interpreter would spend seconds importing
    them for every rank."""
    ctx = _context()
    port = free_port()
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(
                target=_worker, args=(r, world, port, fn, args, out_dir, environ, env or {})
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        for r, p in enumerate(procs):
            f = Path(out_dir, f"{r}.pkl")
            results.append(pickle.loads(f.read_bytes()) if f.exists() else ("missing", p.exitcode))
        return results


class Stopped(Exception):
    """Raised by :func:`stop_after_checkpoint`'s run: it ended as a killed job would."""


def check_ranks_refuse_other_checkpoints(resume, mine: Path, other: Path, says: str) -> None:
    """Two ranks run ``resume(folders)``, rank r from folder r (a node's copy of the run
    folder each): both stop with ``says``, and ``mine``'s metrics are left as they were."""
    before = (mine / "metrics.jsonl").read_text()
    for status, value in run_ranks(2, resume, [str(mine), str(other)], timeout=60):
        assert status == "error" and says in value, value
    assert (mine / "metrics.jsonl").read_text() == before


def stop_after_checkpoint(trainer, rounds_done: int) -> None:
    """Run ``trainer`` and stop it right after its checkpoint of round ``rounds_done``, like a
    job killed then: nothing after that checkpoint is written."""
    original = trainer.checkpoint

    def checkpoint_then_stop(out, done, rows):
        original(out, done, rows)
        if done == rounds_done:
            raise Stopped

    trainer.checkpoint = checkpoint_then_stop
    try:
        trainer.run()
    except Stopped:
        return
    raise AssertionError(f"the run ended without a checkpoint after round {rounds_done}")


def cnn_trainer(out, device: str, algorithm: dict | None = None, **runtime):
    """FedEM on a small CNN with momentum and weight decay over 5 clients of 16x16 images: the
    solver's in-place step, the gradients by parameter leaf, the convolutions (patch
    products on CUDA; on the CPU the first as products, the second grouped)."""
    from gossip_pfl.config import load_config
    from gossip_pfl.train import Trainer

    rng = np.random.default_rng(0)
    clients = []
    for i, m in enumerate([40, 25, 60, 33, 18]):
        x = rng.normal(size=(m + 10, 1, 16, 16)).astype(np.float32)
        y = (x[:, 0, :8].mean((1, 2)) > x[:, 0, 8:].mean((1, 2))).astype(np.int64) + i % 2
        clients.append(ClientData(x[:m], y[:m], x[:0], y[:0], x[m:], y[m:]))
    data = FederatedDataset("toy images", clients, (1, 16, 16), 3, "multiclass", {}, [])
    cfg = load_config(base={
        "seed": 3, "rounds": 2, "model": {"name": "cnn", "channels": [3, 4], "hidden": 8},
        "algorithm": {"name": "fedem", "components": 2, "lr": 0.1, "batch_size": 8,
                      "momentum": 0.9, "weight_decay": 1e-3, **(algorithm or {})},
        "runtime": {"device": device, **runtime}, "out": str(out),
    })  # fmt: skip
    return Trainer(cfg, dataset=data, log=lambda *a: None)


def run_threads(worker, n: int, comms: list, timeout: float) -> None:
    """``worker(k)`` for k < n, each on a thread, then ``comms`` closed (also on an error): the
    in-process form of n ranks over sockets."""
    import threading

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout)
    finally:
        for c in comms:
            c.close()
