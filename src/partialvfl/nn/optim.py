"""The optimiser factory every method uses: Adam or SGD with momentum, by name."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["OPTIMIZERS", "make_optimizer"]

OPTIMIZERS = ("adam", "sgd")


def make_optimizer(params: Iterable[torch.nn.Parameter] | Iterable[dict], name: str, lr: float,
                   weight_decay: float = 0.0, momentum: float = 0.0) -> torch.optim.Optimizer:
    """``adam`` (momentum unused) or ``sgd`` (with ``momentum``) over ``params``."""
    if name == "adam":
        return torch.optim.Adam(params, lr=float(lr), weight_decay=float(weight_decay))
    if name == "sgd":
        return torch.optim.SGD(params, lr=float(lr), momentum=float(momentum), weight_decay=float(weight_decay))
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
