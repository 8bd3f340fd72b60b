"""Features missing *inside* an observed block (X-VFL's "partial" setting), as a property of the data.

:func:`with_within_block_missing` zero-fills the lost features of the flagged blocks (every method sees the same
data) and records in ``info["within_block_missing"]`` which party holds an incomplete block for which ID; which
features are lost is fixed by :func:`within_block_mask`, seeded per (seed, party, ID), so a party recomputes its own
mask locally.  :func:`x_vfl_partial_setting` is X-VFL's experimental setting (Yao, Xu & Li, 2025, Sec. 2.2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from partialvfl.data.dataset import DataValidationError, VerticalDataset
from partialvfl.utils.seeding import numpy_rng

__all__ = [
    "INFO_KEY",
    "incomplete_matrix",
    "setting_of",
    "wire_setting",
    "with_within_block_missing",
    "within_block_mask",
    "x_vfl_partial_setting",
]

#: Where :func:`with_within_block_missing` records the partial setting in ``VerticalDataset.info``.
INFO_KEY = "within_block_missing"


def _plain(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


def within_block_mask(ids: Sequence[Any] | np.ndarray, party: int, n_features: int, rate: float,
                      seed: int) -> np.ndarray:
    """Which features of party ``party``'s block survive, ``(len(ids), n_features)`` boolean (True = present).

    For every ID exactly ``round(rate * n_features)`` features are lost, chosen by a generator seeded by
    (``seed``, party, ID): the same sample loses the same features in any dataset and at any party that computes it.
    """
    if not 0.0 <= float(rate) <= 1.0:
        raise ValueError(f"feature_missing_rate must lie in [0, 1], got {rate}")
    ids = np.asarray(ids)
    out = np.ones((len(ids), int(n_features)), dtype=bool)
    n_lost = int(round(float(rate) * n_features))
    if n_lost == 0:
        return out
    for r, i in enumerate(ids):
        rng = numpy_rng(seed, "within-block", int(party), _plain(i))
        out[r, rng.choice(n_features, size=n_lost, replace=False)] = False
    return out


def with_within_block_missing(data: VerticalDataset, incomplete: np.ndarray, feature_missing_rate: float,
                              seed: int = 0) -> VerticalDataset:
    """X-VFL's partial setting: the blocks flagged in ``incomplete`` (N x K) lose ``feature_missing_rate`` of their
    features.

    Rate 1 removes those blocks whole (``observed`` becomes False: the fully missing case).  Rate 0 changes nothing.
    Otherwise the blocks stay observed, the lost features (:func:`within_block_mask`) are set to 0 (the standardised
    mean, so every method sees the same zero-filled data), and ``info["within_block_missing"]`` records the rate, the
    seed and, per party, the IDs whose block is incomplete (what X-VFL needs to complete exactly those features).
    """
    incomplete = np.asarray(incomplete, dtype=bool)
    if incomplete.shape != data.observed.shape:
        raise DataValidationError(
            f"incomplete must have shape {data.observed.shape} (samples x parties), got {incomplete.shape}"
        )
    bad = incomplete & ~data.observed
    if bad.any():
        i, k = np.argwhere(bad)[0]
        raise DataValidationError(
            f"party {k} ({data.party_names[k]!r}) does not hold ID {_plain(data.ids[i])!r}, so its block cannot be "
            "partially missing"
        )
    rate = float(feature_missing_rate)
    if not 0.0 <= rate <= 1.0:
        raise DataValidationError(f"feature_missing_rate must lie in [0, 1], got {feature_missing_rate}")
    if rate == 0.0 or not incomplete.any():
        return data
    if rate == 1.0:
        return data.with_observed(data.observed & ~incomplete)
    blocks = []
    for k, b in enumerate(data.blocks):
        nb = np.array(b, copy=True)
        rows = np.flatnonzero(incomplete[:, k])
        if rows.size:
            keep = within_block_mask(data.ids[rows], k, b.shape[1], rate, seed)
            nb[rows] = np.where(keep, nb[rows], 0.0)
        blocks.append(nb)
    info = dict(data.info)
    info[INFO_KEY] = {
        "rate": rate,
        "seed": int(seed),
        "incomplete_ids": [[_plain(v) for v in data.ids[incomplete[:, k]]] for k in range(data.n_parties)],
    }
    return VerticalDataset(
        blocks=blocks, observed=data.observed, ids=data.ids, y=data.y, labeled=data.labeled, task=data.task,
        active_party=data.active_party, feature_names=data.feature_names, party_names=data.party_names,
        feature_shapes=data.feature_shapes, name=data.name, info=info,
    )


def x_vfl_partial_setting(data: VerticalDataset, feature_missing_rate: float, seed: int = 0,
                          aligned_ids: Sequence[Any] | np.ndarray | None = None) -> VerticalDataset:
    """X-VFL's experimental setting on ``data``: its non-aligned samples lose ``feature_missing_rate`` of the
    features of some of their blocks (seeded).

    Aligned samples are the IDs in ``aligned_ids`` (default: ``data.info["aligned_ids"]``, the protocol's aligned
    reserve, or none).  Every other sample that all parties observe is non-aligned: with 2 parties one of them (drawn
    at random) holds an incomplete block, as in the paper; with K > 2 a uniformly drawn number 1..K-1 of them.  Then
    :func:`with_within_block_missing` applies the rate (1 removes those blocks whole).
    """
    if aligned_ids is None:
        aligned_ids = data.info.get("aligned_ids", [])
    k = data.n_parties
    if k < 2:
        raise DataValidationError("X-VFL's partial setting needs at least 2 parties")
    non_aligned = data.observed.all(axis=1) & ~np.isin(data.ids, np.asarray(list(aligned_ids)))
    rng = numpy_rng(seed, "x-vfl-partial-setting", k)
    incomplete = np.zeros(data.observed.shape, dtype=bool)
    for i in np.flatnonzero(non_aligned):
        c = 1 if k == 2 else int(rng.integers(1, k))
        incomplete[i, rng.choice(k, size=c, replace=False)] = True
    return with_within_block_missing(data, incomplete, feature_missing_rate, seed)


def setting_of(info: dict[str, Any] | None) -> dict[str, Any] | None:
    """The partial setting recorded in a dataset's ``info`` (``None`` when there is none or its rate is 0)."""
    s = (info or {}).get(INFO_KEY)
    if not s or float(s.get("rate", 0.0)) <= 0.0:
        return None
    return s


def incomplete_matrix(ids: np.ndarray, n_parties: int, info: dict[str, Any] | None) -> np.ndarray:
    """(N, K) flags: party k holds sample i's block but with features missing inside it (from ``info``)."""
    out = np.zeros((len(ids), n_parties), dtype=bool)
    s = setting_of(info)
    if s is None:
        return out
    lists = s["incomplete_ids"]
    if len(lists) != n_parties:
        raise DataValidationError(f"the partial setting lists {len(lists)} parties, the data has {n_parties}")
    for k in range(n_parties):
        if lists[k]:
            out[:, k] = np.isin(ids, np.asarray(lists[k]))
    return out


def wire_setting(s: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a party needs to recompute its own masks: the rate and the seed (never another party's IDs)."""
    return None if s is None else {"rate": float(s["rate"]), "seed": int(s["seed"])}
