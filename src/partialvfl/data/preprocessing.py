"""Standardisation that belongs to each party: statistics fitted on that party's own rows, applied by that party.

* :class:`ColumnScaler`: one party's per-column mean and scale, fitted in float64 on the rows it holds (so values
  around 1e30 neither overflow nor turn into NaN).  A column constant over those rows is centred, not scaled
  (scale 1).  The party runtime (:class:`~partialvfl.federation.runtime.party.PartyRuntime`) keeps one, fitted on the
  training rows when a fit starts, saves it with the party's state and applies it to every dataset the party is
  handed afterwards (training and prediction alike); in a deployment the statistics never leave the party.
* :class:`Standardizer`: the paper's protocol (:func:`~partialvfl.data.protocol.make_protocol`): every party's
  scaler fitted on the fully observed training set before the missingness mechanisms, applied to a whole dataset.

Features are numeric by construction (the table readers refuse text and categorical columns, naming them) and
finite in every held row (a missing value inside a held row is refused, naming the column and the ID), so a scaler
never sees NaN in the rows it is fitted on or applied to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from partialvfl.data.dataset import DataValidationError, VerticalDataset

__all__ = ["ColumnScaler", "Standardizer"]


@dataclass(frozen=True)
class ColumnScaler:
    """Per-column ``mean`` and ``scale`` (float64) of one party: ``transform(x) = (x - mean) / scale``."""

    mean: np.ndarray
    scale: np.ndarray

    @classmethod
    def fit(cls, features: np.ndarray, where: str = "this party") -> ColumnScaler:
        """Statistics of ``features`` (rows x columns), computed in float64."""
        x = np.asarray(features, dtype=np.float64)
        if x.ndim != 2 or x.shape[0] == 0:
            raise DataValidationError(f"{where} holds no training row: nothing to fit its standardisation on")
        if not np.all(np.isfinite(x)):
            raise DataValidationError(f"{where}: a training feature is not finite; cannot standardise")
        mean = x.mean(axis=0)
        scale = x.std(axis=0)
        scale[(np.ptp(x, axis=0) == 0) | ~(scale > 0)] = 1.0  # constant columns are centred, not scaled
        return cls(mean, scale)

    @property
    def n_features(self) -> int:
        """The number of columns scaled."""
        return int(self.mean.shape[0])

    def transform(self, features: np.ndarray, where: str = "this party") -> np.ndarray:
        """``(features - mean) / scale`` computed in float64, returned as float32."""
        x = np.asarray(features)
        if x.ndim != 2 or x.shape[1] != self.n_features:
            raise DataValidationError(f"{where}: the data has {x.shape[1] if x.ndim == 2 else x.shape} feature "
                                      f"columns, its standardisation was fitted on {self.n_features}")
        with np.errstate(over="ignore"):  # a value beyond float32 once scaled: the model's output check names it
            return ((x.astype(np.float64) - self.mean) / self.scale).astype(np.float32)

    def state_dict(self) -> dict[str, Any]:
        """Plain lists (what a party's state file stores)."""
        return {"mean": self.mean.tolist(), "scale": self.scale.tolist()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ColumnScaler:
        """The scaler stored by :meth:`state_dict`."""
        mean = np.asarray(state["mean"], dtype=np.float64)
        scale = np.asarray(state["scale"], dtype=np.float64)
        if mean.ndim != 1 or mean.shape != scale.shape or not (np.all(np.isfinite(mean)) and np.all(scale > 0)):
            raise ValueError("standardisation statistics are malformed (mean and positive scale per column)")
        return cls(mean, scale)


@dataclass(frozen=True)
class Standardizer:
    """Per-party, per-column mean and standard deviation, each fitted by its party on its observed rows.

    The protocol's standardisation (see the module docstring); ``fit`` on the training set, ``transform`` training
    and test sets alike.  Statistics as :class:`ColumnScaler`, applied in float32.
    """

    means: tuple[np.ndarray, ...]
    scales: tuple[np.ndarray, ...]

    @classmethod
    def fit(cls, data: VerticalDataset) -> Standardizer:
        """Each party's column means and standard deviations, on the rows it observes."""
        means, scales = [], []
        for k in range(data.n_parties):
            view = data.party(k)  # each party fits on what it holds, nothing else
            scaler = ColumnScaler.fit(view.features, f"party {k} ({view.name!r})")
            means.append(scaler.mean.astype(np.float32))
            scales.append(scaler.scale.astype(np.float32))
        return cls(tuple(means), tuple(scales))

    def transform(self, data: VerticalDataset) -> VerticalDataset:
        """``data`` with every party's block standardised (the parties must be the fitted ones)."""
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
