"""Every test runs on the device it was written for.

The suite was written for the CPU: with a GPU visible, ``runtime.device: auto`` would move its
runs to CUDA (other numerics, host-only assertions, far slower for tiny problems). So every test
without the ``cuda`` marker sees a CPU-only machine: ``torch.cuda.is_available()`` is False in
this process, and processes it starts (CLI runs, torchrun ranks, spawned workers) inherit
``CUDA_VISIBLE_DEVICES=""``. Tests marked ``cuda`` see the GPU, and are skipped without one.

Every process of the suite runs one torch thread unless ``OMP_NUM_THREADS`` says otherwise (it
is set here, before torch is imported, so the processes the tests start inherit it): the tests'
problems are too small to gain from a second thread, and OpenMP threads that spin at barriers
on a busy or shared machine make a run many times slower (docs/development.md). How a run picks
its thread count is tested on its own (tests/test_speed.py).

The caches (synthetic data, FMMC weights) live in a folder of the pytest run, not in ~/.cache.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Asked once, before any test hides the GPU: torch caches the device count, and a CUDA test
# after a hidden one must still find it.
HAS_CUDA = torch.cuda.is_available()


#: not a test module: the tests' fork server imports it to load the compiled loops. Collected
#: for its doctests (``--doctest-modules``), it made every pytest process compile them before
#: its first test on a fresh clone (about 14 s of CPU each): the cold suite took 110.2 and
#: 112.4 s with it, 103.7 and 104.9 s without (2-core AMD EPYC)
collect_ignore = ["_forkserver.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _own_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The synthetic data and FMMC weights the tests make go to a folder of this pytest run,
    shared by its workers, not to the user's ~/.cache: a stale or foreign cache cannot change
    a test, and the suite writes nothing into the home folder. Set in the environment, so the
    processes the tests start use it too."""
    root = tmp_path_factory.getbasetemp()
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    os.environ["GOSSIP_PFL_CACHE"] = str(shared / "gossip-pfl-cache")


@pytest.fixture(autouse=True)
def _pin_device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if "cuda" in request.keywords:
        return
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
