"""Per-row seeds of a prediction's random draws: a mixin of :class:`~partialvfl.methods.base.VFLMethod`.

A row's prediction must depend on the model, its data and its ID only (design.md): whatever a method draws at random
for a row (Monte Carlo samples, a tie-break) comes from the row's own seed, never from the batch it arrives in.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np

from partialvfl.data.ids import id_seeds

if TYPE_CHECKING:
    from partialvfl.data.dataset import CoordinatorView

__all__ = ["RowSeeds"]


class RowSeeds:
    """``_row_seeds`` and ``_label_side_digest``; needs ``seed``, ``_validating`` and ``_coordinator_modules()`` from
    the class it is mixed into."""

    seed: int
    _validating: bool
    _coordinator_modules: Any  # the method's label-side modules by name

    def _row_seeds(self, view: CoordinatorView, rows: np.ndarray, *keys: object, secret: bytes = b""
                   ) -> np.ndarray | None:
        """Each of ``rows``' own seed (int64) for what a prediction draws at random for it (Monte Carlo samples, a
        tie-break), from the model's seed, ``secret`` (for seeds that cross to a party: something it does not hold,
        e.g. :meth:`_label_side_digest`), ``keys`` and the row's normalised ID (:func:`~partialvfl.data.ids.
        id_seeds`): a row's prediction then depends on its data and ID alone, never on the rest of its batch.

        ``None`` while a fit validates for early stopping: those draws stay the training's own (by batch or
        position), because a federation's training view knows its users by alignment tokens, not by ID, and a fit
        must validate alike in one process and across a federation (and as it did before per-row seeds)."""
        if self._validating:
            return None
        return id_seeds(np.asarray(view.ids)[np.asarray(rows, dtype=np.int64)], self.seed, *keys, secret=secret)

    def _label_side_digest(self) -> bytes:
        """SHA-256 of the active party's module weights: a secret of the fitted model that never leaves the label
        side (the parties get the model's seed at setup, never these weights); the same for a saved and loaded
        model, and for an in-process and a federated fit that are bit for bit the same model."""
        import torch

        digest = hashlib.sha256()
        for name, module in sorted(self._coordinator_modules().items()):
            for key, value in sorted(module.state_dict().items()):
                digest.update(f"{name}.{key}".encode())
                if value.is_meta:  # no data to hash (the meta device runs shapes only): its shape stands in
                    digest.update(repr((tuple(value.shape), str(value.dtype))).encode())
                    continue
                digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.digest()
