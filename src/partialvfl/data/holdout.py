"""Validation data taken from the labelled training rows, never from a test set."""

from __future__ import annotations

import numpy as np

from partialvfl.data.dataset import DataValidationError, VerticalDataset
from partialvfl.utils.seeding import numpy_rng

__all__ = ["hold_out_labels"]


def hold_out_labels(data: VerticalDataset, fraction: float, seed: int, *, stream: str = "validation-split"
                    ) -> tuple[VerticalDataset, VerticalDataset]:
    """``(fit data, validation data)``: a seeded ``fraction`` of the labelled rows loses its labels in the fit data
    (the rows stay, unlabelled, with their observed blocks) and forms the validation set.

    ``stream`` names the seeded draw (callers that must keep an earlier draw pass their own).
    """
    fraction = float(fraction)
    if not 0.0 < fraction < 1.0:
        raise DataValidationError(f"the validation fraction must lie in (0, 1), got {fraction}")
    labeled = np.flatnonzero(data.labeled)
    n_val = int(round(fraction * len(labeled)))
    if not 1 <= n_val < len(labeled):
        raise DataValidationError(f"holding out {fraction} of {len(labeled)} labelled samples leaves no "
                                  "validation or no training label")
    val_rows = np.sort(numpy_rng(seed, stream).choice(labeled, size=n_val, replace=False))
    keep = data.labeled.copy()
    keep[val_rows] = False
    return data.with_labels(keep), data.subset(val_rows)
