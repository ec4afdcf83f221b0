"""How the batched CNN's convolutions should run on a GPU: one training step (forward and the
gradients of every parameter) of the full FedEM CNN (conv 32/64, 2048 hidden units) for 100
peers x M = 3 components and a minibatch of 32 (the Fashion-MNIST study's shapes), timed in
several layouts side by side:

- ``groups``: peers (and components) as convolution groups, NCHW (the CPU's form);
- ``channels_last``: the same grouped convolutions on channels-last tensors;
- ``products``: each convolution as one batched matrix product over image patches (the GPU's
  form, ``gossip_pfl.models.conv_blocks``);

each in float32 and under bf16 autocast, then a profile of a step in each of the model's two
forms, by operator. Every variant's float32 gradients are compared with those of ``groups``
and with a float64 step (the largest difference over the largest value, of any parameter).

A second table times each variant's forward alone, without gradients, on ``--forward-batch``
images a peer (163: an E-step call of the study's 100 clients, 16,384 samples a call): the
E-step took 113 of a FedEM round's GPU milliseconds on an H200, and the products' patches
were chosen for training steps, not for these calls.

    python benchmarks/bench_conv.py [--device cuda] [--peers 100] [--batch 32] [--iters 20]
        [--forward-batch 163] [--no-profile]
    python benchmarks/bench_conv.py --device cpu --peers 4 --iters 3   # a smoke test
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from gossip_pfl import models
from gossip_pfl.models import FedEMCNN, batched_linear

#: a batched forward: params {name: (L, M, *shape)}, x (L, B, C, H, W) -> logits (L, M, B, C)
Forward = Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]


def conv_on(devices: tuple[str, ...]) -> Forward:
    """FedEMCNN.batched_forward with models.CONV_AS_PRODUCTS set to ``devices`` for the
    forward (the backward follows the graph it made)."""

    def forward(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        saved, models.CONV_AS_PRODUCTS = models.CONV_AS_PRODUCTS, devices
        try:
            return FedEMCNN.batched_forward(params, x)
        finally:
            models.CONV_AS_PRODUCTS = saved

    return forward


def channels_last(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The grouped convolutions on channels-last inputs and weights."""
    cl = torch.channels_last
    w1, w2 = params["conv1.weight"], params["conv2.weight"]
    L, M = w1.shape[:2]
    B = x.shape[1]
    h = x.transpose(0, 1).flatten(1, 2).contiguous(memory_format=cl)
    w1 = w1.flatten(0, 2).contiguous(memory_format=cl)
    h = torch.conv2d(h, w1, params["conv1.bias"].flatten(), groups=L)
    h = torch.relu_(torch.max_pool2d(h, 2))
    w2 = w2.flatten(0, 2).contiguous(memory_format=cl)
    h = torch.conv2d(h, w2, params["conv2.bias"].flatten(), groups=L * M)
    h = torch.relu_(torch.max_pool2d(h, 2)).contiguous()
    h = h.reshape(B, L, M, -1).permute(1, 2, 0, 3)
    h = torch.relu(batched_linear(h, params["fc1.weight"], params["fc1.bias"]))
    return batched_linear(h, params["fc2.weight"], params["fc2.bias"])


VARIANTS = {
    "groups": conv_on(()),
    "channels_last": channels_last,
    "products": conv_on(("cpu", "cuda")),
}


def step(
    forward: Forward, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, bf16: bool
) -> list[torch.Tensor]:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = forward(params, x)  # (L, M, B, C)
    L, M, B, C = logits.shape
    loss = F.cross_entropy(logits.float().reshape(-1, C), y[:, None].expand(L, M, B).reshape(-1))
    return list(torch.autograd.grad(loss, list(params.values())))


def largest_difference(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest over parameters of max |g - r| / max |r|."""
    return max(float((g.double() - r.double()).abs().max() / r.abs().max().clamp_min(1e-30))
               for g, r in zip(grads, reference))  # fmt: skip


def timed(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """The median seconds of ``iters`` calls of ``fn`` after three warm-up calls, the device
    synchronised around each."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--peers", type=int, default=100)
    ap.add_argument("--components", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--forward-batch",
        type=int,
        default=163,
        help="images a peer in the forward-only table (0: none)",
    )
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True  # as bench_cnn.py's runs (runtime.deterministic off)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = FedEMCNN((1, 28, 28), 10)
    L, M, B = args.peers, args.components, args.batch
    params = {
        name: (p.detach()[None, None] + 0.01 * torch.randn(L, M, *p.shape))
        .to(device)
        .requires_grad_()
        for name, p in model.named_parameters()
    }
    x = torch.rand(L, B, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (L, B), device=device)
    macs = (
        B * L * M * sum([32 * 24 * 24 * 25, 64 * 8 * 8 * 32 * 25, 1024 * 2048, 2048 * 10])
    )  # forward multiply-adds; a step is about three times that
    print(f"# {L} peers x M = {M}, batch {B}, {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f"; {6 * macs / 1e9:.0f} GFLOP a step")  # fmt: skip
    print("| variant | float32 ms | bf16 ms | gradients against groups | against float64 |")
    print("|---|---|---|---|---|")
    reference = step(VARIANTS["groups"], params, x, y, False)
    # the same step in float64 (grouped; far from every float32 form where a max-pool window
    # holds near-ties or a ReLU input is near 0, and the gradient flows elsewhere)
    p64 = {k: v.detach().double().requires_grad_() for k, v in params.items()}
    exact = step(VARIANTS["groups"], p64, x.double(), y, False)
    del p64
    for name, forward in VARIANTS.items():
        try:
            grads = step(forward, params, x, y, False)
            diffs = [largest_difference(grads, r) for r in (reference, exact)]
            del grads
            ms = [1e3 * timed(partial(step, forward, params, x, y, bf16), device, args.iters)
                  for bf16 in (False, True)]  # fmt: skip
            print(f"| {name} | {ms[0]:.2f} | {ms[1]:.2f} | {diffs[0]:.1e} | {diffs[1]:.1e} |",
                  flush=True)  # fmt: skip
        except torch.cuda.OutOfMemoryError:
            print(f"| {name} | out of memory | | | |", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if args.forward_batch:
        forward_only(params, L, args.forward_batch, device, args.iters)
    if args.no_profile:
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for name in ("groups", "products"):
        with profile(activities=acts) as prof:
            step(VARIANTS[name], params, x, y, False)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        print(f"# {name}, float32:")
        print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60))


@torch.no_grad()
def forward_only(params: dict, L: int, batch: int, device: torch.device, iters: int) -> None:
    """Each variant's forward without gradients (an E-step's call) on ``batch`` images a
    peer, float32, against the groups' logits."""
    x = torch.rand(L, batch, 1, 28, 28, device=device)
    print(f"\n# forward only, no gradients, {batch} images a peer (an E-step call)")
    print("| variant | float32 ms | logits against groups |")
    print("|---|---|---|")
    reference = VARIANTS["groups"](params, x)
    for name, forward in VARIANTS.items():
        try:
            out = forward(params, x)
            diff = float((out - reference).abs().max() / reference.abs().max())
            del out
            ms = 1e3 * timed(partial(forward, params, x), device, iters)
            print(f"| {name} | {ms:.2f} | {diff:.1e} |", flush=True)
        except torch.cuda.OutOfMemoryError:
            print(f"| {name} | out of memory | |", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
