"""The prediction service across real party processes (issue 26, items 1-3): predictions equal the offline
``predict --federation`` path; a party delayed by seconds, with a deadline well below the delay, does not hold the
response (it comes within the deadline, the rounds after the late party's included, and names the party as timed
out) and is used again once it is on time; a party killed and restarted is left out meanwhile and used again after
it returns.  Delays and waits are seconds
long, far from any machine-speed limit."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from example_tables import PARTIES, table_paths, write_example
from partialvfl.data.builders import from_tables
from partialvfl.federation.grpc.delay_proxy import DelayProxy
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.grpc.transport import RECONNECT_BACKOFF_MS, RECONNECT_OPTIONS
from partialvfl.methods import get_method
from partialvfl.orchestration.predict import predict_reporting_parties

pytest.importorskip("fastapi")
from partialvfl.serving.app import ServiceConfig, create_app
from partialvfl.serving.federated import FederationPredictor
from test_serving import Service

KW = {"id_column": "customer_id", "label_column": "defaulted", "active_party": "bank"}
DELAY = 6.0  # seconds the slow party's requests are held back
DEADLINE_MS = 1500  # far below the delay


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalDeployment, Path, DelayProxy]]:
    d = write_example(tmp_path_factory.mktemp("example"), seed=7, n_train=300, n_new=20)
    data = from_tables(table_paths(d), **KW)
    # fresh interpreters (not the suite's forked parties): the late-batch test gives the on-time parties 1.5 s, and
    # with forked parties the shop once missed it in a CI run (cause not established; these tests were written and
    # measured against fresh interpreters)
    dep = LocalDeployment(tmp_path_factory.mktemp("fed"), data, deadline=120.0, start_timeout=600.0, launcher="exec")
    try:
        dep.start()
        fit_across(dep, d / "fed-model")
        reference(dep, d)  # before the service opens its session (the parties serve one coordinator session)
        with DelayProxy(f"127.0.0.1:{dep.ports[2]}") as proxy:  # the telco, reached through the proxy
            text = dep.federation_file.read_text().replace(f"127.0.0.1:{dep.ports[2]}", proxy.address)
            (dep.dir / "served.toml").write_text(text)
            yield dep, d, proxy
    finally:
        dep.close()


@pytest.fixture(scope="module")
def service(setup: tuple[LocalDeployment, Path, DelayProxy]) -> Iterator[Service]:
    dep, d, _ = setup
    # no poll period: the rejoin must follow the restarted party's listening (its channel), not a timer
    predictor = FederationPredictor(d / "fed-model", dep.dir / "served.toml", rejoin_interval=3600.0)
    s = Service(create_app(predictor, ServiceConfig(deadline=30.0)))
    s.predictor = predictor  # type: ignore[attr-defined]
    try:
        # a session's first batch waits for the parties to build their networks (up to the connection timeout)
        assert s.call("/v1/predict", {"ids": ids_of(d)[:1]}, token=None)[0] == 200
        yield s
    finally:
        s.stop()


def fit_across(dep: LocalDeployment, out: Path) -> None:
    """A small LASER-VFL fitted across ``dep``'s party processes, saved to ``out`` (the parties keep their part)."""
    fed = dep.federation()
    try:
        view, handle = fed.align()
        get_method("laser-vfl")("fast", seed=0, epochs=2).fit_federated(fed, view, handle).save(out)
        fed.release(handle)
    finally:
        fed.close()


def ids_of(d: Path, n: int = 12) -> list[str]:
    import pandas as pd

    return [str(i) for i in pd.read_csv(d / "train" / "bank.csv")["customer_id"].head(n)]


def reference(dep: LocalDeployment, d: Path) -> None:
    """The offline path's outputs and parties used for :func:`ids_of`, saved beside the model."""
    fed = dep.federation(allow_absent=True)
    try:
        model = get_method("laser-vfl").load(d / "fed-model", federation=fed)
        view, handle = fed.attach_ids(ids_of(d), task=model.index_.task)
        out, used = predict_reporting_parties(model, fed, view, handle)
        fed.release(handle)
    finally:
        fed.close()
    np.savez(d / "reference.npz", out=out, used=used)


@pytest.mark.slow
def test_closing_after_a_late_batch_ends_the_late_partys_session_too(
        setup: tuple[LocalDeployment, Path, DelayProxy]) -> None:
    """First in this file (before the module's service opens its session): a service stopped right after a batch
    in which the telco was late still says goodbye to the telco, so another coordinator is accepted at once (left
    out, the telco would keep serving the dead session for its idle timeout, refusing everyone else)."""
    dep, d, proxy = setup
    predictor = FederationPredictor(d / "fed-model", dep.dir / "served.toml")
    try:
        predictor.predict(ids_of(d)[:2], {}, 30.0)
        proxy.delay = DELAY
        late = predictor.predict(ids_of(d)[2:4], {}, DEADLINE_MS / 1000)
        assert late.timed_out == ["telco"]
    finally:
        proxy.delay = 0.0
        predictor.close()  # its goodbye reaches the telco behind what the proxy still holds back
    fed = dep.federation()  # straight to the parties, the telco included: a new session everywhere
    fed.close()


@pytest.mark.slow
def test_predictions_equal_the_offline_federated_path(setup: tuple[LocalDeployment, Path, DelayProxy],
                                                     service: Service) -> None:
    _, d, _ = setup
    code, body = service.call("/v1/predict", {"ids": ids_of(d)}, token=None)
    assert code == 200, body
    assert body["parties_timed_out"] == [] and body["parties_failed"] == []
    ref = np.load(d / "reference.npz")
    out, used = ref["out"], ref["used"]
    for i, r in enumerate(body["results"]):
        assert r["status"] == "ok" and r["parties"] == [PARTIES[k] for k in np.flatnonzero(used[i])]
        np.testing.assert_allclose([r["probabilities"]["0"], r["probabilities"]["1"]], out[i], rtol=1e-6)


@pytest.mark.slow
def test_a_slow_party_is_a_missing_block_within_the_deadline_and_is_used_again(
        setup: tuple[LocalDeployment, Path, DelayProxy], service: Service) -> None:
    _, d, proxy = setup
    ids = ids_of(d)
    proxy.delay = DELAY
    # the time an on-time batch takes, kept back from the wait (set, not measured, so the test does not depend on
    # this machine's speed): the slow party is waited for 0.8 s, the rounds after it end within the deadline
    service.predictor.reserve = 0.7
    try:
        t0 = time.monotonic()
        code, body = service.call("/v1/predict", {"ids": ids, "deadline_ms": DEADLINE_MS}, token=None)
        took = time.monotonic() - t0
    finally:
        proxy.delay = 0.0
    assert code == 200, body
    assert took < DEADLINE_MS / 1000, took  # the whole response within the deadline, not only the wait
    assert body["parties_timed_out"] == ["telco"] and body["parties_failed"] == []
    assert all("telco" not in r["parties"] for r in body["results"])
    assert any(r["status"] == "ok" for r in body["results"])
    time.sleep(DELAY + 1)  # what the proxy held back reaches the telco (and is refused there as stale)
    code, body = service.call("/v1/predict", {"ids": ids}, token=None)
    assert code == 200 and body["parties_timed_out"] == [], body
    assert any("telco" in r["parties"] for r in body["results"])  # on time again: used again at once
    _, text = service.call("/metrics", token=None)
    assert 'partialvfl_serve_party_timeouts_total{party="telco"} 1.0' in text


@pytest.mark.slow
def test_a_party_killed_and_restarted_is_used_again(setup: tuple[LocalDeployment, Path, DelayProxy],
                                                    service: Service) -> None:
    dep, d, _ = setup
    ids = ids_of(d)
    hellos = {name: _hellos(dep, name) for name in ("bank", "telco")}
    dep.kill(1)
    code, body = service.call("/v1/predict", {"ids": ids}, token=None)
    assert code == 200, body
    assert all("shop" not in r["parties"] for r in body["results"])
    assert service.call("/readyz", token=None)[1]["parties"]["shop"] == "down"
    # its channel is watched from the moment it was found down, and retries every RECONNECT_BACKOFF_MS at most
    assert 1 in service.predictor._ready  # type: ignore[attr-defined]
    assert dict(RECONNECT_OPTIONS)["grpc.max_reconnect_backoff_ms"] == RECONNECT_BACKOFF_MS <= 250
    dep.start([1])  # the same port, a new process: it lost the session and the model
    # the rejoin follows the party's listening, not a poll period: the service's rejoin_interval is an hour
    limit = time.monotonic() + 120
    while True:
        code, body = service.call("/v1/predict", {"ids": ids}, token=None)
        assert code == 200, body
        if any("shop" in r["parties"] for r in body["results"]):
            break
        assert time.monotonic() < limit, "the restarted party was not used again"
        time.sleep(0.2)
    assert service.call("/readyz", token=None)[1]["parties"]["shop"] == "ok"
    # it continued the service's session from its own disk: no new session at the other parties, no model loaded
    # or token computed again there
    assert {name: _hellos(dep, name) for name in ("bank", "telco")} == hellos
    assert "restored its coordinator session" in (dep.dir / "party-1.log").read_text()


def _hellos(dep: LocalDeployment, name: str) -> int:
    from partialvfl.federation.trust.access_log import read_access_log

    log = read_access_log(dep.dir / "state" / name / "access.log")
    return sum(1 for e in log if e["kind"] == "hello" and e["outcome"] == "served")


@pytest.mark.slow
def test_reload_opens_a_new_session_and_keeps_answering(setup: tuple[LocalDeployment, Path, DelayProxy],
                                                        service: Service) -> None:
    _, d, _ = setup
    before = service.call("/v1/predict", {"ids": ids_of(d)}, token=None)[1]
    code, answer = service.call("/admin/reload", {}, token=None)
    assert code == 200 and answer["model_version"] == before["model_version"]
    service.predictor.reserve = 123.0  # set, not measured: only a warm batch may move it
    code, after = service.call("/v1/predict", {"ids": ids_of(d)}, token=None)
    assert service.predictor.reserve == 123.0  # the new session's first batch (the parties build, seconds) does not
    assert code == 200 and [r["parties"] for r in after["results"]] == [r["parties"] for r in before["results"]]
    np.testing.assert_allclose([r["probabilities"]["1"] for r in after["results"]],
                               [r["probabilities"]["1"] for r in before["results"]], rtol=1e-6)
    assert service.call("/v1/predict", {"ids": ids_of(d)}, token=None)[0] == 200
    assert service.predictor.reserve < 123.0  # a warm on-time batch does
