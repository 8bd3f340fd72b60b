"""Constants and data the test modules share (``from helpers import ...``: pytest puts tests/ on the path)."""

from __future__ import annotations

import numpy as np

from partialvfl import Task, VerticalDataset

# seconds: the deadline of every gRPC call and party wait whose timing is not under test. A loaded machine is slow
# and no test depends on its speed, so this is generous; a test that times something sets its own deadline.
PATIENCE = 300.0


def make_data(n: int, seed: int, prefix: str) -> VerticalDataset:
    """Three parties (widths 3, 4, 2), three classes; a fully observed core, then each block missing with p 0.3;
    one sample nobody holds; about half the labels (the core's first rows always labelled); party 1 holds them."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    blocks = [rng.normal(size=(n, d)) + 0.6 * y[:, None] for d in (3, 4, 2)]
    obs = rng.random((n, 3)) < 0.7
    obs[: n // 3] = True
    obs[-1] = False
    for k, b in enumerate(blocks):
        b[~obs[:, k]] = np.nan
    labeled = rng.random(n) < 0.5
    labeled[: n // 6] = True
    return VerticalDataset(blocks, obs, ids=[f"{prefix}{i:03d}" for i in range(n)], y=y, labeled=labeled,
                           task=Task.classification(["a", "b", "c"]), active_party=1,
                           party_names=["bank", "shop", "telco"])


def tiny_train() -> VerticalDataset:
    """The tiny fits' training data (test_contract, test_schedule, and conftest.py's ``tiny_deployment``)."""
    return make_data(48, seed=0, prefix="tr")


def tiny_test() -> VerticalDataset:
    """The tiny fits' test data (in each party's table of ``tiny_deployment`` beside its training rows)."""
    return make_data(24, seed=1, prefix="te")
