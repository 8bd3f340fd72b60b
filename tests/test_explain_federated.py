"""Explanations across real party processes (the own-data example's tables, one ``partialvfl party serve`` per
institution, the new customers in every party's prediction table ``new-users``, the deployed parties' default policy
but for a pinned seed and a wider ``max_width_ratio``):

* ``explain --federation`` gives, bit for bit, the explanation of the same model loaded in this process (its parties'
  saved states copied here, each party answering alone as a party server does) for the same customers, LASER-VFL and
  FALSE-VFL (its ``bound`` wire);
* each party charges an explanation's extra predictions of its rows to the coordinator's lookup ledger, exactly the
  count the coordinator announced, and the prediction service's ``POST /v1/explain`` answers what ``explain`` wrote;
* a party's daily lookup budget is not bypassed through explanations: past it, the party refuses (exit 3, naming the
  party and the rule) before anything is predicted, and its ledger never holds more than the budget.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from example_tables import PARTIES, table_paths, write_example
from helpers import PATIENCE
from partialvfl.cli import main
from partialvfl.data.builders import from_tables
from partialvfl.data.dataset import VerticalDataset
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.runtime.coordinator import LocalFederation
from partialvfl.methods import VFLMethod

pytestmark = pytest.mark.slow  # real party processes per module: the whole suite runs them, the fast tier not

KW = {"id_column": "customer_id", "label_column": "defaulted", "active_party": "bank"}
TABLE_SET = "new-users"
FITS = {"laser-vfl": ["--epochs", "2"], "false-vfl-1": ["--param", "pretrain_epochs=2", "--param", "epochs=1"]}
BUDGET = 1000  # the budget deployment's max_lookups_per_day


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_example(tmp_path_factory.mktemp("example"), seed=11, n_train=300, n_new=60)


def new_users(d: Path) -> VerticalDataset:
    return from_tables({"bank": d / "outcomes" / "bank.csv", "shop": d / "new" / "shop.csv",
                        "telco": d / "new" / "telco.csv"}, **KW)


def deploy(example: Path, directory: Path, **policy: object) -> LocalDeployment:
    return LocalDeployment(directory, from_tables(table_paths(example), **KW), predict={TABLE_SET: new_users(example)},
                           deadline=PATIENCE, start_timeout=600.0,
                           policy={"seed": 0, "max_width_ratio": 64, **policy})


@pytest.fixture(scope="module")
def deployment(example: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    with deploy(example, tmp_path_factory.mktemp("fed")) as dep:
        dep.start()
        yield dep


@pytest.fixture(scope="module")
def models(deployment: LocalDeployment, example: Path) -> dict[str, Path]:
    out = {}
    for method, flags in FITS.items():
        out[method] = example / f"{method}-model"
        assert main(["fit", "--federation", str(deployment.federation_file), "--method", method, "--seed", "0",
                     *flags, "--out", str(out[method]), "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def id_file(example: Path) -> Path:
    path = example / "ids.csv"
    pd.read_csv(example / "outcomes" / "defaulted.csv")[["customer_id"]].to_csv(path, index=False)
    return path


def explain_across(dep: LocalDeployment, model: Path, ids: Path, out: Path) -> int:
    return main(["explain", "--federation", str(dep.federation_file), "--model", str(model), "--table-set",
                 TABLE_SET, "--ids", str(ids), "--out", str(out), "--quiet"])


def in_process_copy(dep: LocalDeployment, model: Path, target: Path) -> VFLMethod:
    """The federated model loaded in this process: its parties' saved states copied from their state directories,
    every party answering alone (as a party server does, not as one stacked computation)."""
    shutil.copytree(model, target)
    rel = json.loads((model / "party_states.json").read_text())["party_dir"]
    for k, name in enumerate(PARTIES):
        shutil.copy(dep.dir / "state" / name / rel / f"party-{k}.pt", target / f"party-{k}.pt")
    (target / "party_states.json").unlink()
    return VFLMethod.load(target, federation=LocalFederation(PARTIES, 0, batched=False))


def as_deployed(data: VerticalDataset, order: list[str]) -> VerticalDataset:
    """``data``'s rows in ``order``, its columns named as the deployment's party tables name them."""
    sub = data.subset([list(map(str, data.ids)).index(i) for i in order])
    return VerticalDataset(list(sub.blocks), sub.observed, ids=sub.ids, active_party=0, party_names=sub.party_names,
                           feature_names=[[f"{p}:f{j}" for j in range(d)]
                                          for p, d in zip(sub.party_names, sub.feature_dims)])


def ledgers(dep: LocalDeployment) -> dict[str, int]:
    """Each party's lookups charged in total, over every coordinator identity."""
    out = {}
    for name in PARTIES:
        f = dep.dir / "state" / name / "lookup-ledger.json"
        book = json.loads(f.read_text())["coordinators"] if f.exists() else {}
        out[name] = sum(int(e["total"]) for e in book.values())
    return out


@pytest.mark.parametrize("method", list(FITS))
def test_a_federated_explanation_is_the_in_process_one_bit_for_bit(method: str, deployment: LocalDeployment,
                                                                  models: dict[str, Path], example: Path,
                                                                  id_file: Path, tmp_path: Path) -> None:
    if method.startswith("false-vfl"):  # the deployed default policy: FALSE-VFL runs its bound wire
        assert json.loads((models[method] / "model.json").read_text())["params"]["wire"] == "bound"
    assert explain_across(deployment, models[method], id_file, tmp_path / "fed.csv") == 0
    fed = pd.read_csv(tmp_path / "fed.csv", dtype={"customer_id": str}).set_index("customer_id")
    ids = [str(i) for i in pd.read_csv(id_file)["customer_id"]]
    local = in_process_copy(deployment, models[method], tmp_path / "local").explain(as_deployed(new_users(example),
                                                                                                 ids))
    frame = local.to_frame("customer_id").astype({"customer_id": str}).set_index("customer_id").loc[fed.index]
    numbers = [c for c in fed.columns if c.startswith(("probability", "log_odds"))]
    assert len(fed) == len(ids) and len(numbers) == 10
    assert np.array_equal(fed[numbers].to_numpy(float), frame[numbers].to_numpy(float)), \
        np.abs(fed[numbers].to_numpy(float) - frame[numbers].to_numpy(float)).max()
    assert (fed["parties"].fillna("") == frame["parties"].fillna("")).all()


def test_each_party_charges_what_was_announced_and_the_service_explains_alike(
        deployment: LocalDeployment, models: dict[str, Path], example: Path, id_file: Path, tmp_path: Path) -> None:
    before = ledgers(deployment)
    assert explain_across(deployment, models["laser-vfl"], id_file, tmp_path / "e.csv") == 0
    charged = {p: ledgers(deployment)[p] - before[p] for p in PARTIES}
    frame = pd.read_csv(tmp_path / "e.csv", dtype={"customer_id": str})
    held = np.array([[p in str(s).split(";") for p in PARTIES] for s in frame["parties"].fillna("")])
    # a keyed party also evaluated the IDs (psu_eval: one lookup each, at one of the two)
    extra = np.where(held.any(axis=1), 2 ** np.maximum(held.sum(axis=1) - 1, 0) - 1, 0)
    announced = {p: int(extra[held[:, k]].sum()) for k, p in enumerate(PARTIES)}
    assert charged["bank"] == announced["bank"]  # the unkeyed label holder: explanations only
    lookups = sum(charged[p] - announced[p] for p in ("shop", "telco"))
    assert min(charged[p] - announced[p] for p in ("shop", "telco")) >= 0 and lookups >= len(frame), (charged,
                                                                                                      announced)
    pytest.importorskip("fastapi")
    from partialvfl.serving.app import ServiceConfig, create_app
    from partialvfl.serving.federated import FederationPredictor
    from test_serving import Service

    service = Service(create_app(FederationPredictor(models["laser-vfl"], deployment.federation_file,
                                                     table_sets=[TABLE_SET]), ServiceConfig(deadline=PATIENCE)))
    try:
        ids = list(frame["customer_id"][:6])
        code, body = service.call("/v1/explain", {"ids": ids}, token=None)
        assert code == 200, body
        by_id = frame.set_index("customer_id")
        for r in body["results"]:
            got = r["probability"]
            assert got["value"] == by_id.loc[r["id"], "probability"]
            assert [got["contributions"][p] for p in PARTIES] == [by_id.loc[r["id"], f"probability_{p}"]
                                                                  for p in PARTIES]
    finally:
        service.stop()


def test_the_daily_lookup_budget_is_not_bypassed_through_explanations(example: Path, id_file: Path,
                                                                      tmp_path: Path) -> None:
    """One session, the new customers attached once (their ID lookups charged once), then explained again and
    again: each explanation charges every party its extra predictions, until a party's day is spent; then it
    refuses before anything is predicted, while a prediction of the same rows (no extra query) is still answered."""
    from partialvfl.federation.runtime.coordinator import ExplanationRefused
    from partialvfl.orchestration.explain import explain_across as explain_rows
    from partialvfl.orchestration.predict import predict_reporting_parties

    with deploy(example, tmp_path / "fed", max_lookups_per_day=BUDGET) as dep:
        dep.start()
        model_dir = tmp_path / "model"
        assert main(["fit", "--federation", str(dep.federation_file), "--method", "laser-vfl", "--seed", "0",
                     "--epochs", "1", "--out", str(model_dir), "--quiet"]) == 0
        fed = dep.federation(allow_absent=True)
        try:
            model = VFLMethod.load(model_dir, federation=fed)
            idx = model.index_
            ids = [str(i) for i in pd.read_csv(id_file)["customer_id"]]
            view, handle = fed.attach_ids(ids, task=idx.task, feature_dims=idx.feature_dims,
                                          feature_shapes=idx.feature_shapes, table=TABLE_SET)
            start = ledgers(dep)
            done = 0
            with pytest.raises(ExplanationRefused) as refused:
                for _ in range(20):  # 60 customers: each explanation costs each party 100-200 lookups
                    explanation = explain_rows(model, view, handle)
                    done += 1
            held = explanation.parties
            extra = np.where(held.any(axis=1), 2 ** np.maximum(held.sum(axis=1) - 1, 0) - 1, 0)
            per_explanation = {p: int(extra[held[:, k]].sum()) for k, p in enumerate(PARTIES)}
            after = ledgers(dep)
            assert done >= 1 and all(after[p] - start[p] == done * per_explanation[p] for p in PARTIES), \
                (done, start, after, per_explanation)  # the refused one charged nothing
            text = str(refused.value)
            assert "parties refused the explanation; nothing was predicted:" in text
            assert "policy rule 'max_lookups_per_day'" in text and f"more than its budget of {BUDGET:,}" in text
            assert max(after.values()) <= BUDGET
            refusing = [p for p in PARTIES if f"('{p}'): policy rule 'max_lookups_per_day'" in text]
            assert refusing and all(after[p] + per_explanation[p] > BUDGET for p in refusing)
            out, _ = predict_reporting_parties(model, fed, view, handle)  # a prediction: no extra query
            assert out.shape == (len(ids), 2)
        finally:
            fed.close()
