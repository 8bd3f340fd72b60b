"""Shapley values of K players from the values of their coalitions: exactly (all 2^K coalitions) or by permutation
sampling (a stated standard error).  Pure numpy; :mod:`partialvfl.methods.explain` plays it with a model's parties.

A coalition is a bit mask: party ``k`` is in coalition ``m`` when bit ``k`` of ``m`` is set.  ``values`` holds one
number per coalition and per item (a row, or a bootstrap resample): ``(2^K, N)`` exactly, or the values of the
coalitions a permutation sample visits.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import factorial

import numpy as np

__all__ = ["PermutationSample", "coalition_masks", "exact_shapley", "mask_bits", "permutation_sample",
           "shapley_weights"]


def coalition_masks(n_players: int) -> np.ndarray:
    """``(2^K, K)`` booleans: row ``m`` is coalition ``m`` (party ``k`` in it when bit ``k`` of ``m`` is set)."""
    m = np.arange(2 ** n_players, dtype=np.int64)
    return ((m[:, None] >> np.arange(n_players)) & 1).astype(bool)


def mask_bits(masks: np.ndarray) -> np.ndarray:
    """The coalition number (bit mask) of each ``(…, K)`` boolean row."""
    masks = np.asarray(masks, dtype=bool)
    return (masks.astype(np.int64) << np.arange(masks.shape[-1], dtype=np.int64)).sum(axis=-1)


def shapley_weights(n_players: int) -> np.ndarray:
    """``w[s] = s! (K - s - 1)! / K!``: the weight of a coalition of size ``s`` without the player (s = 0..K-1)."""
    k = n_players
    return np.array([factorial(s) * factorial(k - s - 1) / factorial(k) for s in range(k)], dtype=np.float64)


def exact_shapley(values: np.ndarray) -> np.ndarray:
    """Each player's exact Shapley value ``(N, K)`` from ``values`` ``(2^K, N)`` (coalition ``m`` in row ``m``).

    phi_k = sum over coalitions S without k of w(|S|) (v(S + k) - v(S)); they sum to v(all) - v(none) (efficiency).
    Summed coalition by coalition in one order for every item: an item's value never depends on its place among the
    others (a matrix product's kernel may round a column by its position)."""
    values = np.asarray(values, dtype=np.float64)
    n_coalitions = values.shape[0]
    k = int(round(np.log2(n_coalitions)))
    if 2 ** k != n_coalitions:
        raise ValueError(f"exact Shapley values need 2^K coalition values, got {n_coalitions}")
    masks = coalition_masks(k)
    sizes = masks.sum(axis=1)
    weights = shapley_weights(k) if k else np.zeros(0)
    out = np.zeros((values.shape[1], k))
    index = np.arange(n_coalitions)
    for player in range(k):
        total = np.zeros(values.shape[1])
        for s in index[~masks[:, player]]:
            total += weights[sizes[s]] * (values[s | (1 << player)] - values[s])
        out[:, player] = total
    return out


@dataclass(frozen=True)
class PermutationSample:
    """Permutations of K players and the coalitions they visit.

    ``orders``: ``(P, K)``, each row a permutation; ``coalitions``: ``(P, K + 1)``, the bit mask of the first ``j``
    players of each permutation (``j`` = 0..K)."""

    orders: np.ndarray
    coalitions: np.ndarray

    @property
    def n_permutations(self) -> int:
        """The number of party orders sampled."""
        return int(self.orders.shape[0])

    def shapley(self, value_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The estimate and its standard error, each ``(N, K)``, from ``value_of`` ``(P, K + 1, N)``: the value of
        each permutation's prefix coalitions per item.  Each permutation's marginal contributions sum to
        v(all) - v(none), so the estimate keeps the efficiency identity; the standard error is the sample standard
        deviation of a player's marginal contributions over the permutations, divided by sqrt(P)."""
        value_of = np.asarray(value_of, dtype=np.float64)
        p, k = self.orders.shape
        marginal = np.diff(value_of, axis=1)  # (P, K, N): the j-th player's contribution in each permutation
        per_player = np.zeros((p, k, value_of.shape[2]))
        rows = np.arange(p)[:, None]
        per_player[rows, self.orders] = marginal
        estimate = per_player.mean(axis=0).T
        error = (per_player.std(axis=0, ddof=1) / np.sqrt(p)).T if p > 1 else np.full_like(estimate, np.nan)
        return estimate, error


def permutation_sample(n_players: int, n_permutations: int, rng: np.random.Generator) -> PermutationSample:
    """``n_permutations`` independent uniform random orders of the players and their prefix coalitions."""
    if n_permutations < 2:
        raise ValueError(f"a permutation estimate needs at least 2 permutations (for its standard error), got "
                         f"{n_permutations}")
    orders = np.stack([rng.permutation(n_players) for _ in range(n_permutations)]).astype(np.int64)
    bits = np.zeros((n_permutations, n_players + 1), dtype=np.int64)
    bits[:, 1:] = np.cumsum(np.int64(1) << orders, axis=1)
    return PermutationSample(orders, bits)
