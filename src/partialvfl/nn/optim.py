"""The optimiser factory every method uses: Adam or SGD with momentum, by name; Adam fused.

Adam uses torch's fused kernel (``fused=True``, CPU and CUDA): one kernel per tensor instead of a dozen small
operations, about 3x faster for a party's dozen tensors (measured on this project's 2-core machine, loaded: 1.9 vs
7.3 ms for 8 parties' FALSE-VFL modules); the update rule is the same, only the float rounding may differ in the
last bits.  SGD stays on torch's default path: its fused kernel (torch 2.13) fails when some parameters already
have a momentum buffer and others get their first gradient later (e.g. LASER-VFL's per-party heads).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["OPTIMIZERS", "make_optimizer"]

OPTIMIZERS = ("adam", "sgd")


def _fusable(params: list) -> bool:
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    return bool(tensors) and all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors)


def make_optimizer(params: Iterable[torch.nn.Parameter] | Iterable[dict], name: str, lr: float,
                   weight_decay: float = 0.0, momentum: float = 0.0) -> torch.optim.Optimizer:
    """``adam`` (momentum unused) or ``sgd`` (with ``momentum``) over ``params``."""
    params = list(params)
    if name == "adam":
        return torch.optim.Adam(params, lr=float(lr), weight_decay=float(weight_decay),
                                fused=True if _fusable(params) else None)
    if name == "sgd":
        return torch.optim.SGD(params, lr=float(lr), momentum=float(momentum), weight_decay=float(weight_decay))
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
