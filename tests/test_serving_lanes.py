"""A prediction service that keeps up across a federation (issue 34, item 5): one round per batch for a
split-network method (the batch's attach travels with each party's inference request), several batches in flight
on lanes of one session (a party keeps each lane's order and refuses anything but inference and ID lookups on
lanes other than 0), so that a batch that does not need a late party is not held by one that waits for it.  Real
party processes; the waits are seconds long, far from any machine-speed limit."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pandas as pd
import pytest
import torch

from example_tables import table_paths, write_example
from partialvfl.data.builders import from_tables
from partialvfl.federation.grpc.delay_proxy import DelayProxy
from partialvfl.federation.grpc.frames import WireRequest
from partialvfl.federation.grpc.limits import Refused
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.grpc.sessions import SessionGuard
from partialvfl.federation.grpc.transport import PartyError
from partialvfl.federation.trust.lookups import LOOKUP_LEDGER
from partialvfl.federation.wire.messages import MessageLog, Request
from partialvfl.methods import get_method
from partialvfl.orchestration.predict import run_predict

pytest.importorskip("fastapi")
from partialvfl.serving.app import ServiceConfig, create_app
from partialvfl.serving.federated import FederationPredictor
from test_serving import Service
from test_serving_federated import fit_across

pytestmark = pytest.mark.slow  # real party processes per module: the whole suite runs them, the fast tier not

DELAY = 6.0  # seconds the telco's requests are held back
DEADLINE_MS = 3000  # the late batch's deadline: far below the delay, far above an on-time batch


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalDeployment, Path, DelayProxy, dict]]:
    d = write_example(tmp_path_factory.mktemp("example"), seed=13, n_train=300, n_new=10)
    train = from_tables(table_paths(d), id_column="customer_id",
                        label_column="defaulted", active_party="bank")
    # the research policy, with a lookup budget: the keyed parties keep a ledger of every lookup
    dep = LocalDeployment(tmp_path_factory.mktemp("fed"), train, deadline=120.0, start_timeout=600.0,
                          policy={"preset": "research", "max_lookups_per_day": 1_000_000})
    try:
        dep.start()
        fit_across(dep, d / "model")
        telco = set(pd.read_parquet(dep.dir / "data" / "party-2.parquet")["id"])
        ids = [str(i) for i in train.ids]
        groups = {"telco": [i for i in ids if i in telco][:6], "not_telco": [i for i in ids if i not in telco][:6]}
        fed = dep.federation(allow_absent=True)
        try:
            model = get_method("laser-vfl").load(d / "model", federation=fed)
            every = groups["telco"] + groups["not_telco"]
            offline = dict(zip(every, run_predict(model, every).output))
        finally:
            fed.close()
        with DelayProxy(f"127.0.0.1:{dep.ports[2]}") as proxy:  # the telco, reached through the proxy
            text = dep.federation_file.read_text().replace(f"127.0.0.1:{dep.ports[2]}", proxy.address)
            (dep.dir / "served.toml").write_text(text)
            yield dep, d, proxy, {**groups, "offline": offline}
    finally:
        dep.close()


@pytest.fixture(scope="module")
def service(setup: tuple[LocalDeployment, Path, DelayProxy, dict]) -> Iterator[Service]:
    dep, d, _, ref = setup
    predictor = FederationPredictor(d / "model", dep.dir / "served.toml", lanes=2)
    s = Service(create_app(predictor, ServiceConfig(deadline=30.0)))
    s.predictor = predictor  # type: ignore[attr-defined]
    try:
        for lane in (0, 1):  # each lane's first batch (the parties build their networks); every ID looked up once
            predictor.predict(ref["telco"] + ref["not_telco"], {}, 30.0, lane=lane)
        yield s
    finally:
        s.stop()


def test_a_batch_is_one_round_per_party_and_every_lane_answers_as_offline(
        setup: tuple[LocalDeployment, Path, DelayProxy, dict], service: Service) -> None:
    _, _, _, ref = setup
    predictor = service.predictor  # type: ignore[attr-defined]
    ids = ref["telco"][:3] + ref["not_telco"][:3]
    for lane in (0, 1):
        transport = predictor._lanes[lane].fed.grpc_transport
        transport.log = MessageLog()
        outcome = predictor.predict(ids, {}, 30.0, lane=lane)
        requests = [e for e in transport.log if e.direction == "request"]
        assert sorted(e.receiver for e in requests) == [0, 1, 2], requests  # one request per party, no other round
        assert {e.kind for e in requests} == {"embed"}
        assert all("attach.hashes" in e.names and "attach.rows" in e.names for e in requests)
        for i in ids:
            np.testing.assert_allclose(outcome.output[i], ref["offline"][i], rtol=1e-5)


def test_a_batch_that_does_not_need_the_late_party_is_not_held_by_one_that_waits_for_it(
        setup: tuple[LocalDeployment, Path, DelayProxy, dict], service: Service) -> None:
    _, _, proxy, ref = setup
    late: dict = {}

    def waits_for_the_telco() -> None:
        t0 = time.monotonic()
        late["answer"] = service.call("/v1/predict", {"ids": ref["telco"][:2], "deadline_ms": DEADLINE_MS},
                                      token=None)
        late["took"] = time.monotonic() - t0

    proxy.delay = DELAY
    try:
        thread = threading.Thread(target=waits_for_the_telco)
        thread.start()
        time.sleep(0.5)  # that batch is waiting for the telco now
        t0 = time.monotonic()
        code, body = service.call("/v1/predict", {"ids": ref["not_telco"][:2]}, token=None)
        took = time.monotonic() - t0
        thread.join(60)
    finally:
        proxy.delay = 0.0
    assert code == 200 and [r["status"] for r in body["results"]] == ["ok", "ok"], body
    assert took < 1.5, took  # on the other lane: not after the late batch (which holds its lane ~3 s)
    code, answer = late["answer"]
    assert code == 200 and answer["parties_timed_out"] == ["telco"], answer
    assert late["took"] > 2.0  # it did wait for the telco, meanwhile
    for r in body["results"]:
        np.testing.assert_allclose([r["probabilities"]["0"], r["probabilities"]["1"]], ref["offline"][r["id"]],
                                   rtol=1e-5)
    time.sleep(DELAY + 1)  # what the proxy held back reaches the telco (and is refused there as stale)


def test_a_lane_other_than_0_carries_inference_only(service: Service) -> None:
    fed = service.predictor._lanes[1].fed  # type: ignore[attr-defined]
    fed.transport.new_step()
    with pytest.raises(PartyError) as refused:
        fed.transport.call_many({0: Request("grad_embedding", {"grad:f": torch.zeros((1, 4))})})
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "lane 1 carries inference requests and ID lookups only, not 'grad_embedding'" in refused.value.details


def _wire(kind: str, seq: int, step: int, lane: int = 0, session: str = "s") -> WireRequest:
    return WireRequest(Request(kind, {}, {}), step, 0, session, seq, lane)


def test_a_party_keeps_each_lanes_order_apart() -> None:
    guard = SessionGuard("bank")
    guard.check(_wire("hello", 1, 0))
    guard.commit(_wire("hello", 1, 0))
    for seq, step in ((2, 1), (3, 2), (40, 9)):  # lane 0 runs ahead
        guard.check(_wire("embed", seq, step))
        guard.commit(_wire("embed", seq, step))
    for seq, step in ((1, 1), (2, 2)):  # lane 1 starts at its own 1: not a replay of lane 0's numbers
        guard.check(_wire("embed", seq, step, lane=1))
        guard.commit(_wire("embed", seq, step, lane=1))
    for stale in (_wire("embed", 2, 3, lane=1), _wire("embed", 3, 1, lane=1), _wire("embed", 40, 9)):
        with pytest.raises(Refused):  # within a lane: a sequence number seen, a step gone by, a replay
            guard.check(stale)
    guard.commit(_wire("bye", 41, 9))
    guard.check(_wire("hello", 1, 0, session="t"))
    guard.commit(_wire("hello", 1, 0, session="t"))  # a new session: every lane starts again
    guard.check(_wire("embed", 1, 0, lane=1, session="t"))


def _lookups_charged(dep: LocalDeployment) -> int:
    """Every lookup the keyed parties (shop, telco) have charged to any coordinator, by their ledgers' files."""
    total = 0
    for name in ("shop", "telco"):
        book = json.loads((dep.dir / "state" / name / LOOKUP_LEDGER).read_text())
        total += sum(int(entry["total"]) for entry in book["coordinators"].values())
    return total


def test_every_lookup_on_every_lane_is_charged_to_the_keyed_parties_ledgers(
        setup: tuple[LocalDeployment, Path, DelayProxy, dict], service: Service) -> None:
    dep, _, _, ref = setup
    predictor = service.predictor  # type: ignore[attr-defined]
    known = set(ref["telco"]) | set(ref["not_telco"])  # looked up already in this session (the token cache)
    fresh = [str(i) for i in pd.read_parquet(dep.dir / "data" / "party-0.parquet")["id"] if str(i) not in known]
    asked = {0: fresh[:5] + ["no-such-user-0"], 1: fresh[5:9] + ["no-such-user-1", "no-such-user-2"]}
    before = _lookups_charged(dep)
    for lane, ids in asked.items():
        predictor.predict(ids, {}, 30.0, lane=lane)
        predictor.predict(ids, {}, 30.0, lane=lane)  # the same IDs again: from the cache, no lookup
    assert _lookups_charged(dep) - before == sum(len(ids) for ids in asked.values())


def test_a_method_whose_parties_keep_state_between_rounds_predicts_one_batch_at_a_time() -> None:
    """FALSE-VFL's parties keep a batch's ``encode`` for its ``decode``: another batch's ``encode`` in between would
    replace it (a failed batch, or rows predicted from another batch's features).  Its batches take turns on lane 0;
    a split-network method's go side by side on their lanes."""
    predictor = object.__new__(FederationPredictor)
    predictor._one_batch = threading.Lock()
    inside, seen, count = [0], [], threading.Lock()

    def predict_on(ids: list[str], features: dict, deadline: float, lane: int) -> int:
        with count:
            inside[0] += 1
            seen.append((inside[0], lane))
        time.sleep(0.05)
        with count:
            inside[0] -= 1
        return lane

    predictor._predict = predict_on  # type: ignore[method-assign]
    for method, lanes in (("false-vfl-1", {0}), ("laser-vfl", {0, 1})):
        predictor.model = get_method(method)("fast")
        seen.clear()
        threads = [threading.Thread(target=predictor.predict, args=(["1"], {}, 1.0), kwargs={"lane": lane})
                   for lane in (0, 1, 0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert {lane for _, lane in seen} == lanes
        if method == "false-vfl-1":
            assert max(n for n, _ in seen) == 1  # never two at once
