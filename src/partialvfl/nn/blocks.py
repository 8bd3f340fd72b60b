"""Network building blocks shared by the methods: MLPs, small CNN encoders, transposed-CNN decoders, ResNet-18.

Party blocks arrive flattened ``(batch, d_k)``; image pieces carry their ``feature_shape`` ((H, W) or (C, H, W))
so the convolutional modules reshape internally.  torchvision does not import beside this machine's torch build,
so the few vision models needed are written here (ResNet-18 after He et al., 2016, with the small-input stem used
for CIFAR-sized images: 3x3 convolution, no max-pool).

On a CUDA GPU the convolutional modules compute in the channels-last (NHWC) memory format
(:func:`for_device`): cuDNN's fastest convolution and batch-norm kernels are NHWC, and given NCHW tensors it wraps
each convolution in layout conversions (``nchwToNhwc``/``nhwcToNchw``: 19 % of the FashionMNIST paper step's kernel
time on an H200, issue 36).  Elsewhere (the CPU) they keep the default layout, so CPU numbers do not move.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = [
    "CNNEncoder",
    "ConvBlock",
    "MLP",
    "ResNet18",
    "TransposedCNNDecoder",
    "build_decoder",
    "build_encoder",
    "decoder_arch",
    "encoder_arch",
    "for_device",
    "image_shape",
    "RowBlocks",
    "in_row_blocks",
    "use_channels_last",
]

#: rows per block of :func:`in_row_blocks`
ROW_BLOCK = 256


class MLP(nn.Sequential):
    """Linear layers with ReLU between them (none after the last); ``hidden`` lists the hidden widths."""

    def __init__(self, in_dim: int, hidden: Sequence[int], out_dim: int, *, dropout: float = 0.0,
                 batch_norm: bool = False) -> None:
        layers: list[nn.Module] = []
        d = in_dim
        for h in hidden:
            layers.append(nn.Linear(d, h))
            if batch_norm:
                layers.append(nn.BatchNorm1d(h))
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            d = h
        layers.append(nn.Linear(d, out_dim))
        super().__init__(*layers)
        self.in_dim, self.out_dim = in_dim, out_dim


def in_row_blocks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int = ROW_BLOCK
                  ) -> torch.Tensor:
    """``fn(x)`` computed on blocks of exactly ``rows`` rows (``x``'s leading axes flattened: ``(..., d)`` ->
    ``(n, d)``; the last block padded with zero rows, their outputs dropped), for a row-wise ``fn`` (a network in eval
    mode) whose output keeps the leading axes.

    So every row meets the same kernels whatever else is in ``x``: the kernel of a matrix product depends on its
    number of rows (on an AVX2 CPU: fewer than 4 rows, or a single output column at most row counts), and their sums
    differ in the last bits; within a block of a fixed size each row is computed alike wherever it sits.  Used where
    a row's output must be the same floats in any batch (a prediction, :mod:`partialvfl.methods.false_vfl.rowwise`).
    """
    lead = tuple(x.shape[:-1])
    flat = x.reshape(-1, x.shape[-1])
    n = int(flat.shape[0])
    if n == 0:
        return fn(x)
    pad = -n % rows
    if pad:
        flat = torch.cat([flat, flat.new_zeros((pad, flat.shape[1]))])
    out = torch.cat([fn(flat[start:start + rows]) for start in range(0, n + pad, rows)])[:n]
    return out.reshape(*lead, *out.shape[1:])


class RowBlocks(nn.Module):
    """``module`` run by :func:`in_row_blocks`: the same floats for a row in any batch (a prediction's view of a
    network in eval mode; it holds no weights of its own)."""

    def __init__(self, module: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.inner = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The inner module applied to ``x`` in blocks of rows."""
        return in_row_blocks(self.inner, x)


def image_shape(feature_shape: Sequence[int]) -> tuple[int, int, int]:
    """(C, H, W) for a 2-D (H, W) or 3-D (C, H, W) feature shape."""
    s = tuple(int(v) for v in feature_shape)
    if len(s) == 2:
        return (1, s[0], s[1])
    if len(s) == 3:
        return s  # type: ignore[return-value]
    raise ValueError(f"an image feature shape is (H, W) or (C, H, W), got {s}")


class ConvBlock(nn.Module):
    """A convolutional module fed flattened rows: ``images`` reshapes them to ``(N, C, H, W)`` in the module's memory
    format (``channels_last``: set by :func:`use_channels_last`, with the weights converted alike)."""

    channels_last = False
    shape: tuple[int, int, int]

    def images(self, x: torch.Tensor, shape: Sequence[int] | None = None) -> torch.Tensor:
        """``x`` as a batch of images of ``shape`` (default: the module's input shape), channels last if set."""
        x = x.reshape(-1, *(shape or self.shape))
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x


class CNNEncoder(ConvBlock):
    """Two 3x3 convolutions (the second with stride 2) and a linear map, for small image pieces."""

    def __init__(self, feature_shape: Sequence[int], out_dim: int, channels: Sequence[int] = (32, 64)) -> None:
        super().__init__()
        self.shape = image_shape(feature_shape)
        c, h, w = self.shape
        c1, c2 = channels
        self.conv = nn.Sequential(
            nn.Conv2d(c, c1, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c1, c2, 3, stride=2, padding=1), nn.ReLU(),
        )
        self.head = nn.Linear(c2 * ((h + 1) // 2) * ((w + 1) // 2), out_dim)
        self.out_dim = out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The representation of each flattened image in ``x``."""
        z = self.conv(self.images(x))
        return self.head(z.flatten(1))


class TransposedCNNDecoder(ConvBlock):
    """A linear map to a half-resolution feature map, one stride-2 transposed convolution, a 3x3 convolution.

    Returns ``(batch, C*H*W)`` flattened outputs (e.g. the means of a Gaussian over a piece's pixels).
    """

    def __init__(self, in_dim: int, feature_shape: Sequence[int], channels: Sequence[int] = (64, 32)) -> None:
        super().__init__()
        self.shape = image_shape(feature_shape)
        c, h, w = self.shape
        self.h2, self.w2 = (h + 1) // 2, (w + 1) // 2
        c1, c2 = channels
        self.c1 = c1
        self.fc = nn.Sequential(nn.Linear(in_dim, c1 * self.h2 * self.w2), nn.ReLU())
        self.deconv = nn.Sequential(
            nn.ConvTranspose2d(c1, c2, 4, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(c2, c, 3, padding=1),
        )
        self.out_dim = c * h * w

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """The flattened image decoded from each representation in ``z`` (leading axes kept)."""
        lead = z.shape[:-1]
        x = self.images(self.fc(z.reshape(-1, z.shape[-1])), (self.c1, self.h2, self.w2))
        x = self.deconv(x)[:, :, : self.shape[1], : self.shape[2]]
        return x.reshape(*lead, self.out_dim)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + self.short(x))


class ResNet18(ConvBlock):
    """ResNet-18 for small inputs: 3x3 stem, four stages of two basic blocks, global average pool, linear head.

    ``width`` scales the channel counts (64 gives the standard 64/128/256/512).
    """

    def __init__(self, feature_shape: Sequence[int], out_dim: int, width: int = 64) -> None:
        super().__init__()
        self.shape = image_shape(feature_shape)
        c = self.shape[0]
        widths = [width, 2 * width, 4 * width, 8 * width]
        self.stem = nn.Sequential(nn.Conv2d(c, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks: list[nn.Module] = []
        cin = width
        for i, wd in enumerate(widths):
            stride = 1 if i == 0 else 2
            blocks += [_BasicBlock(cin, wd, stride), _BasicBlock(wd, wd, 1)]
            cin = wd
        self.stages = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, out_dim)
        self.out_dim = out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The representation of each flattened image in ``x`` (global average pooling, then the head)."""
        y = self.stages(self.stem(self.images(x)))
        return self.head(y.mean(dim=(2, 3)))


def use_channels_last(module: nn.Module) -> nn.Module:
    """``module`` with every :class:`ConvBlock` in it computing in the channels-last memory format: their 4-D
    weights converted (in place) and their inputs converted on entry.  The same values up to float rounding (other
    kernels sum in another order); a state saved from it loads into a module of either layout."""
    blocks = [m for m in module.modules() if isinstance(m, ConvBlock)]
    for block in blocks:
        block.channels_last = True
        block.to(memory_format=torch.channels_last)
    return module


def for_device(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` in the memory layout ``device`` computes fastest in: channels-last convolutional blocks on a CUDA
    GPU (:func:`use_channels_last`), unchanged anywhere else (the CPU's numbers stay bit for bit as they were)."""
    return use_channels_last(module) if torch.device(device).type == "cuda" else module


def encoder_arch(arch: str, feature_shape: Sequence[int]) -> str:
    """The encoder family :func:`build_encoder` builds for ``arch`` (``auto``: mlp for a vector, cnn otherwise)."""
    if arch == "auto":
        return "mlp" if len(feature_shape) == 1 else "cnn"
    return arch


def decoder_arch(arch: str, feature_shape: Sequence[int]) -> str:
    """The decoder family :func:`build_decoder` builds for ``arch`` (``auto``: mlp for a vector, deconv otherwise)."""
    if arch == "auto":
        return "mlp" if len(feature_shape) == 1 else "deconv"
    return arch


def build_encoder(feature_shape: Sequence[int], out_dim: int, arch: str = "auto",
                  hidden: Sequence[int] = (256, 256), width: int = 64) -> nn.Module:
    """A party feature extractor: ``mlp`` (tabular), ``cnn`` (image pieces), ``resnet18``; ``auto`` picks by shape."""
    shape = tuple(int(s) for s in feature_shape)
    arch = encoder_arch(arch, shape)
    d = math.prod(shape)
    if arch == "mlp":
        return MLP(d, hidden, out_dim)
    if arch == "cnn":
        return CNNEncoder(shape, out_dim)
    if arch == "resnet18":
        return ResNet18(shape, out_dim, width=width)
    raise ValueError(f"unknown encoder architecture {arch!r}; choose auto, mlp, cnn or resnet18")


def build_decoder(in_dim: int, feature_shape: Sequence[int], arch: str = "auto",
                  hidden: Sequence[int] = (256, 256)) -> nn.Module:
    """A party decoder from a latent to the (flattened) block: ``mlp`` or ``deconv`` (transposed CNN)."""
    shape = tuple(int(s) for s in feature_shape)
    arch = decoder_arch(arch, shape)
    d = math.prod(shape)
    if arch == "mlp":
        return MLP(in_dim, hidden, d)
    if arch == "deconv":
        return TransposedCNNDecoder(in_dim, shape)
    raise ValueError(f"unknown decoder architecture {arch!r}; choose auto, mlp or deconv")
