"""Per-row gradients of a module's parameters (what DP-SGD clips), with :mod:`torch.func`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

__all__ = ["flat_per_row", "per_row_gradients", "row_objective"]


def row_objective(module: nn.Module, out: Callable[[torch.Tensor], torch.Tensor] | None = None
                  ) -> Callable[..., torch.Tensor]:
    """``fn(params, x_row, g_row) = <out(module(x_row)), g_row>``: one row's contribution to the backward pass of
    ``module`` given the gradient ``g_row`` of its (transformed by ``out``) output."""
    buffers = dict(module.named_buffers())

    def fn(params: dict[str, torch.Tensor], x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        y = functional_call(module, (params, buffers), (x.unsqueeze(0),)).squeeze(0)
        if out is not None:
            y = out(y.unsqueeze(0)).squeeze(0)
        return (y * g).sum()

    return fn


def per_row_gradients(fn: Callable[..., torch.Tensor], params: dict[str, torch.Tensor],
                      *rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name: (B, *shape)}``: the gradient of ``fn(params, *row_i)`` with respect to ``params`` for every row ``i``
    of the tensors ``rows`` (each ``(B, ...)``)."""
    detached = {k: v.detach() for k, v in params.items()}
    return vmap(grad(fn), in_dims=(None, *([0] * len(rows))))(detached, *rows)


def flat_per_row(grads: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """The per-row gradients of ``names`` side by side: ``(B, total parameters)``."""
    return torch.cat([grads[n].reshape(grads[n].shape[0], -1) for n in names], dim=1)
