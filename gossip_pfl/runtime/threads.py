"""Torch threads that fit the machine: the cores this process may use, shared by the ranks on
its node.

torch's own default is every physical core of the machine. Two runs side by side (seeds in
parallel, or k torchrun ranks on one node) then run twice as many threads as there are cores,
and OpenMP threads that spin at barriers make each run several times slower than the shared
cores explain. Precedence: ``runtime.threads`` > ``OMP_NUM_THREADS`` (an explicit choice;
torchrun sets it to 1 when it starts several ranks on a node and it is unset) > the cores in
this process's affinity mask divided by ``LOCAL_WORLD_SIZE`` (torchrun's ranks on this node).

Independent pieces of a step run at once on a CPU, one thread each (:func:`map_pieces`). And
freed memory kept for the next round (:func:`keep_freed_memory`).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gossip_pfl.errors import GossipError

T, R = TypeVar("T"), TypeVar("R")


def available_cores() -> int:
    """Cores this process may run on (its affinity mask: taskset, cgroups cpusets, SLURM)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity mask
        return os.cpu_count() or 1


def physical_memory() -> int | None:
    """Bytes of this machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None


def beyond_memory(size: float, what: str = "") -> str | None:
    """``"S GiB of WHAT, more than this machine's M GiB"`` where ``size`` bytes exceed its
    physical memory, else None (also where the OS does not say): the end of a message that
    refuses a size before numpy tries to allocate it."""
    memory = physical_memory()
    if memory is None or size <= memory:
        return None
    of = f" of {what}" if what else ""
    return f"{size / 2**30:,.1f} GiB{of}, more than this machine's {memory / 2**30:,.1f} GiB"


#: the most threads a run may ask per core it may use (more only oversubscribes the cores)
MAX_THREADS_PER_CORE = 4


def default_threads(env: dict[str, str] | None = None) -> tuple[int, str]:
    """(threads, where the number comes from) when the config leaves ``runtime.threads`` at 0."""
    env = os.environ if env is None else env
    omp = env.get("OMP_NUM_THREADS", "").strip()
    local = env.get("LOCAL_WORLD_SIZE", "").strip()
    if omp.isdigit() and int(omp) > 0:
        if omp == "1" and local.isascii() and local.isdigit() and int(local) > 1:
            return 1, (  # most likely torchrun's own 1: say how to choose another count
                f"OMP_NUM_THREADS; torchrun sets it to 1 for its {int(local)} ranks on a node "
                "unless it is set: runtime.threads=N to choose"
            )
        return int(omp), "OMP_NUM_THREADS"
    if local and not (local.isascii() and local.isdigit() and int(local) > 0):
        raise GossipError(  # torchrun sets the ranks on this node: anything else is broken
            f"LOCAL_WORLD_SIZE={local!r} is not a positive whole number (torchrun sets it to "
            "the ranks on this node; unset it for one process)"
        )
    ranks = int(local) if local else 1
    cores = available_cores()
    return max(1, cores // ranks), f"{cores} cores / {ranks} rank(s) on the node"


def set_threads(threads: int = 0) -> str:
    """Set torch's intra-op threads (``threads`` > 0, else the default above); returns how the
    count was chosen, for the run's first log line."""
    how = "runtime.threads"
    if threads <= 0:
        threads, how = default_threads()
    cores = available_cores()
    if threads > MAX_THREADS_PER_CORE * cores:  # 100,000 threads crashed the process
        raise GossipError(  # (``how``: runtime.threads or OMP_NUM_THREADS)
            f"{how} {threads} is more than {MAX_THREADS_PER_CORE} x the {cores} core(s) this "
            f"process may use ({MAX_THREADS_PER_CORE * cores}); runtime.threads 0 picks a count"
        )
    import torch  # here: this module answers the host's questions without loading torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return f"{threads} thread(s) ({how})"


# ---- independent pieces of a step, one core each --------------------------------------------
_NAME = "gossip-piece"  # the workers' thread names
_pool: ThreadPoolExecutor | None = None
_pool_size = _pool_pid = 0


def _one_thread() -> None:
    """A piece worker's own intra-op threads: one (OpenMP's thread count is per thread, so the
    calling thread keeps its own for the round's large operations)."""
    import torch

    # torch sets a thread's count from the process's last setting at its first parallel call:
    # that call first, or a later one would undo the 1
    torch.get_num_threads()
    torch.set_num_threads(1)


def _start_pool(threads: int) -> ThreadPoolExecutor:
    """A pool of ``threads`` workers of one torch thread each, all started now. A worker's
    ``set_num_threads(1)`` is also the count torch gives threads started after it: the
    caller's count is set again once they all run, for the threads that come later."""
    import torch

    keep = torch.get_num_threads()
    pool = ThreadPoolExecutor(threads, _NAME, initializer=_one_thread)
    meet = threading.Barrier(threads)  # each task holds its worker: a new worker per task
    for f in [pool.submit(meet.wait, 60) for _ in range(threads)]:
        f.result()
    torch.set_num_threads(keep)
    return pool


def even_pieces(n: int, count: int) -> list[slice]:
    """``range(n)`` in ``count`` contiguous slices whose sizes differ by at most one."""
    ends = [n * k // count for k in range(count + 1)]
    return [slice(a, b) for a, b in zip(ends, ends[1:])]


def map_pieces(fn: Callable[[T], R], items: Sequence[T], threads: int) -> list[R]:
    """``[fn(item) for item in items]``, ``threads`` items at a time, each on a worker thread
    of one torch thread (``threads`` <= 1 or one item: in turn, on this thread).

    On a CPU a batched CNN's step is many small operations (a few peers' convolutions, in
    cache-sized pieces). With each operation split over two torch threads, a step of the
    Fashion-MNIST FedAvg CNN took 1.47x one thread's time and FedEM's 0.67x; with two pieces
    at once, 0.58x and 0.53x (docs/speed-notes.md). Pieces run at once each give one thread's
    numbers. The workers run ``fn`` under this thread's grad mode (a thread-local
    setting); ``fn`` must write only its own outputs and fill no shared cache. The first
    error is raised, after the pieces still queued are dropped."""
    global _pool, _pool_size, _pool_pid
    # a piece that maps pieces itself runs them in turn: waiting on its own pool could hang
    nested = threading.current_thread().name.startswith(_NAME)
    if threads <= 1 or len(items) <= 1 or nested:
        return [fn(item) for item in items]
    import torch

    if _pool_size != threads or _pool_pid != os.getpid():  # a forked child has no threads
        if _pool is not None and _pool_pid == os.getpid():
            _pool.shutdown(wait=False)  # its idle workers end
        _pool = _start_pool(threads)
        _pool_size, _pool_pid = threads, os.getpid()

    grad = torch.is_grad_enabled()

    def run(item: T) -> R:
        with torch.set_grad_enabled(grad):
            return fn(item)

    futures = [_pool.submit(run, item) for item in items]
    try:
        return [f.result() for f in futures]
    finally:
        for f in futures:
            f.cancel()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for the next allocation. By default it maps
    every block over 32 MB fresh from the kernel and unmaps it on free, so a round's large
    temporaries (a batch, the E-step's (peers, M, samples) tensors) are new pages every round,
    each first touch a page fault: at 10,000 synthetic peers that was a third of a round's
    CPU time. The price: the process keeps its peak memory until it exits. True when set
    (Linux with glibc; elsewhere nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # musl and other C libraries: no mallopt to call
        return False
    big = ctypes.c_int(2**31 - 1)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, big) and libc.mallopt(_M_TRIM_THRESHOLD, big))


def configure_host(threads: int = 0) -> str:
    """The process's torch threads (:func:`set_threads`) and malloc (:func:`keep_freed_memory`),
    before any torch work; returns what was set, for the run's first log line."""
    kept = keep_freed_memory()
    # the gossip-pfl command sets it before torch loads; OpenMP reads it only then
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().upper()
    waits = f", idle threads {'sleep' if policy == 'PASSIVE' else 'spin'}" if policy else ""
    return set_threads(threads) + waits + (", freed memory kept" if kept else "")
