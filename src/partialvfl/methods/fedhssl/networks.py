"""FedHSSL's networks: local models cut into bottom and top encoders, and the averaging of top encoders."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from partialvfl.nn.blocks import MLP, ResNet18, image_shape

__all__ = ["average_state_dicts", "split_encoder"]


class _Unflatten(nn.Module):
    def __init__(self, shape: Sequence[int]) -> None:
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, *self.shape)


class _PoolFlatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


def split_encoder(feature_shape: Sequence[int], out_dim: int, arch: str = "auto", hidden: Sequence[int] = (128,),
                  width: int = 64) -> tuple[nn.Module, nn.Module]:
    """A local model cut into (bottom, top) encoders whose top has the same shape at every party.

    ``mlp``: bottom = Linear(d, hidden[0]) + ReLU, top = MLP(hidden[0], hidden[1:], out_dim).  ``cnn``: bottom = one
    3x3 convolution (32 channels), top = a stride-2 convolution (64), global average pool, linear.  ``resnet18``:
    bottom = stem and first stage, top = the other three stages, pool and head (FedHSSL's split).  The top never
    depends on the piece size, so it can be averaged across parties.
    """
    shape = tuple(int(s) for s in feature_shape)
    if arch == "auto":
        arch = "mlp" if len(shape) == 1 else "cnn"
    if arch == "mlp":
        d = int(np.prod(shape))
        hidden = [int(h) for h in hidden]
        if not hidden:
            raise ValueError("a split MLP encoder needs at least one hidden width (encoder_hidden)")
        return nn.Sequential(nn.Linear(d, hidden[0]), nn.ReLU()), MLP(hidden[0], hidden[1:], out_dim)
    if arch == "cnn":
        c, _, _ = image_shape(shape)
        bottom = nn.Sequential(_Unflatten(image_shape(shape)), nn.Conv2d(c, 32, 3, padding=1), nn.ReLU())
        top = nn.Sequential(nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(), _PoolFlatten(),
                            nn.Linear(64, out_dim))
        return bottom, top
    if arch == "resnet18":
        net = ResNet18(shape, out_dim, width=width)
        bottom = nn.Sequential(_Unflatten(net.shape), net.stem, net.stages[:2])
        top = nn.Sequential(net.stages[2:], _PoolFlatten(), net.head)
        return bottom, top
    raise ValueError(f"unknown encoder architecture {arch!r}; choose auto, mlp, cnn or resnet18")


def average_state_dicts(states: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of state dicts with the same keys and shapes (integer buffers: rounded mean).

    Keys are matched by name, in any order (the wire does not keep the order in which a party listed them).
    """
    if not states:
        raise ValueError("nothing to average")
    keys = list(states[0])
    for s in states[1:]:
        if set(s) != set(keys):
            raise ValueError("the parties' top encoders do not have the same parameters")
    out = {}
    for key in keys:
        stacked = torch.stack([s[key].detach().double() for s in states])
        mean = stacked.mean(0)
        out[key] = mean.round().to(states[0][key].dtype) if not states[0][key].is_floating_point() \
            else mean.to(states[0][key].dtype)
    return out
