"""Issue 34, items 2-4, across real party processes (the own-data example's tables, one ``partialvfl party serve``
per institution, the new customers in every party's prediction table ``new-users``, the deployed parties' default
policy but for a pinned seed and a wider ``max_width_ratio``, so FALSE-VFL runs its ``bound`` wire):

* item 2: a customer's FALSE-VFL answer is the same floats whatever else is in the request (``predict
  --federation`` in any order, cut anywhere, padded with others) and ``predict``, ``evaluate`` and the service
  agree on every answer.  Before, the importance samples were drawn with one seed per batch: another order gave
  other probabilities;
* item 3: ``fit --table ... --order-of MODEL`` takes the federated fit's party order whatever order the ``--table``
  flags come in (before: the flags' order, another model without a word) and refuses tables of other parties or
  another label holder, naming the fit's;
* item 4: ``evaluate --federation --truth`` follows the in-process rule: users of the tables without an outcome,
  and outcomes of no user, are refused with their counts (before: the outcomes given were scored, a silent subset).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from example_tables import PARTIES, table_paths, write_example
from helpers import PATIENCE
from partialvfl.cli import main
from partialvfl.data.builders import from_tables
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.methods import VFLMethod
from partialvfl.orchestration.predict import PredictOptions, run_predict

pytestmark = pytest.mark.slow  # real party processes per module: the whole suite runs them, the fast tier not

KW = {"id_column": "customer_id", "label_column": "defaulted", "active_party": "bank"}
TABLE_SET = "new-users"


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_example(tmp_path_factory.mktemp("example"), seed=11, n_train=300, n_new=60)


def train_tables(d: Path) -> dict[str, Path]:
    return table_paths(d)


@pytest.fixture(scope="module")
def deployment(example: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    train = from_tables(train_tables(example), **KW)  # raw features: each party standardises its own
    # the new customers, every party's table of them (the bank's with their outcomes: the label it does not serve)
    new = from_tables({"bank": example / "outcomes" / "bank.csv", "shop": example / "new" / "shop.csv",
                       "telco": example / "new" / "telco.csv"}, **KW)
    with LocalDeployment(tmp_path_factory.mktemp("fed"), train, predict={TABLE_SET: new}, deadline=PATIENCE,
                         start_timeout=600.0, policy={"seed": 0, "max_width_ratio": 64}) as dep:
        dep.start()
        yield dep


def new_ids(d: Path) -> list[str]:
    """Every new customer some party holds (the outcomes file lists exactly them)."""
    return [str(i) for i in pd.read_csv(d / "outcomes" / "defaulted.csv")["customer_id"]]


@pytest.fixture(scope="module")
def false_vfl(deployment: LocalDeployment, example: Path) -> Path:
    out = example / "false-vfl-model"
    assert main(["fit", "--federation", str(deployment.federation_file), "--method", "false-vfl-2", "--seed", "0",
                 "--param", "pretrain_epochs=2", "--param", "epochs=1", "--out", str(out), "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def laser(deployment: LocalDeployment, example: Path) -> Path:
    out = example / "laser-model"
    assert main(["fit", "--federation", str(deployment.federation_file), "--method", "laser-vfl", "--seed", "0",
                 "--epochs", "2", "--out", str(out), "--quiet"]) == 0
    return out


def predicted(deployment: LocalDeployment, model_dir: Path, requests: list[list[str]], table: str | None = TABLE_SET,
              chunk: int | None = None) -> dict[str, np.ndarray]:
    """Every request's answers across the federation (``run_predict``, as ``predict --federation`` runs it), by ID;
    an ID asked twice must get the same answer both times."""
    fed = deployment.federation(allow_absent=True)
    try:
        model = VFLMethod.load(model_dir, federation=fed)
        out: dict[str, np.ndarray] = {}
        for ids in requests:
            pred = run_predict(model, ids, PredictOptions(table_set=table, chunk=chunk))
            for i, p in zip(pred.ids, pred.output):
                assert str(i) not in out or np.array_equal(out[str(i)], p), i
                out[str(i)] = p
        return out
    finally:
        fed.close()


# ---------------------------------------------------------------------- item 2: one answer per customer
def test_false_vfl_answers_do_not_depend_on_the_request_across_the_federation(deployment: LocalDeployment,
                                                                            false_vfl: Path, example: Path) -> None:
    assert json.loads((false_vfl / "model.json").read_text())["params"]["wire"] == "bound"  # the deployed wire
    ids = new_ids(example)
    whole = predicted(deployment, false_vfl, [ids])
    rng = np.random.default_rng(0)
    shuffled = list(rng.permutation(ids))
    padded = [[i, *rng.choice(ids, 7, replace=False).tolist()] for i in ids[:3]]  # a user among others
    for requests, chunk in (([shuffled], None), ([ids[::-1]], 7), ([[i] for i in ids[:12]], None),
                            (padded, 3), ([shuffled[:20], shuffled[10:45]], 4)):
        got = predicted(deployment, false_vfl, requests, chunk=chunk)
        for i, p in got.items():
            assert np.array_equal(p, whole[i]), (i, np.abs(p - whole[i]).max())


def test_predict_evaluate_and_the_service_agree_on_every_answer(deployment: LocalDeployment, false_vfl: Path,
                                                              example: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("fastapi")
    from partialvfl.serving.app import ServiceConfig, create_app
    from partialvfl.serving.federated import FederationPredictor
    from test_serving import Service

    fed_file, truth = str(deployment.federation_file), example / "outcomes" / "defaulted.csv"
    pd.DataFrame({"customer_id": new_ids(example)[::-1]}).to_csv(tmp_path / "ids.csv", index=False)
    assert main(["predict", "--federation", fed_file, "--model", str(false_vfl), "--table-set", TABLE_SET,
                 "--ids", str(tmp_path / "ids.csv"), "--id-column", "customer_id", "--out",
                 str(tmp_path / "pred.csv")]) == 0
    capsys.readouterr()
    assert main(["evaluate", "--federation", fed_file, "--model", str(false_vfl), "--table-set", TABLE_SET,
                 "--truth", str(truth), "--id-column", "customer_id", "--label", "defaulted", "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    pred = pd.read_csv(tmp_path / "pred.csv").set_index("customer_id")
    outcome = pd.read_csv(truth).set_index("customer_id")["defaulted"]
    assert scored["n_samples"] == len(pred)
    assert scored["accuracy"] == pytest.approx(float((pred["prediction"] == outcome.loc[pred.index]).mean()), abs=0)
    whole = predicted(deployment, false_vfl, [new_ids(example)])
    for i, row in pred.iterrows():
        assert np.array_equal(row[["p_0", "p_1"]].to_numpy(dtype=float), whole[str(i)]), i
    # the service answers the training tables' users (serving a table set is issue 34's item 1): its answers are
    # the offline path's, request by request and batch by batch
    users = [str(i) for i in pd.read_csv(example / "train" / "bank.csv")["customer_id"].head(24)]
    offline = predicted(deployment, false_vfl, [users], table=None)
    predictor = FederationPredictor(false_vfl, deployment.federation_file)
    service = Service(create_app(predictor, ServiceConfig(deadline=PATIENCE)))
    try:
        for request in (users, users[::-1], users[5:9], users[:1], users[5:9], users[3:6]):  # one asked twice
            code, body = service.call("/v1/predict", {"ids": request}, token=None)
            assert code == 200, body
            for r in body["results"]:
                got = np.array([r["probabilities"]["0"], r["probabilities"]["1"]])
                assert np.array_equal(got, offline[str(r["id"])]), (r["id"], got, offline[str(r["id"])])
    finally:
        service.stop()  # closes the predictor (its session at the parties)


# ---------------------------------------------------------------------- item 3: party order
def test_fit_order_of_takes_the_federated_fits_party_order(deployment: LocalDeployment, laser: Path, example: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    keyed = example / "keyed-laser"
    flags = [a for p in ("shop", "bank", "telco") for a in ("--table", f"{p}={example / 'train' / f'{p}.csv'}")]
    assert main(["fit", *flags, "--id-column", "customer_id", "--label", "defaulted", "--active", "bank", "--method",
                 "laser-vfl", "--seed", "0", "--epochs", "2", "--order-of", str(laser), "--alignment-key",
                 str(deployment.alignment_key_file), "--threads", "1", "--out", str(keyed), "--quiet"]) == 0
    assert ("note: parties in the federated fit's order (--order-of): bank, shop, telco (the --table flags named "
            "shop, bank, telco)") in capsys.readouterr().err
    local = VFLMethod.load(keyed)
    assert local.index_.party_names == ("bank", "shop", "telco")
    data = from_tables(table_paths(example, parties=("telco", "shop", "bank")), **KW)
    p_local = local.predict_proba(data)
    fed = predicted(deployment, laser, [[str(i) for i in data.ids]], table=None)
    p_fed = np.stack([fed[str(i)] for i in data.ids])
    # in process, LASER-VFL's equal parties answer a round as one stacked computation: the last digits may differ
    assert (p_fed.argmax(1) == p_local.argmax(1)).all()
    assert np.abs(p_fed - p_local).max() <= 1e-6, np.abs(p_fed - p_local).max()


def test_fit_order_of_refuses_other_parties_or_another_label_holder(laser: Path, example: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    def fit(parties: tuple[str, ...], active: str) -> str:
        flags = [a for p in parties for a in ("--table", f"{p}={example / 'train' / f'{p}.csv'}")]
        assert main(["fit", *flags, "--id-column", "customer_id", "--label", "defaulted", "--active", active,
                     "--method",
                     "laser-vfl", "--order-of", str(laser), "--alignment-key", str(example / "none.key"), "--out",
                     str(example / "refused"), "--quiet"]) == 2
        return capsys.readouterr().err.strip()

    assert fit(("bank", "shop"), "bank") == (
        f"error: --order-of {laser}: the federated fit's parties are ['bank', 'shop', 'telco'], in that order; the "
        "--table flags name ['bank', 'shop']")
    assert fit(("telco", "shop", "bank"), "shop").startswith(
        f"error: --order-of {laser}: the federated fit's label holder is 'bank', not --active 'shop'")


# ---------------------------------------------------------------------- item 4: one rule for evaluate --truth
def evaluate(deployment: LocalDeployment, model: Path, truth: Path, *extra: str) -> int:
    return main(["evaluate", "--federation", str(deployment.federation_file), "--model", str(model), "--table-set",
                 TABLE_SET, "--truth", str(truth), "--id-column", "customer_id", "--label", "defaulted", *extra])


def test_federated_evaluate_refuses_users_without_an_outcome(deployment: LocalDeployment, laser: Path,
                                                             example: Path, capsys: pytest.CaptureFixture) -> None:
    bank_only = example / "outcomes" / "bank.csv"  # the bank's new customers: the shop's and telco's others lack one
    assert evaluate(deployment, laser, bank_only) == 2
    err = capsys.readouterr().err.strip()
    held = {p: set(pd.read_csv(example / "new" / f"{p}.csv")["customer_id"]) for p in PARTIES}
    users = set().union(*held.values())
    lacking = users - held["bank"]
    per_party = ", ".join(f"{p!r} holds {len(held[p] & lacking)}" for p in ("shop", "telco"))
    assert err == (f"error: {len(lacking)} of {len(users)} users of the parties' prediction tables '{TABLE_SET}' "
                   f"have no outcome in --truth {bank_only} ({per_party}; the coordinator sees other parties' users "
                   "only as alignment tokens, so it cannot name them); give an outcome for every user (an empty cell "
                   "is not scored) or score a table set of only the users to score (--table-set)")


def test_federated_evaluate_refuses_outcomes_of_no_user(deployment: LocalDeployment, laser: Path, example: Path,
                                                        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    outcomes = pd.read_csv(example / "outcomes" / "defaulted.csv")
    extra = pd.concat([outcomes, pd.DataFrame({"customer_id": [5, 6], "defaulted": [0, 1]})])
    extra.to_csv(tmp_path / "extra.csv", index=False)
    for allow in ((), ("--allow-prior-only",)):  # an outcome of no user is no user to predict from the prior
        assert evaluate(deployment, laser, tmp_path / "extra.csv", *allow) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: 2 of {len(extra)} IDs of --truth {tmp_path / 'extra.csv'} are not among the users of the "
            f"parties' prediction tables '{TABLE_SET}' (first: ['5', '6']); check that both use the same IDs "
            "(--id-column COLUMN)")


def test_federated_evaluate_scores_every_user_of_the_table_set(deployment: LocalDeployment, laser: Path,
                                                              example: Path, capsys: pytest.CaptureFixture) -> None:
    assert evaluate(deployment, laser, example / "outcomes" / "defaulted.csv", "--json") == 0
    assert json.loads(capsys.readouterr().out)["n_samples"] == len(new_ids(example))
