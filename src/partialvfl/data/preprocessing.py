"""Per-party standardisation: each party fits mean and scale on its own observed training rows only."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partialvfl.data.dataset import DataValidationError, VerticalDataset

__all__ = ["Standardizer"]


@dataclass(frozen=True)
class Standardizer:
    """Per-party, per-column mean and standard deviation, each fitted by its party on its observed rows.

    Columns with zero spread (constant over the observed training rows) keep scale 1, so they map to 0 rather than
    to NaN.  ``fit`` on the training set, ``transform`` training and test sets alike.
    """

    means: tuple[np.ndarray, ...]
    scales: tuple[np.ndarray, ...]

    @classmethod
    def fit(cls, data: VerticalDataset) -> Standardizer:
        means, scales = [], []
        for k in range(data.n_parties):
            view = data.party(k)  # each party fits on what it holds, nothing else
            if view.n_observed == 0:
                raise DataValidationError(
                    f"party {k} ({view.name!r}) observes no training sample: nothing to fit its scaling on"
                )
            x = view.features.astype(np.float64)
            mu = x.mean(axis=0)
            sd = x.std(axis=0)
            sd[sd < 1e-8] = 1.0
            means.append(mu.astype(np.float32))
            scales.append(sd.astype(np.float32))
        return cls(tuple(means), tuple(scales))

    def transform(self, data: VerticalDataset) -> VerticalDataset:
        if data.n_parties != len(self.means):
            raise DataValidationError(
                f"standardizer was fitted on {len(self.means)} parties, data has {data.n_parties}"
            )
        blocks = []
        for k, b in enumerate(data.blocks):
            if b.shape[1] != self.means[k].shape[0]:
                raise DataValidationError(
                    f"party {k} ({data.party_names[k]!r}) has {b.shape[1]} columns, the standardizer "
                    f"{self.means[k].shape[0]}"
                )
            blocks.append((b - self.means[k]) / self.scales[k])  # NaN rows stay NaN
        return data._replace(blocks=blocks)
