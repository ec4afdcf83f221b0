"""Point-to-point transport between ranks. ``LocalComm`` is the single-process case (no
torch.distributed at all); ``TorchComm`` wraps an initialized process group (Gloo or NCCL);
``ZmqComm`` (gossip_pfl/runtime/zmq_comm.py) talks peer to peer over pyzmq. All implement the
``Comm`` protocol; ``build_comm`` makes one by its transport name ("torch", "zmq")."""

from __future__ import annotations

import datetime
import inspect
import itertools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist

from gossip_pfl.errors import GossipError
from gossip_pfl.runtime.threads import physical_memory


@runtime_checkable
class Waitable(Protocol):
    """An exchange in flight."""

    def wait_all(self) -> None:
        """Return once every receive has landed and every send has left; raise GossipError
        (naming the ranks) when a peer does not answer within the transport's timeout."""


@runtime_checkable
class Comm(Protocol):
    """The transport between ranks that the Exchanger and the Trainer use."""

    device: torch.device  # where the rank's tensors live
    rank: int
    world_size: int
    #: whether ``all_reduce_sum`` spans the world; False in a peer-to-peer world (ZmqComm with
    #: p2p=True), where the Trainer computes metrics, checks and checkpoints per process
    collectives: bool

    def exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> Waitable:
        """Start sending ``sends[r]`` to rank r and receiving into the preallocated ``recvs[r]``
        from rank r; the caller computes, then calls ``wait_all()`` on the result."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks in place (the same result on every rank); return it."""

    def set_tag(self, round: int, phase: int = 0) -> None:  # noqa: A002
        """Name the (round, phase) the following operations belong to (used by transports that
        match messages by tag; a no-op for the others)."""

    def close(self) -> None:
        """Release sockets / the process group."""


@dataclass
class LocalComm:
    """One rank holding every peer: nothing to send."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    backend: str = "none"
    collectives: bool = True

    def exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]):
        if sends or recvs:
            raise RuntimeError("LocalComm cannot exchange with other ranks")
        return Pending([], [], self.rank)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def set_tag(self, round: int, phase: int = 0) -> None:  # noqa: A002
        pass

    def close(self) -> None:
        pass


@dataclass
class TorchComm:
    """Ranks of an initialized torch.distributed process group."""

    device: torch.device
    rank: int
    world_size: int
    backend: str
    collectives: bool = True

    def exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]):
        """Start sending each ``sends[r]`` to rank r and receiving each ``recvs[r]`` from rank r,
        all in one ``batch_isend_irecv`` (one fused buffer per neighbouring rank). Returns a
        ``Pending`` so the caller can compute while the bytes move."""
        ops = [dist.P2POp(dist.isend, buf, peer) for peer, buf in sends.items()]
        ops += [dist.P2POp(dist.irecv, buf, peer) for peer, buf in recvs.items()]
        peers = sorted(set(sends) | set(recvs))
        if not ops:
            return Pending([], peers, self.rank)  # no edge to another rank this round
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as err:
            raise _lost(self.rank, peers, err) from None
        return Pending(works, peers, self.rank)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            dist.all_reduce(tensor)
        except RuntimeError as err:
            raise GossipError(
                f"rank {self.rank}: all_reduce failed ({_first_line(err)}); "
                "a peer process probably died"
            ) from None
        return tensor

    def set_tag(self, round: int, phase: int = 0) -> None:  # noqa: A002
        pass  # torch.distributed matches messages by order: nothing to tag

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class Pending:
    """Exchange in flight: the caller computes while the bytes move, then waits for them.

    ``works`` are what ``batch_isend_irecv`` returned: one per operation under Gloo, one for
    the whole batch under NCCL, so only waiting for all of them says that every buffer landed.
    """

    works: list
    peers: list[int]  # the ranks this exchange talks to, named when it fails
    rank: int

    def wait_all(self) -> None:
        """Wait until every receive has landed and every send has left."""
        try:
            for work in self.works:
                work.wait()
        except RuntimeError as err:  # a dead or hung peer: Gloo/NCCL raise after the timeout
            raise _lost(self.rank, self.peers, err) from None


def _lost(rank: int, peers: list[int], err: BaseException) -> GossipError:
    which = f" with rank(s) {peers}" if peers else ""
    return GossipError(
        f"rank {rank}: exchange{which} failed ({_first_line(err)}); a peer process probably died"
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor on ``device``. To a GPU through page-locked memory, queued: a copy
    from pageable memory first waits for everything queued on the device (plans made every
    round would each stop the host); PyTorch's pinned-memory cache keeps the staging block
    until the copy has run."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def row_index(idx: np.ndarray, device) -> torch.Tensor | slice:
    """Rows ``idx`` (host, non-negative) as a slice where they are a contiguous run (a view, no
    copy; and on a GPU no indexing kernel: the first evaluation's three gathers took 114 to 135
    ms of first use on an H200), else as an index (:func:`upload`ed)."""
    if len(idx) and idx[0] >= 0 and np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx))):
        return slice(int(idx[0]), int(idx[0]) + len(idx))
    return upload(torch.as_tensor(idx), device)


def gather_rows(comm: Comm, rows: torch.Tensor, positions, total: int) -> torch.Tensor:
    """Each rank's ``rows`` (A, ...) put at ``positions`` of a (total, ...) table and summed
    over ranks: every rank gets the whole table, exactly (disjoint rows plus zeros). Without
    collectives (peer to peer) the table holds this process's rows only."""
    full = rows.new_zeros((total, *rows.shape[1:]))
    full[row_index(np.asarray(positions, dtype=np.int64), rows.device)] = rows
    return comm.all_reduce_sum(full) if comm.collectives else full


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when a GPU is visible, else CPU; asking for CUDA without one is an
    error. Under torchrun each rank uses GPU ``LOCAL_RANK``."""
    if device not in ("auto", "cpu", "cuda"):
        raise GossipError(f"runtime.device must be auto, cpu or cuda (got {device!r})")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise GossipError("runtime.device is 'cuda' but no CUDA GPU is visible to this process")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if local_rank >= torch.cuda.device_count():
        raise GossipError(
            f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) on this node"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory on ``device``: the GPU's total, or this machine's physical memory
    (None where the OS does not say)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return physical_memory()


def set_cuda_numerics(tf32: bool, deterministic: bool) -> None:
    """Float behaviour of CUDA kernels for this process (no effect on CPU work).

    PyTorch lets cuDNN convolutions use TF32 by default and, with ``cudnn.benchmark``, pick
    algorithms by timing; either makes numbers depend on the GPU model, the batch shape (so on
    the placement) or the run. Off by default here: same seed, same config, same numbers.
    """
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic
    if deterministic:
        # cuBLAS reduces deterministically only with a fixed workspace; read when its handle is
        # created, i.e. at the first product, which comes after this call
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: an op with no deterministic CUDA kernel warns (once) instead of stopping a run
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    # ... and without filling every new tensor with NaN first (PyTorch's default with them on:
    # a kernel more for each empty tensor, a full pass over a CNN step's gradient buffer). It
    # guards against reading memory never written, which no path here does: runs on a CPU
    # (where this is not set, so nothing is filled) give the same bits on every placement,
    # and CUDA runs the CPU's numbers to float tolerance (tests/test_runtime.py, test_cuda.py).
    torch.utils.deterministic.fill_uninitialized_memory = False


def world_from_env(env: dict | None = None) -> tuple[int, int]:
    """(rank, world_size) as torchrun sets them; (0, 1) for a plain process. A launch
    environment that cannot be a process group is a one-line error, at once (a RANK of 2 in a
    world of 2, or of 1 alone, waited twice the timeout for a traceback; RANK without
    WORLD_SIZE ran as one process and printed nothing)."""
    env = os.environ if env is None else env
    rank_s, world_s = env.get("RANK"), env.get("WORLD_SIZE")
    if rank_s is None and world_s is None:
        return 0, 1

    def count(name: str, text: str | None) -> int:
        if text is None:
            other = "RANK" if name == "WORLD_SIZE" else "WORLD_SIZE"
            raise GossipError(f"{other} is set but {name} is not: start the ranks with torchrun "
                              f"(or unset {other} for one process)")  # fmt: skip
        try:
            return int(text)
        except ValueError:
            raise GossipError(f"{name}={text!r} is not a whole number") from None

    world, rank = count("WORLD_SIZE", world_s), count("RANK", rank_s)
    if world < 1 or not 0 <= rank < world:
        raise GossipError(f"RANK={rank} does not fit WORLD_SIZE={world} (ranks are 0.."
                          f"{world - 1}, and a world has at least one)")  # fmt: skip
    if world > 1:
        port = env.get("MASTER_PORT", "")
        digits = port.strip()
        if not (env.get("MASTER_ADDR") and digits.isascii() and digits.isdigit()
                and 0 < int(digits) < 2**16):  # fmt: skip
            raise GossipError(f"WORLD_SIZE={world} needs MASTER_ADDR and a MASTER_PORT in "
                              f"1..65535 (got {env.get('MASTER_ADDR')!r} and {port!r}): torchrun "
                              "sets them")  # fmt: skip
    return rank, world


_GROUPS = itertools.count()  # process groups made by this process, the same count on every rank


def init_comm(device: str = "auto", backend: str = "auto", timeout_s: float = 300.0):
    """Build the transport for this process from torchrun's environment.

    ``backend``: ``auto`` (NCCL for CUDA tensors, Gloo for CPU), ``gloo`` or ``nccl``.
    ``timeout_s`` bounds every collective and p2p wait, so a dead rank makes the others fail
    with a clear error instead of hanging forever.
    """
    rank, world = world_from_env()
    if backend not in ("auto", "gloo", "nccl"):
        raise GossipError(f"runtime.backend must be auto, gloo or nccl (got {backend!r})")
    if backend == "nccl" and device == "cpu":
        raise GossipError(
            "runtime.backend 'nccl' needs runtime.device cuda (NCCL moves GPU tensors)"
        )
    if backend == "nccl" and not torch.cuda.is_available():
        raise GossipError("runtime.backend is 'nccl' but no CUDA GPU is visible; use gloo")
    dev = resolve_device("cuda" if backend == "nccl" and device == "auto" else device)
    if world == 1:
        return LocalComm(dev)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "gloo" and dev.type == "cuda":
        warnings.warn(
            "runtime.backend 'gloo' moves CPU tensors: this run trains on the CPU; "
            "use backend nccl (or auto) to train on the GPU",
            stacklevel=2,
        )
        dev = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {}
    if backend == "nccl":
        # NCCL's wait() only orders CUDA streams; with blocking wait it raises on the host
        # after the timeout (caught and reported as a GossipError), where otherwise the
        # watchdog kills the process, or nothing ever returns if async error handling is off.
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = dev  # binds the communicator to this GPU (torch >= 2.3)
    # Each group's keys under their own prefix: a second run in the same job (a sweep under one
    # torchrun) would otherwise meet the first group's addresses in torchrun's store and try
    # to connect to ports closed with it (Gloo: "connection refused", now and then).
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        # the other ranks' store clients try twice (a missing rank 0 took 2x the timeout);
        # rank 0's store waits for them once
        wait = timeout if rank == 0 else datetime.timedelta(seconds=timeout_s / 2)
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=wait))
        store = dist.PrefixStore(f"gossip_pfl/group{next(_GROUPS)}", store)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs
        )
    except (RuntimeError, ValueError) as err:  # (torch's DistError is a RuntimeError)
        raise GossipError(
            f"rank {rank}: could not join the {world} ranks' group at {where} "
            f"within runtime.timeout_s = {timeout_s:g} s ({_first_line(err)}); "
            "are all ranks started, and the address and port free?"
        ) from None
    comm = TorchComm(dev, rank, world, backend)
    # NCCL: if the first operation of a group is a batched p2p call, all ranks must join it;
    # a small all_reduce first sets up the communicator on every rank.
    comm.all_reduce_sum(torch.zeros(1, device=dev))
    return comm


def _zmq_comm(
    device: str = "auto",
    timeout_s: float = 300.0,
    *,
    peers,
    rank: int,
    bind_host: str | None = None,
    **p2p_options,
):
    from gossip_pfl.runtime.zmq_comm import ZmqComm  # pyzmq is only needed here

    p2p_options.pop("backend", None)
    return ZmqComm(rank, peers, resolve_device(device), timeout_s, bind_host, **p2p_options)


def _torch_comm(device: str = "auto", timeout_s: float = 300.0, *, backend: str = "auto", **_):
    return init_comm(device, backend, timeout_s)


# transport name (runtime.transport) -> builder(device, timeout_s, **options) -> Comm
TRANSPORTS: dict[str, Callable[..., Comm]] = {"torch": _torch_comm, "zmq": _zmq_comm}


def register_transport(name: str, builder: Callable[..., Comm]) -> None:
    """Make ``build_comm(name, ...)`` call ``builder(device, timeout_s, **options)``."""
    TRANSPORTS[name] = builder


def build_comm(
    transport: str = "torch", device: str = "auto", timeout_s: float = 300.0, **options
) -> Comm:
    """The transport named ``transport``. ``torch`` takes ``backend`` and reads torchrun's
    environment (see ``init_comm``); ``zmq`` takes ``peers`` (a YAML file or a dict of rank ->
    host:port), ``rank`` and optionally ``bind_host``, and for a peer-to-peer world ``p2p``,
    ``link_timeout_s`` and ``faults`` (see ``ZmqComm``)."""
    if transport not in TRANSPORTS:
        raise GossipError(
            f"runtime.transport must be one of {sorted(TRANSPORTS)} (got {transport!r})"
        )
    return TRANSPORTS[transport](device, timeout_s, **options)


def comm_from_config(rt, device: str | None = None) -> Comm:
    """The transport a run config (``RuntimeConfig``) asks for, in a process started by
    ``gossip-pfl run`` (or torchrun), on ``device`` (default ``rt.device``; a workload may
    choose its own). Peer-to-peer processes are started by ``gossip-pfl peer``, which builds
    its ZmqComm from the peers file and its ``--id``."""
    if rt.transport != "torch":
        raise GossipError(
            f"runtime.transport is {rt.transport!r}: start each process with "
            "'gossip-pfl peer CONFIG --peers PEERS.yaml --id K' (or 'gossip-pfl peers-local "
            "CONFIG -n N' on one machine), not 'gossip-pfl run'"
        )
    return init_comm(device or rt.device, rt.backend, rt.timeout_s)
