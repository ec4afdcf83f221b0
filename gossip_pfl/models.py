"""Plain ``nn.Module`` models. Peers and components are batched from outside (runtime.local),
so nothing here knows about peers, ranks or devices."""

from __future__ import annotations

import inspect
import math

import numpy as np
import torch
from torch import nn

from gossip_pfl.errors import GossipError


def batched_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``nn.Linear`` for many peers and components at once.

    x (L, B, i) shared by the components, or (L, M, B, i); weight (L, M, o, i); bias (L, M, o)
    -> (L, M, B, o). A shared input folds the components into one matrix product per peer,
    several times faster than vmap's batched matrix-vector products.
    """
    if x.dim() == 4:  # (one batched product: einsum's bits but for a 1-wide input, 12 fewer
        # dispatched operations forward and backward, host time on a GPU)
        return torch.matmul(x, weight.transpose(-1, -2)) + bias[:, :, None, :]
    # weight (M*o, i) times x^T (i, B), not x times weight^T: autograd then forms the weight's
    # gradient as g (M*o, B) @ x (B, i), reading x row by row. The other way round it multiplies
    # a transposed x, and a linear model's step (M*o of 1 to 3: batched matrix-vector products)
    # takes about 1.8x as long (300 peers x 128 samples x 150 inputs).
    L, M, o, i = weight.shape
    out = torch.matmul(weight.reshape(L, M * o, i), x.transpose(1, 2))  # (L, M*o, B)
    return out.view(L, M, o, -1).transpose(-1, -2) + bias[:, :, None, :]


def max_pool_2x2(x: torch.Tensor) -> torch.Tensor:
    """2x2 max pooling, stride 2, of an NCHW batch. On a CPU the pooling runs on a
    channels-last copy: PyTorch's CPU kernel for NCHW took 13.7 ms for a (32, 120, 24, 24)
    batch, the channels-last one 0.7 ms plus 1 ms of copies. The backward is NCHW's, from the
    same indices, so the gradient reaching the convolution keeps its layout; values, indices
    and gradients are the same bits as ``torch.max_pool2d`` (tests/test_speed.py). Without
    gradients, :func:`_max_of_windows`. Not for torch.func transforms (the batched forwards
    call it; ``forward`` keeps max_pool2d)."""
    if x.device.type != "cpu" or x.dim() != 4:
        return torch.max_pool2d(x, 2)
    if torch.is_grad_enabled() and x.requires_grad:
        return _MaxPool2x2.apply(x)
    return _max_of_windows(x)


def _cpu_pool(x: torch.Tensor) -> torch.Tensor:
    """2x2 max pooling of a CPU's channels-last batch: ``torch.max_pool2d`` where autograd
    needs its indices, else :func:`_max_of_windows`."""
    if torch.is_grad_enabled() and x.requires_grad:
        return torch.max_pool2d(x, 2)
    return _max_of_windows(x)


def _max_of_windows(x: torch.Tensor) -> torch.Tensor:
    """2x2 max pooling, stride 2 (an odd last row or column dropped), without indices: the
    larger of the four strided views of each window's corners, in three elementwise
    maximums. Calls without gradients (the E-step, evaluation) on a CPU, one thread, the
    study CNN's shapes (151 images): 0.29 ms against 0.87 for max_pool2d on channels-last
    images (24 channels of 24 x 24) and 0.79 against 1.07 (384 of 8 x 8); on NCHW images
    0.85 and 1.5 against 8.5 and 16. The same values (a maximum is exact; both propagate
    NaN); only the sign of a zero in a window of tied zeros may differ, which changes no sum
    it enters with a nonzero term (the next layer's bias). Not for gradients: ties would
    split theirs."""
    H, W = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
    v = x[..., :H, :W].unflatten(-1, (W // 2, 2)).unflatten(-3, (H // 2, 2))
    top = torch.maximum(v[..., 0, :, 0], v[..., 0, :, 1])
    return torch.maximum(top, torch.maximum(v[..., 1, :, 0], v[..., 1, :, 1]))


class _MaxPool2x2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        xc = x.contiguous(memory_format=torch.channels_last)
        y, idx = torch.nn.functional.max_pool2d(xc, 2, return_indices=True)
        idx = idx.contiguous()
        ctx.save_for_backward(x, idx)
        return y.contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        x, idx = ctx.saved_tensors
        return torch.ops.aten.max_pool2d_with_indices_backward(
            grad.contiguous(), x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx
        )


#: devices on which conv_blocks runs its convolutions as batched matrix products
CONV_AS_PRODUCTS = ("cuda",)
#: bytes of image patches (or of the product, if larger) one batched product of conv_blocks
#: makes at most; more goes in slices of groups. This bounds the no-grad calls (the E-step,
#: evaluation); in training autograd keeps every slice's patches for the weights' gradient.
PATCH_BYTES = 2 << 30
#: a CPU's first conv runs as products (:func:`_first_block_by_products`) when its patches
#: take at most this many bytes (larger calls, the evaluation's, keep the grouped conv's
#: memory) and hold at most this many rows per output channel (copying wider patches, 3-channel
#: images for few outputs, cost more than the product saved)
CPU_PATCH_BYTES = 256 << 20
CPU_PATCH_ROWS_PER_OUTPUT = 2


def conv_blocks(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The two conv (valid) -> 2x2 max-pool -> ReLU blocks of the CNN and LeNet for many peers
    and components at once: params ``conv1.*``, ``conv2.*`` {name: (L, M, *shape)}, x (L, B,
    C, H, W) shared by the components -> features (L, M, B, c2 * h * w), flattened as
    ``nn.Module``'s ``x.flatten(1)``. The pooling comes before the ReLU (they commute: the ReLU
    then touches a quarter of the values).

    On a CPU the first conv is one product per peer over its images' patches, all M
    components' channels at once (:func:`_first_block_by_products`; where the patches are too
    wide or too large, ``CPU_PATCH_*``, one convolution group per peer), and the second runs one
    convolution group per (peer, component) on channels-last images, which oneDNN's grouped
    kernel reads faster (its forward 0.54x NCHW's for a step of the Fashion-MNIST study's
    calls); several times faster than vmap over conv2d. On a GPU (``CONV_AS_PRODUCTS``) both
    convs are batched matrix products over image patches: cuDNN ran the grouped conv as one
    kernel per group (300 for the FedEM CNN's second conv), and on an H100 the products took a
    step of the full CNN (100 peers x M = 3, batch 32) from 29.3 to 20.8 ms, and a FedEM
    round's local work from 1.01 to 0.89 s (docs/speed-notes.md). On a CPU the second conv's
    products were slower than its groups. Every form gives the module's numbers up to float
    rounding (tests/test_runtime.py).
    """
    if x.device.type in CONV_AS_PRODUCTS:
        return _conv_blocks_by_products(params, x)
    w1, w2 = params["conv1.weight"], params["conv2.weight"]
    L, M, c1, C, k, _ = w1.shape
    B, (H, W) = x.shape[1], x.shape[-2:]
    rows = C * k * k + 1
    patch_bytes = L * rows * B * (H - k + 1) * (W - k + 1) * x.element_size()
    if rows <= CPU_PATCH_ROWS_PER_OUTPUT * M * c1 and patch_bytes <= CPU_PATCH_BYTES:
        h = _first_block_by_products(x, w1, params["conv1.bias"])  # (B, L*M*c1, ., .)
    else:
        h = x.transpose(0, 1).flatten(1, 2)  # (B, L*C, H, W)
        h = torch.conv2d(h, w1.flatten(0, 2), params["conv1.bias"].flatten(), groups=L)
        h = torch.relu_(max_pool_2x2(h))  # (B, L*M*c1, ., .)
    h = h.contiguous(memory_format=torch.channels_last)
    h = torch.conv2d(h, w2.flatten(0, 2), params["conv2.bias"].flatten(), groups=L * M)
    h = torch.relu_(_cpu_pool(h))  # (B, L*M*c2, h, w)
    return h.reshape(B, L, M, -1).permute(1, 2, 0, 3)


def _first_block_by_products(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """The CPU's first block, ReLU(2x2 max-pool(conv)), x (L, B, C, H, W), weight (L, M, c1,
    C, k, k), bias (L, M, c1) -> (B, L*M*c1, H', W') channels-last, the grouped second conv's
    input.

    One product per peer: its images' k x k windows, a ones column appended (the bias comes
    with the product), times its M components' weights. For 4 to 5 peers' step of the study's
    CNN (batch 32, 2 threads) oneDNN's grouped convolution with one input channel per group
    took 25 to 33 ms for the forward and the weights' gradient, the products 5 to 6 ms, and a
    whole FedEM run got 0.67x (docs/speed-notes.md). The product's rows are (image, y, x), so
    its output is channels-last, which the pooling reads without a copy (PyTorch's NCHW pooling
    on a CPU is about 9x slower)."""
    L, M, c1, C, k, _ = weight.shape
    windows = _windows(x.transpose(1, 2), k)  # (L, C, k, k, B, Ho, Wo)
    B, Ho, Wo = windows.shape[-3:]
    K, O = C * k * k, M * c1
    # one plane (B, Ho, Wo) per window position: the copy writes whole rows (4 to 5x faster
    # than a window per row); the product reads it transposed, a little slower than it would
    # a contiguous copy, but far faster than making one
    patches = x.new_empty(L, K + 1, B, Ho, Wo, dtype=_product_dtype(x))
    patches[:, K] = 1
    patches[:, :K].view(windows.shape).copy_(windows)
    w = torch.cat([weight.reshape(L, O, K), bias.reshape(L, O, 1)], -1)  # (L, O, K + 1)
    h = torch.bmm(patches.view(L, K + 1, B * Ho * Wo).mT, w.mT)  # (L, B*Ho*Wo, O)
    h = torch.relu_(_cpu_pool(h.view(L * B, Ho, Wo, O).permute(0, 3, 1, 2)))
    Hp, Wp = h.shape[-2:]
    h = h.reshape(L, B, O, Hp, Wp).permute(1, 3, 4, 0, 2).contiguous()  # (B, Hp, Wp, L, O)
    return h.view(B, Hp, Wp, L * O).permute(0, 3, 1, 2)


def _conv_blocks_by_products(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """:func:`conv_blocks` as batched matrix products, the images' batch axis inside each
    group's (N, C, B, H, W) so that no layout changes between the blocks."""
    w1, w2 = params["conv1.weight"], params["conv2.weight"]
    L, M, c1 = w1.shape[:3]
    c2 = w2.shape[2]
    # conv1: one group per peer, its M components' c1 channels as M * c1 outputs
    h = _conv_pool_relu(
        x.transpose(1, 2), w1.flatten(1, 2), params["conv1.bias"].flatten(1)
    )  # (L, M*c1, B, h, w)
    # conv2: one group per (peer, component)
    h = _conv_pool_relu(
        h.unflatten(1, (M, c1)).flatten(0, 1),
        w2.flatten(0, 1),
        params["conv2.bias"].flatten(0, 1),
    )  # (L*M, c2, B, h, w)
    B = h.shape[2]
    return h.reshape(L, M, c2, B, -1).transpose(2, 3).reshape(L, M, B, -1)


def _conv_pool_relu(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """h (N, C, B, H, W), weight (N, O, C, k, k), bias (N, O) -> ReLU(2x2 max-pool(conv))
    (N, O, B, H', W') for square kernels, stride 1, no padding (the CNN's and LeNet's), group
    by group: each group's patches (C*k*k, B*Ho*Wo) times its (O, C*k*k) weights, in slices
    of groups whose patches and products fit ``PATCH_BYTES``."""
    N, C, B, H, W = h.shape
    O, k = weight.shape[1], weight.shape[-1]
    Ho, Wo = H - k + 1, W - k + 1
    h = h.to(_product_dtype(h))
    per_group = max(C * k * k, O) * B * Ho * Wo * h.element_size()
    per_slice = max(1, PATCH_BYTES // max(per_group, 1))  # groups
    # one slice of all groups: the tensors themselves, as a slice's gradient would be copied
    # into zeros of the whole (autograd's slice_backward, five a training step)
    slices = [(h, weight, bias)] if per_slice >= N else [
        (h[i : i + per_slice], weight[i : i + per_slice], bias[i : i + per_slice])
        for i in range(0, N, per_slice)]  # fmt: skip
    outs = []
    for part, w, b in slices:
        n = part.shape[0]
        # every k x k window as a view, then one copy in the product's layout
        patches = _windows(part, k).reshape(n, C * k * k, B * Ho * Wo)
        out = torch.baddbmm(b.unsqueeze(-1), w.reshape(n, O, C * k * k), patches)
        out = torch.max_pool2d(out.view(n * O, B, Ho, Wo), 2)
        outs.append(torch.relu_(out).view(n, O, B, Ho // 2, Wo // 2))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _windows(h: torch.Tensor, k: int) -> torch.Tensor:
    """Every k x k window (stride 1) of h (N, C, B, H, W) as a view (N, C, k, k, B, Ho, Wo):
    copied, one plane of (B, Ho, Wo) per window position, the patches of a product."""
    return h.unfold(3, k, 1).unfold(4, k, 1).permute(0, 1, 5, 6, 2, 3, 4)


def _product_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a product of ``x``'s patches runs in: autocast's where it is on (copying the
    patches in it once, as the product would again), else ``x``'s."""
    where = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(where):
        return torch.get_autocast_dtype(where)
    return x.dtype


def cache_sized_calls(conv1_floats: int, components: int) -> int:
    """A conv net's samples per batched call on a CPU (its ``samples_per_call``): keep the
    first conv's output (the largest activation, ``conv1_floats`` a sample and component) near
    8 MiB, so the pooling reads it from cache instead of memory: a FedEM round of the
    Fashion-MNIST study runs 2.4x faster than with one call over 100 peers
    (benchmarks/bench_cnn_calls.py)."""
    return max(8, (8 << 20) // (4 * components * conv1_floats))


class Linear(nn.Module):
    """One linear layer with bias on flattened inputs (the FedEM synthetic model)."""

    def __init__(self, input_shape: tuple[int, ...], num_outputs: int):
        super().__init__()
        self.fc = nn.Linear(math.prod(input_shape), num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))

    @staticmethod
    def batched_forward(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """params {name: (L, M, *shape)}, x (L, B, *in) -> logits (L, M, B, C)."""
        return batched_linear(x.flatten(2), params["fc.weight"], params["fc.bias"])


class MLP(nn.Module):
    """Flatten, then hidden ReLU layers, then a linear head."""

    def __init__(self, input_shape: tuple[int, ...], num_outputs: int, hidden: tuple = (200, 200)):
        super().__init__()
        sizes = [math.prod(input_shape), *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], num_outputs))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def batched_forward(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """params {name: (L, M, *shape)}, x (L, B, *in) -> logits (L, M, B, C)."""
        h = x.flatten(2)
        linears = [i for i, layer in enumerate(self.net) if isinstance(layer, nn.Linear)]
        for k, i in enumerate(linears):
            h = batched_linear(h, params[f"net.{i}.weight"], params[f"net.{i}.bias"])
            if k < len(linears) - 1:
                h = torch.relu(h)
        return h


class FedEMCNN(nn.Module):
    """The FedEM paper's CNN for 28x28 / 32x32 images: two 5x5 conv + max-pool blocks, a dense
    ReLU layer and a linear head. The defaults are the released code's widths (32 and 64
    channels, 2048 hidden units); ``channels`` and ``hidden`` narrow it for small machines."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_outputs: int,
        channels: tuple[int, int] = (32, 64),
        hidden: int = 2048,
    ):
        super().__init__()
        if len(channels) != 2 or min(channels) < 1:
            raise GossipError(f"model 'cnn': channels must be two positive widths, got {channels}")
        c_in, height, width = input_shape
        c1, c2 = channels
        self.conv1 = nn.Conv2d(c_in, c1, 5)
        self.conv2 = nn.Conv2d(c1, c2, 5)
        h = ((height - 4) // 2 - 4) // 2
        w = ((width - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(c2 * h * w, hidden)
        self.fc2 = nn.Linear(hidden, num_outputs)
        self._conv1_floats = c1 * (height - 4) * (width - 4)  # per sample and component

    def samples_per_call(self, components: int) -> int:
        return cache_sized_calls(self._conv1_floats, components)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))

    @staticmethod
    def batched_forward(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """params {name: (L, M, *shape)}, x (L, B, C, H, W) -> logits (L, M, B, classes);
        the convolutions as :func:`conv_blocks` runs them."""
        h = conv_blocks(params, x)  # (L, M, B, features)
        h = torch.relu(batched_linear(h, params["fc1.weight"], params["fc1.bias"]))
        return batched_linear(h, params["fc2.weight"], params["fc2.bias"])


class LeNet(nn.Module):
    """LeNet as PeFLL uses it for clients (Scott, Zakerinia, Lampert): conv 5x5 16, max-pool,
    conv 5x5 32, max-pool, dense 120 and 84 with ReLU, a linear head."""

    def __init__(self, input_shape: tuple[int, ...], num_outputs: int):
        super().__init__()
        if len(input_shape) != 3 or min(input_shape[1:]) < 16:
            raise GossipError(
                f"model 'lenet' needs images (C, H, W) of at least 16x16, the data has "
                f"{tuple(input_shape)}"
            )
        c_in, height, width = input_shape
        self.conv1 = nn.Conv2d(c_in, 16, 5)
        self.conv2 = nn.Conv2d(16, 32, 5)
        flat = 32 * (((height - 4) // 2 - 4) // 2) * (((width - 4) // 2 - 4) // 2)
        self.fc1 = nn.Linear(flat, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_outputs)
        self._conv1_floats = self.conv1.out_channels * (height - 4) * (width - 4)

    def samples_per_call(self, components: int) -> int:
        return cache_sized_calls(self._conv1_floats, components)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) -> the 84 ReLU features before the head."""
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return torch.relu(self.fc2(torch.relu(self.fc1(x.flatten(1)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.features(x))

    @staticmethod
    def batched_forward(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """params {name: (L, M, *shape)}, x (L, B, C, H, W) -> logits (L, M, B, classes);
        the convolutions as :func:`conv_blocks` runs them."""
        h = conv_blocks(params, x)  # (L, M, B, features)
        h = torch.relu(batched_linear(h, params["fc1.weight"], params["fc1.bias"]))
        h = torch.relu(batched_linear(h, params["fc2.weight"], params["fc2.bias"]))
        return batched_linear(h, params["fc3.weight"], params["fc3.bias"])


def one_hot(y: torch.Tensor, classes: int, dtype: torch.dtype) -> torch.Tensor:
    """``y (...) -> (..., classes)``, as ``F.one_hot`` without its check of the labels on the
    host (a read of ``y.min()``, which ``torch.func.vmap`` refuses); the labels were checked
    when the data was loaded."""
    return (y[..., None] == torch.arange(classes, device=y.device)).to(dtype)


class LeNetEmbedding(nn.Module):
    """PeFLL's embedding network phi(x, y): LeNet on the image with the one-hot label broadcast
    as ``num_classes`` extra input planes, its last layer 84 -> ``dim`` without a nonlinearity.
    ``forward(x (N, C, H, W), y (N,)) -> (N, dim)``, one embedding per example."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, dim: int):
        super().__init__()
        c_in, height, width = input_shape
        self.num_classes = num_classes
        self.net = LeNet((c_in + num_classes, height, width), dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        planes = one_hot(y, self.num_classes, x.dtype)  # (N, C)
        planes = planes[:, :, None, None].expand(-1, -1, *x.shape[2:])
        return self.net(torch.cat([x, planes], dim=1))


class LabelEmbedding(nn.Module):
    """PeFLL's label-only embedding: one linear layer on the one-hot label (its CIFAR-100
    choice); the descriptor is then a linear map of the client's label histogram."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, dim: int):
        super().__init__()
        self.num_classes = num_classes
        self.fc = nn.Linear(num_classes, dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fc(one_hot(y, self.num_classes, self.fc.weight.dtype))


#: embedding networks phi(x, y) -> R^dim (PeFLL), by name
EMBEDDINGS = {"lenet": LeNetEmbedding, "labels": LabelEmbedding}


class NextCharLSTM(nn.Module):
    """The FedEM paper's Shakespeare model: token embedding, two LSTM layers, a linear head
    predicting the next character from the last position. Inputs are int64 token ids (N, L)."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_outputs: int,
        embed: int = 8,
        hidden: int = 256,
        layers: int = 2,
    ):
        super().__init__()
        self.embed = nn.Embedding(num_outputs, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x.long()))
        return self.head(out[:, -1])


def mobilenet_v2(input_shape: tuple[int, ...], num_outputs: int, **options) -> nn.Module:
    """torchvision's MobileNet-v2 (optional: needs torchvision built for the installed torch).
    Its BatchNorm statistics make the runtime use the per-peer loop."""
    try:
        from torchvision.models import mobilenet_v2 as build
    except ImportError:
        raise GossipError(
            "model 'mobilenet_v2' needs torchvision: pip install torchvision (the build matching "
            "your torch)"
        ) from None
    return build(num_classes=num_outputs, **options)


MODELS = {
    "linear": Linear,
    "mlp": MLP,
    "cnn": FedEMCNN,
    "lenet": LeNet,
    "lstm": NextCharLSTM,
    "mobilenet_v2": mobilenet_v2,
}


def check_model_reads(name: str, dataset) -> None:
    """The model reads the dataset's kind of input: token ids (Shakespeare) only the LSTM,
    which reads nothing else (numbers cast to ids would train on all-zero tokens)."""
    tokens = dataset.meta.get("input_kind") == "tokens"
    x = np.asarray(dataset.clients[0].x_train) if dataset.clients else np.zeros(0, np.int64)
    # ids: integers, or floats that hold whole numbers (a user's own arrays)
    ids = x.dtype.kind in "iu" or (x.dtype.kind == "f" and bool((x == np.round(x)).all()))
    if name == "lstm" and not (tokens or ids):
        raise GossipError(
            f"model.name 'lstm' reads token ids (data.name 'shakespeare'); data.name "
            f"{dataset.name!r} has inputs of shape {tuple(dataset.input_shape)}"
        )
    if tokens and name != "lstm":
        raise GossipError(
            f"data.name {dataset.name!r} holds token ids, which only model.name 'lstm' reads "
            f"(got {name!r})"
        )


def build_model(name: str, input_shape: tuple[int, ...], num_outputs: int, **options) -> nn.Module:
    """Build a registered model; unknown names and options give a one-line GossipError."""
    if name not in MODELS:
        raise GossipError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    if name == "cnn" and len(input_shape) != 3:
        raise GossipError(f"model 'cnn' needs image inputs (C, H, W), the data has {input_shape}")
    if name != "mobilenet_v2":  # our models' options are widths and counts
        _check_sizes(name, MODELS[name], options)
    try:
        return MODELS[name](tuple(input_shape), num_outputs, **options)
    except TypeError as err:
        raise GossipError(f"model {name!r}: bad option ({err})") from None


def _check_sizes(name: str, model, options: dict) -> None:
    """Each option a positive int, or a list of them where its default is a tuple (torch's
    own messages for a width of -3 or "abc" name no option)."""
    params = inspect.signature(model).parameters
    for key, value in options.items():
        if key not in params:
            continue  # the constructor names it
        many, listed = isinstance(params[key].default, tuple), isinstance(value, (list, tuple))
        items = value if listed else [value]
        sizes = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in items)
        if many != listed or not sizes:
            what = "a list of positive integers" if many else "a positive integer"
            raise GossipError(f"model {name!r}: option {key!r} must be {what}, got {value!r}")
