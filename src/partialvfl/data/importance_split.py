"""Importance-based party splits: parties hold unequal shares of the predictive signal.

In the style of VertiBench's importance splits (Wu, Hou and He, "VertiBench: Advancing Feature Distribution
Diversity in Vertical Federated Learning Benchmarks", ICLR 2024), with our own assignment rule:

1. **Score** every feature's importance on the *training* split (never the test split): the mutual information
   between the feature and the label (scikit-learn's k-nearest-neighbour estimator, ``mutual_info_classif``; for
   regression ``mutual_info_regression``), on at most ``max_rows`` training rows drawn with the protocol's seed.
   Negative estimates are set to 0.
2. **Draw** the parties' importance shares ``s ~ Dirichlet(alpha * 1_K)`` with the protocol's seed; ``alpha = inf``
   gives equal shares ``1/K``.  Small alpha concentrates the signal on few parties, large alpha spreads it evenly.
3. **Assign** features greedily: in decreasing order of importance, each feature goes to the party whose total
   importance is furthest below its target ``s_k * total`` (ties to the lower party index), so every party's total
   importance matches its share as closely as the features allow; features of zero importance are then dealt to
   the parties in the same way, which evens out their counts.  Every party gets at least one feature.

Party blocks are flat (tabular) whatever the sample shape, since a party's features are scattered over the image;
use MLP parties.  The split is recorded in the dataset's ``info["split"]`` (target and realised shares, feature
counts) so reports can show how unequal it was.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partialvfl.data.split_base import ColumnGroup, SplitterError

__all__ = ["FittedImportanceSplit", "ImportanceSplitter", "assign_by_importance", "draw_shares"]


def draw_shares(alpha: float, n_parties: int, rng: np.random.Generator) -> np.ndarray:
    """Party importance shares ~ Dirichlet(alpha); ``alpha = inf`` gives equal shares."""
    if not alpha > 0:
        raise SplitterError(f"alpha must be positive (or inf), got {alpha}")
    if math.isinf(alpha):
        return np.full(n_parties, 1.0 / n_parties)
    shares = rng.dirichlet(np.full(n_parties, float(alpha)))
    return shares / shares.sum()


def assign_by_importance(importance: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """The party of every feature (see the module docstring, step 3); every party gets at least one feature."""
    imp = np.clip(np.asarray(importance, dtype=np.float64), 0.0, None)
    k = len(shares)
    if len(imp) < k:
        raise SplitterError(f"cannot give {k} parties at least one feature each out of {len(imp)} features")
    total = imp.sum()
    target = np.asarray(shares, dtype=np.float64) * (total if total > 0 else 1.0)
    owner = np.empty(len(imp), dtype=np.int64)
    load = np.zeros(k)
    order = np.argsort(-imp, kind="stable")
    informative = order[imp[order] > 0]
    for j in informative:
        p = int(np.argmax(target - load))
        owner[j] = p
        load[p] += imp[j]
    counts = np.bincount(owner[informative], minlength=k)
    for j in order[imp[order] <= 0]:  # zero-importance features even out the counts (fewest first)
        p = int(np.argmin(counts))
        owner[j] = p
        counts[p] += 1
    for p in np.flatnonzero(np.bincount(owner, minlength=k) == 0):  # a party with nothing takes a least-important
        donors = np.bincount(owner, minlength=k)  # feature from the party holding the most features
        rich = int(np.argmax(donors))
        candidates = [j for j in order[::-1] if owner[j] == rich]
        owner[candidates[0]] = p
    return owner


@dataclass(frozen=True)
class ImportanceSplitter:
    """``importance:alpha=A``: a data-dependent split; :meth:`fitted` makes the columns from training data."""

    alpha: float
    max_rows: int = 5000

    @property
    def name(self) -> str:
        """The canonical form, as :func:`~partialvfl.data.splitters.parse_splitter` reads it back."""
        return f"importance:alpha={'inf' if math.isinf(self.alpha) else f'{self.alpha:g}'}"

    @classmethod
    def parse(cls, text: str) -> ImportanceSplitter:
        """The splitter of ``importance:alpha=A`` (``A`` a number or ``inf``)."""
        m = re.fullmatch(r"importance:alpha=(inf|[0-9]*\.?[0-9]+(?:e-?[0-9]+)?)", text.strip().lower())
        if not m:
            raise SplitterError(f"importance split must look like 'importance:alpha=0.1' or 'importance:alpha=inf', "
                                f"got {text!r}")
        return cls(float(m.group(1)))

    def groups(self, sample_shape: Sequence[int], n_parties: int,
               feature_names: Sequence[str] | None = None) -> list[ColumnGroup]:
        """Refused: an importance split depends on the training data (the protocol fits it)."""
        raise SplitterError(f"{self.name} depends on the training data: the protocol fits it (fitted(X, y, ...))")

    def fitted(self, X: np.ndarray, y: np.ndarray, n_parties: int, seed: int,
               classification: bool = True) -> FittedImportanceSplit:
        """Score the features on ``(X, y)`` (training rows), draw the shares and assign the columns."""
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x1A9_0517]))
        flat = np.asarray(X, dtype=np.float64).reshape(len(X), -1)
        rows = np.sort(rng.choice(len(flat), size=min(self.max_rows, len(flat)), replace=False))
        state = int(rng.integers(2**31))
        importance = _importance(flat[rows], np.asarray(y)[rows], state, classification)
        shares = draw_shares(self.alpha, n_parties, rng)
        owner = assign_by_importance(importance, shares)
        return FittedImportanceSplit(self.name, owner, importance, shares)


@dataclass(frozen=True)
class FittedImportanceSplit:
    """The columns of an importance split, fitted on training data (a :class:`~.splitters.Splitter`)."""

    name: str
    owner: np.ndarray
    importance: np.ndarray
    target_shares: np.ndarray

    def groups(self, sample_shape: Sequence[int], n_parties: int,
               feature_names: Sequence[str] | None = None) -> list[ColumnGroup]:
        """The fitted columns of each party, checked against ``sample_shape`` and ``n_parties``."""
        d = int(np.prod(sample_shape))
        if d != len(self.owner) or n_parties != len(self.target_shares):
            raise SplitterError(f"this importance split was fitted for {len(self.owner)} features and "
                                f"{len(self.target_shares)} parties, not {d} and {n_parties}")
        return [ColumnGroup(cols, (len(cols),)) for cols in (np.flatnonzero(self.owner == k)
                                                              for k in range(n_parties))]

    def report(self) -> dict[str, Any]:
        """Target and realised importance shares and feature counts per party (for ``info["split"]``)."""
        k = len(self.target_shares)
        load = np.bincount(self.owner, weights=self.importance, minlength=k)
        total = load.sum()
        return {
            "splitter": self.name,
            "target_shares": [round(float(v), 6) for v in self.target_shares],
            "realised_shares": [round(float(v / total), 6) if total > 0 else 0.0 for v in load],
            "n_features": np.bincount(self.owner, minlength=k).astype(int).tolist(),
            "importance": "mutual information with the label on training rows",
        }


_SCORES: dict[str, np.ndarray] = {}  # importance scores by data digest: a grid rebuilds one protocol many times


def _importance(X: np.ndarray, y: np.ndarray, random_state: int, classification: bool) -> np.ndarray:
    """Mutual information of every column of ``X`` with ``y`` (cached: the same rows always score the same)."""
    key = hashlib.sha256(np.ascontiguousarray(X).tobytes() + np.ascontiguousarray(y).tobytes()
                         + f"{random_state}:{classification}".encode()).hexdigest()
    if key not in _SCORES:
        from sklearn.feature_selection import mutual_info_classif, mutual_info_regression

        score = mutual_info_classif if classification else mutual_info_regression
        if len(_SCORES) >= 8:
            _SCORES.pop(next(iter(_SCORES)))
        _SCORES[key] = np.clip(score(X, y, random_state=random_state), 0.0, None)
    return _SCORES[key]
