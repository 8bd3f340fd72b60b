"""Prediction over a federation whose parties may fail mid-prediction: each row is predicted from exactly the
parties that answered, and the caller learns which (``predict --federation`` and the prediction service)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from partialvfl.federation.transport import PartyUnavailable

__all__ = ["predict_reporting_parties"]


def predict_reporting_parties(model: Any, fed: Any, view: Any, handle: str, chunk: int | None = None
                              ) -> tuple[np.ndarray, np.ndarray]:
    """Predict ``view``'s rows (in chunks of ``chunk`` rows; default: all at once, exactly as the model's own
    ``predict_output_federated``); returns the outputs and which parties each row's prediction used.

    A party that fails while a chunk is predicted is treated as absent from then on: the chunk is predicted again
    without it, so every row's output comes from exactly the parties its row of the returned mask names.
    """
    n = view.n_samples
    used = np.array(view.observed, dtype=bool)
    lost: set[int] = set(fed.absent)
    out: np.ndarray | None = None
    size = max(1, chunk or n)
    for start in range(0, n, size):
        rows = np.arange(start, min(n, start + size))
        while True:
            observed = np.zeros_like(used)
            observed[rows] = used[rows]
            observed[:, sorted(lost)] = False
            before = len(fed.transport.failures)
            try:
                res = model.predict_output_federated(dataclasses.replace(view, observed=observed), handle)
            except PartyUnavailable as e:
                if e.party in lost:  # the method needs a party even when its blocks are missing: cannot go on
                    raise
                lost.add(e.party)
                continue
            failed = {party for _, party, _ in fed.transport.failures[before:]} - lost
            if failed:  # part of this chunk went without them: predict it again without them
                lost |= failed
                continue
            break
        used[rows] = observed[rows]
        out = res if out is None else out
        out[rows] = res[rows]
    fed.absent |= lost
    return (out if out is not None else model.predict_output_federated(view, handle)), used
