"""Several parties' MLPs evaluated as one batched computation (the in-process simulation's fast path).

K parties running the same architecture each keep their own :class:`~partialvfl.nn.blocks.MLP` (their weights,
their gradients, their optimiser).  For one round of a simulation, :func:`stacked_mlp` stacks the K weight matrices of
each layer into ``(K, out, in)`` and runs one ``baddbmm`` per layer over inputs padded to ``(K, N, in)``; autograd
carries each slice of the stacked gradient back to the party's own parameter, so after ``backward`` every party's
``.grad`` is exactly what its own forward pass would have produced (up to float summation order).

Stacking copies the weights once per call (a few MB at most), which is small beside the matmuls it batches; it
keeps every party's parameters in its own storage, so nothing else (optimisers, ``state_dict``, save/load, the
per-party path) changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from partialvfl.nn.compiled import compiled

__all__ = ["mlp_signature", "pad_rows", "stacked_mlp"]


def mlp_signature(module: nn.Module) -> tuple[tuple[str, int, int], ...] | None:
    """The layer shapes of a plain MLP (Linear and ReLU layers only), or ``None`` if it cannot be stacked.

    Two modules with the same signature can share one :func:`stacked_mlp` call.
    """
    if not isinstance(module, nn.Sequential):
        return None
    sig: list[tuple[str, int, int]] = []
    for layer in module:
        if isinstance(layer, nn.Linear) and layer.bias is not None:
            sig.append(("linear", layer.in_features, layer.out_features))
        elif isinstance(layer, nn.ReLU):
            sig.append(("relu", 0, 0))
        else:
            return None
    return tuple(sig) if sig else None


def _stacked(params: list[torch.Tensor], x: torch.Tensor, layout: tuple[bool, ...], k: int) -> torch.Tensor:
    """The pass of :func:`stacked_mlp` on plain tensors: per layer of ``layout`` (``True``: linear, ``False``: ReLU)
    the K weights, then the K biases, of each linear layer in ``params``."""
    i = 0
    for linear in layout:
        if linear:
            weight = torch.stack(params[i:i + k])  # (K, out, in)
            bias = torch.stack(params[i + k:i + 2 * k]).unsqueeze(1)  # (K, 1, out)
            x = torch.baddbmm(bias, x, weight.transpose(1, 2))
            i += 2 * k
        else:
            x = torch.relu(x)
    return x


_COMPILED = compiled(_stacked, True, "the stacked party MLPs")


def stacked_mlp(modules: Sequence[nn.Sequential], x: torch.Tensor, *, compile: bool = False) -> torch.Tensor:
    """``(K, N, in) -> (K, N, out)``: party k's rows through party k's MLP, all parties in one batched pass.

    ``modules`` must share one :func:`mlp_signature`; ``x[k]`` are party k's inputs (padded rows are computed too
    and must be ignored by the caller).  ``compile``: through ``torch.compile`` (:mod:`partialvfl.nn.compiled`).
    """
    if x.dim() != 3 or x.shape[0] != len(modules):
        raise ValueError(f"stacked_mlp needs inputs (K={len(modules)}, N, in), got shape {tuple(x.shape)}")
    layout = tuple(isinstance(layer, nn.Linear) for layer in modules[0])
    params = [p for i, linear in enumerate(layout) if linear
              for p in [m[i].weight for m in modules] + [m[i].bias for m in modules]]
    return (_COMPILED if compile else _stacked)(params, x, layout, len(modules))


def pad_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack ``(n_k, ...)`` tensors into ``(K, max n_k, ...)``, zero rows after each party's ``n_k``."""
    if all(t.shape[0] == tensors[0].shape[0] for t in tensors):
        return torch.stack(list(tensors))
    return torch.nn.utils.rnn.pad_sequence(list(tensors), batch_first=True)
