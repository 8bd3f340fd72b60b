"""One answer per customer (issue 34, item 2), in process: a row's prediction depends only on the model, the row's
data and its ID, never on the other rows of its request, their order or their number.

FALSE-VFL drew a batch's importance samples from one seed per batch, so a customer's score moved with whoever else
was in the request (the own-data example's 400 new users in three orders: 24 and 26 classes differed, probabilities
up to 0.35 apart; one request per user: 29).  Each row's samples now come from the model's seed and the row's ID, and
its floats are computed row by row (``partialvfl.methods.false_vfl.rowwise``), so every wire (lean, samples, bound:
whose draws hash the exact bytes of a row's posterior) gives the same floats in any request: asserted bit for bit.
Ensemble's tie-breaks and Vanilla VFL's random guesses (``missing='random'``) were drawn for the batch too.

The other methods draw nothing at prediction; their floats move in the last bits with the batch because a matrix
product of a few rows runs another kernel than one of many (fewer than 4 rows on an AVX2 CPU, issue 33) and a sum
over a leading axis vectorises across the rows: a tolerance of :data:`ULPS` float32 ulps of 1 for them, every class
equal away from a tie.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from example_tables import PARTIES, table_paths, write_example
from partialvfl.data.builders import from_tables
from partialvfl.methods import get_method, method_names

KW = {"id_column": "customer_id", "label_column": "defaulted", "active_party": "bank"}
SHORT = {"pretrain_epochs": 2, "epochs": 1}
#: every method, FALSE-VFL under each wire protocol; value: (method, parameters, bitwise in any request)
MODELS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "false-vfl-1": ("false-vfl-1", SHORT, True),
    "false-vfl-1 bound": ("false-vfl-1", {**SHORT, "wire": "bound", "latent_scale_floor": 0.05}, True),
    "false-vfl-2": ("false-vfl-2", SHORT, True),
    "false-vfl-2 samples": ("false-vfl-2", {**SHORT, "wire": "samples"}, True),
    "false-vfl-2 bound": ("false-vfl-2", {**SHORT, "wire": "bound", "latent_scale_floor": 0.05}, True),
    "ensemble": ("ensemble", {"epochs": 2}, False),
    "vanilla-vfl random": ("vanilla-vfl", {"epochs": 2, "missing": "random"}, False),
    "laser-vfl": ("laser-vfl", {"epochs": 2}, False),
    "combinatorial": ("combinatorial", {"epochs": 2}, False),
    "plug-vfl": ("plug-vfl", {"epochs": 2}, False),
    "local": ("local", {"epochs": 2}, False),
    "x-vfl": ("x-vfl", {"epochs": 2}, False),
    "fedhssl": ("fedhssl", {"pretrain_epochs": 1, "epochs": 1}, False),
}
#: float32 ulps of 1 that a probability of a method without random draws may move by with its batch (see above)
ULPS = 4
TOLERANCE = ULPS * float(np.finfo(np.float32).eps)


def test_every_method_is_checked() -> None:
    # the package's methods (other test modules register toy methods in the same process)
    package = {n for n in method_names() if get_method(n).__module__.startswith("partialvfl.")}
    assert {m for m, _, _ in MODELS.values()} == package


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_example(tmp_path_factory.mktemp("example"), seed=3, n_train=300, n_new=60)


@pytest.fixture(scope="module")
def new(example: Path) -> Any:
    return from_tables(table_paths(example, "new"), id_column="customer_id",
                       active_party="bank")


@pytest.fixture(scope="module")
def fitted(example: Path) -> Iterator[dict[str, Any]]:
    train = from_tables(table_paths(example), **KW)
    yield {key: get_method(name)("fast", seed=0, **params).fit(train) for key, (name, params, _) in MODELS.items()}


@st.composite
def requests(draw: st.DrawFn, n: int) -> list[list[int]]:
    """The new users' rows as some requests would bring them: any of them, a row possibly twice (in one request or
    in two), in any order, padded with any others, cut into requests anywhere (one row each included)."""
    rows = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2 * n))
    cuts = sorted(set(draw(st.lists(st.integers(1, len(rows)), max_size=6))))
    return [part for part in np.split(np.asarray(rows), cuts) if len(part)]


def answers(model: Any, new: Any, request: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The request's distinct rows (a row asked twice is answered once) and their probabilities."""
    rows = np.array(list(dict.fromkeys(int(r) for r in request)))
    return rows, model.predict_proba(new.subset(rows))


@pytest.mark.float_sensitive
@pytest.mark.parametrize("key", list(MODELS))
def test_a_rows_answer_does_not_depend_on_its_request(key: str, fitted: dict[str, Any], new: Any) -> None:
    model, bitwise = fitted[key], MODELS[key][2]
    whole = model.predict_proba(new)  # every new user in one request

    @settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(requests(new.n_samples))
    def check(parts: list[list[int]]) -> None:
        for part in parts:
            rows, got = answers(model, new, part)
            if bitwise:
                assert np.array_equal(got, whole[rows]), np.abs(got - whole[rows]).max()
            else:
                np.testing.assert_allclose(got, whole[rows], rtol=0, atol=TOLERANCE)

    check()
    alone = np.concatenate([answers(model, new, [r])[1] for r in range(new.n_samples)])  # one request per user
    if bitwise:
        assert np.array_equal(alone, whole)
    else:
        np.testing.assert_allclose(alone, whole, rtol=0, atol=TOLERANCE)


@pytest.mark.float_sensitive
@pytest.mark.parametrize("key", ["false-vfl-2 bound", "ensemble"])
def test_the_service_answers_what_predict_and_evaluate_do(key: str, fitted: dict[str, Any], new: Any,
                                                         example: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """``predict --table``, ``evaluate --truth`` and the in-process service, one model: the same answer for every
    user, whatever the request (several at once: the service batches them together)."""
    pytest.importorskip("fastapi")
    from concurrent.futures import ThreadPoolExecutor

    import pandas as pd

    from partialvfl.cli import main
    from partialvfl.serving.app import ServiceConfig, create_app
    from partialvfl.serving.predictors import TablePredictor
    from test_serving import Service

    model_dir = fitted[key].save(tmp_path / "model")
    tables = [a for p in PARTIES for a in ("--table", f"{p}={example / 'new' / f'{p}.csv'}")]
    assert main(["predict", "--model", str(model_dir), *tables, "--out", str(tmp_path / "pred.csv")]) == 0
    pred = pd.read_csv(tmp_path / "pred.csv").set_index("customer_id")
    truth = example / "outcomes" / "defaulted.csv"
    capsys.readouterr()
    assert main(["evaluate", "--model", str(model_dir), *tables, "--truth", str(truth), "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    outcome = pd.read_csv(truth).set_index("customer_id")["defaulted"]
    assert scored["accuracy"] == float((pred["prediction"] == outcome.loc[pred.index]).mean())
    whole = dict(zip(map(str, new.ids), fitted[key].predict_proba(new)))
    for i, row in pred.iterrows():
        assert np.array_equal(row[["p_0", "p_1"]].to_numpy(dtype=float), whole[str(i)]), i
    service = Service(create_app(TablePredictor(model_dir, table_paths(example, "new")), ServiceConfig()))
    try:
        ids = list(whole)
        rng = np.random.default_rng(0)
        some = [list(rng.choice(ids, 6, replace=False)) for _ in range(8)]
        requests = [ids, ids[::-1], [ids[3]], [ids[5], ids[8]], [ids[8]], *some, *some[:3]]  # some asked twice
        with ThreadPoolExecutor(6) as pool:  # requests queued together are answered as one batch
            bodies = list(pool.map(lambda r: service.call("/v1/predict", {"ids": r}, token=None), requests))
        for code, body in bodies:
            assert code == 200, body
            for r in body["results"]:
                got = np.array([r["probabilities"]["0"], r["probabilities"]["1"]])
                if MODELS[key][2]:
                    assert np.array_equal(got, whole[str(r["id"])]), r["id"]
                else:
                    np.testing.assert_allclose(got, whole[str(r["id"])], rtol=0, atol=TOLERANCE)
    finally:
        service.stop()
