"""DP-SGD for the split-network party program, at a party that keeps a differential-privacy budget.

The gradient of a training step is the sum over the party's rows in the batch of each row's own contribution
``J_i^T g_i`` (``g_i``: the gradient the coordinator sent for that row's released representation).  Each row's
contribution, over all the party's models at once (Combinatorial: a row feeds several), scaled by the number of rows
``n`` of the step (so that it reads as one sample's loss gradient when the coordinator's loss is the batch mean), is
clipped to the plan's ``grad_clip``; the sum gets Gaussian noise and is divided by ``n`` again
(:meth:`~partialvfl.federation.dp.gaussian.PartyPrivacy.private_sum`, which charges every row once).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from partialvfl.federation.dp.gaussian import clip_rows
from partialvfl.nn.per_sample import flat_per_row, per_row_gradients, row_objective

__all__ = ["private_update"]


def private_update(program: Any, grads: dict[str, torch.Tensor]) -> None:
    """One DP-SGD step of every model named in ``grads`` (model -> ``(rows, latent)`` gradients)."""
    privacy = program.runtime.privacy
    clip = privacy.clip_for("emb:{model}")
    units = []
    for name, g in grads.items():
        if program._pending.pop(name, None) is None or name not in program._private_rows:
            raise RuntimeError(f"party {program.party}: gradient for {name!r} without a pending training forward")
        handle, rows, x = program._private_rows.pop(name)
        if len(rows):
            units.append((name, program.runtime.row_keys(handle, rows), x, g.float()))
    for name in grads:
        program.optimizers[name].zero_grad()
    if units:
        _step(program, units, clip, privacy)
    for name in grads:
        program.optimizers[name].step()


def _step(program: Any, units: list[tuple[str, list[str], torch.Tensor, torch.Tensor]], clip: float,
          privacy: Any) -> None:
    keys = list(dict.fromkeys(k for _, ks, _, _ in units for k in ks))
    slot = {k: i for i, k in enumerate(keys)}
    n = len(keys)
    blocks, params = [], []
    for name, ks, x, g in units:
        model = program._model(name)
        named = dict(model.named_parameters())
        per_row = per_row_gradients(row_objective(model, lambda y: clip_rows(y, clip)), named, x, g)
        flat = flat_per_row(per_row, list(named))
        full = torch.zeros(n, flat.shape[1], dtype=flat.dtype)
        full[torch.as_tensor(np.fromiter((slot[k] for k in ks), dtype=np.int64, count=len(ks)))] = flat * n
        blocks.append(full)
        params.append(list(named.values()))
    total = privacy.private_sum(keys, torch.cat(blocks, dim=1), "a training update") / n
    start = 0
    for group in params:
        for p in group:
            size = p.numel()
            p.grad = total[start:start + size].view_as(p).to(p.dtype).clone()
            start += size
