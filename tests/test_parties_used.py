"""Every method reports the parties each prediction used (issue 21, item 3): the prediction file's ``parties``
column comes from :meth:`~partialvfl.methods.base.VFLMethod.parties_used`, and this checks it against what the
predictions do.  Changing a party's features (heavily, in every row it holds) must change no prediction whose
report leaves that party out, and must change some prediction that names it."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from helpers import make_data
from partialvfl.methods.base import get_method
from test_contract import METHODS, tiny

#: the methods, plus variants whose report differs from "every party that holds the row"
CASES: list[tuple[str, dict[str, Any]]] = [(m, {}) for m in METHODS] + [("vanilla-vfl", {"missing": "random"}),
                                                                        ("x-vfl", {"inference": "available"})]


@pytest.fixture(scope="module")
def data() -> tuple[Any, Any]:
    return make_data(48, seed=0, prefix="tr"), make_data(30, seed=1, prefix="te")


def _changed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    diff = np.abs(a - b)
    return (diff.max(axis=1) if diff.ndim == 2 else diff) > 1e-7


@pytest.mark.parametrize(("name", "extra"), CASES, ids=[f"{m}{'-' + '-'.join(e.values()) if e else ''}"
                                                        for m, e in CASES])
def test_a_prediction_names_exactly_the_parties_whose_features_it_used(name: str, extra: dict[str, Any],
                                                                        data: tuple[Any, Any]) -> None:
    train, test = data
    model = get_method(name)("fast", seed=3, **{**tiny(name), **extra}).fit(train)
    used = model.parties_used(test)
    assert used.shape == test.observed.shape and not (used & ~test.observed).any()  # never a party that lacks it
    assert not used[~test.observed.any(axis=1)].any()
    base = model.predict_output(test)
    rng = np.random.default_rng(0)
    for k in range(test.n_parties):
        blocks = [np.array(b, copy=True) for b in test.blocks]
        rows = test.observed[:, k]
        blocks[k][rows] = rng.normal(3.0, 5.0, size=blocks[k][rows].shape)
        changed = _changed(model.predict_output(dataclasses.replace(test, blocks=blocks)), base)
        assert not changed[~used[:, k]].any(), f"party {k}: a prediction that does not name it changed"
        if used[:, k].any():
            assert changed[used[:, k]].any(), f"party {k}: named by {int(used[:, k].sum())} predictions, changes none"
    if name == "local":  # the label holder alone; rows it does not hold use no party
        assert used[:, test.active_party].tolist() == test.observed[:, test.active_party].tolist()
        assert used.sum(axis=1).max() == 1 and (~used.any(axis=1)).sum() > 1
