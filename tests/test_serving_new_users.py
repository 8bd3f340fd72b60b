"""New users online across a federation (issue 34, item 1): ``serve --federation`` answers users who exist only in
the parties' prediction tables (``[[data.predict]]``), beside those of their training tables, each from real party
processes; picks up rows a party added to its prediction table at a reload (the party reads a changed table again
when a new session opens); and takes the label holder's own ``features`` for a new user as in process, when the
label holder's party server accepts them (``[policy] accept_coordinator_features``).  Every answer is compared with
the offline path (``predict --federation``, with or without ``--table-set``); waits are seconds long, far from any
machine-speed limit."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pandas as pd
import pytest

from example_tables import PARTIES, table_paths, write_example
from partialvfl.data.builders import from_tables
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.grpc.transport import PartyError
from partialvfl.federation.wire.messages import Request
from partialvfl.methods import get_method
from partialvfl.orchestration.predict import PredictOptions, run_predict

pytest.importorskip("fastapi")
from partialvfl.serving.app import ServiceConfig, create_app
from partialvfl.serving.federated import FederationPredictor
from test_serving import Service
from test_serving_federated import fit_across

pytestmark = pytest.mark.slow  # real party processes per module: the whole suite runs them, the fast tier not

SET = "new-users"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalDeployment, Path, dict]]:
    d = write_example(tmp_path_factory.mktemp("example"), seed=11, n_train=300, n_new=30)
    train = from_tables(table_paths(d), id_column="customer_id",
                        label_column="defaulted", active_party="bank")
    new = from_tables(table_paths(d, "new"), id_column="customer_id", active_party="bank")
    new = dataclasses.replace(new, task=train.task)  # no labels: the deployment writes an empty label table
    dep = LocalDeployment(tmp_path_factory.mktemp("fed"), train, deadline=120.0, start_timeout=600.0,
                          predict={SET: new})
    dep.policy[0] = {"preset": "research", "accept_coordinator_features": True}  # the label holder's own party
    try:
        dep.start()
        fit_across(dep, d / "fed-model")
        yield dep, d, reference(dep, d, new)
    finally:
        dep.close()


def reference(dep: LocalDeployment, d: Path, new: object) -> dict:
    """The offline path's outputs and parties for some training users and every new user (before the service
    opens its session: a party serves one coordinator session at a time)."""
    fed = dep.federation(allow_absent=True)
    try:
        model = get_method("laser-vfl").load(d / "fed-model", federation=fed)
        trained = [str(i) for i in pd.read_csv(d / "train" / "bank.csv")["customer_id"].head(6)]
        fresh = [str(i) for i in new.ids]  # type: ignore[attr-defined]
        old = run_predict(model, trained)
        newer = run_predict(model, fresh, PredictOptions(table_set=SET))
    finally:
        fed.close()
    out = {i: (o, [PARTIES[k] for k in np.flatnonzero(u)]) for i, o, u in zip(trained, old.output, old.parties)}
    out.update({i: (o, [PARTIES[k] for k in np.flatnonzero(u)]) for i, o, u in zip(fresh, newer.output,
                                                                                    newer.parties)})
    return {"trained": trained, "new": fresh, "answers": out}


def test_a_set_no_party_serves_is_refused_at_start_naming_the_served_ones(
        setup: tuple[LocalDeployment, Path, dict]) -> None:
    """First in this file (before the module's service opens its session)."""
    dep, d, _ = setup
    with pytest.raises(ValueError, match=r"--table-set 'old-users'.*they serve \['new-users'\]"):
        FederationPredictor(d / "fed-model", dep.federation_file, table_sets=["old-users"])
    FederationPredictor(d / "fed-model", dep.federation_file).close()  # the refused one said goodbye


@pytest.fixture(scope="module")
def service(setup: tuple[LocalDeployment, Path, dict]) -> Iterator[Service]:
    dep, d, ref = setup
    predictor = FederationPredictor(d / "fed-model", dep.federation_file)
    assert predictor.table_sets == [SET]  # every set the parties serve, by default
    s = Service(create_app(predictor, ServiceConfig(deadline=30.0)))
    s.predictor = predictor  # type: ignore[attr-defined]
    try:
        yield s
    finally:
        s.stop()


def test_users_only_in_the_prediction_tables_are_served_beside_the_training_ones(
        setup: tuple[LocalDeployment, Path, dict], service: Service) -> None:
    _, _, ref = setup
    ids = ref["new"][:8] + ref["trained"] + ["424242"]  # one request: new users, known users, nobody's
    code, body = service.call("/v1/predict", {"ids": ids}, token=None)
    assert code == 200, body
    got = {r["id"]: r for r in body["results"]}
    assert got["424242"]["status"] == "unknown_id"
    for i in ids[:-1]:
        want, parties = ref["answers"][i]
        assert got[i]["status"] == "ok" and got[i]["parties"] == parties, (i, got[i])
        np.testing.assert_allclose([got[i]["probabilities"]["0"], got[i]["probabilities"]["1"]], want, rtol=1e-5)
    assert any(len(got[i]["parties"]) > 1 for i in ids[:8])  # new users held by several parties' new tables


def test_rows_added_to_a_partys_prediction_table_are_served_after_a_reload(
        setup: tuple[LocalDeployment, Path, dict], service: Service) -> None:
    dep, _, ref = setup
    table = dep.dir / "data" / SET / "party-1.parquet"  # the shop's table of new users
    rows = pd.read_parquet(table)
    added = rows.iloc[[0]].assign(id="555001")
    code, body = service.call("/v1/predict", {"ids": ["555001"]}, token=None)
    assert code == 200 and body["results"][0]["status"] == "unknown_id"
    pd.concat([rows, added], ignore_index=True).to_parquet(table, index=False)
    try:
        code, body = service.call("/v1/predict", {"ids": ["555001"]}, token=None)
        assert code == 200 and body["results"][0]["status"] == "unknown_id"  # a session keeps what it announced
        assert service.call("/admin/reload", {}, token=None)[0] == 200  # a new session: the shop reads it again
        code, body = service.call("/v1/predict", {"ids": ["555001", ref["new"][0]]}, token=None)
        assert code == 200, body
        assert body["results"][0]["status"] == "ok" and body["results"][0]["parties"] == ["shop"]
        assert body["results"][1]["parties"] == ref["answers"][ref["new"][0]][1]  # the others as before
    finally:
        rows.to_parquet(table, index=False)
        service.call("/admin/reload", {}, token=None)


def test_the_label_holders_own_features_predict_a_new_user_across_the_federation(
        setup: tuple[LocalDeployment, Path, dict], service: Service) -> None:
    dep, _, ref = setup
    bank = pd.read_parquet(dep.dir / "data" / SET / "party-0.parquet")
    shop = set(pd.read_parquet(dep.dir / "data" / SET / "party-1.parquet")["id"])
    telco = set(pd.read_parquet(dep.dir / "data" / SET / "party-2.parquet")["id"])
    only_bank = next(str(i) for i in bank["id"] if i not in shop and i not in telco)
    values = {c: float(v) for c, v in bank.set_index("id").loc[only_bank].items()}
    code, body = service.call("/v1/predict", {"ids": ["fresh-1", only_bank], "features": {"fresh-1": values}},
                              token=None)
    assert code == 200, body
    fresh, known = body["results"]
    assert fresh["status"] == "ok" and fresh["parties"] == ["bank"]
    want, parties = ref["answers"][only_bank]
    assert parties == ["bank"] and known["parties"] == ["bank"]
    np.testing.assert_allclose([fresh["probabilities"]["0"], fresh["probabilities"]["1"]], want, rtol=1e-5)
    code, body = service.call("/v1/predict", {"ids": ["fresh-2"], "features": {"fresh-2": {"f0": 1.0}}}, token=None)
    assert code == 422 and body["error"].startswith("features.fresh-2.f1: missing"), body


def test_features_are_refused_where_the_label_holders_party_does_not_accept_them(
        setup: tuple[LocalDeployment, Path, dict], service: Service) -> None:
    predictor = service.predictor  # type: ignore[attr-defined]
    policy = predictor.fed.party_info[0]["policy"]
    policy["accept_coordinator_features"] = False  # as a bank without the policy key announces itself
    try:
        values = {"f0": 1.0, "f1": 0.5, "f2": 40.0}
        code, body = service.call("/v1/predict", {"ids": ["x"], "features": {"x": values}}, token=None)
    finally:
        policy["accept_coordinator_features"] = True
    assert code == 422 and "accept_coordinator_features = true" in body["error"], body


def test_a_passive_party_refuses_feature_values_from_the_coordinator(
        setup: tuple[LocalDeployment, Path, dict], service: Service) -> None:
    """The party's own gate, whatever the coordinator does: the shop (default for this key) refuses an attach that
    carries values of its features (the coordinator could otherwise evaluate its network on inputs it chooses)."""
    import torch

    fed = service.predictor.fed  # type: ignore[attr-defined]
    fed.transport.new_step()
    request = Request("attach", {"hashes": torch.zeros((0, 32), dtype=torch.uint8),
                                 "rows": torch.zeros(0, dtype=torch.int64),
                                 "features": torch.ones((1, 2), dtype=torch.float32),
                                 "feature_rows": torch.zeros(1, dtype=torch.int64)},
                      {"handle": "probe", "n_samples": 1, "feature_ids": ["x"]})
    with pytest.raises(PartyError) as refused:
        fed.transport.call_many({1: request})
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "accept_coordinator_features" in refused.value.details
