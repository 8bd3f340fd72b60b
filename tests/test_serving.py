"""The prediction service in process (issue 26): ``POST /v1/predict`` answers what the library predicts, per-ID
statuses for unknown IDs, 4xx naming the field for bad input, limits, the bearer token, metrics, OpenAPI, reload
without dropping requests, and micro-batching of requests queued behind a running batch.  The service runs on a real
uvicorn server on a free loopback port; no assertion depends on the machine's speed."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from example_tables import PARTIES, table_paths, write_example
from partialvfl.data.builders import from_tables
from partialvfl.methods import get_method

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from partialvfl.serving.app import ServiceConfig, create_app  # noqa: E402
from partialvfl.serving.batcher import Job, MicroBatcher  # noqa: E402
from partialvfl.serving.predictors import BatchOutcome, TablePredictor  # noqa: E402

KW = {"id_column": "customer_id", "label_column": "defaulted", "active_party": "bank"}
TOKEN = "s3cret-token-of-the-test-0123456789"


class Service:
    """A uvicorn server for ``app`` on a free port, in a thread."""

    def __init__(self, app: Any, **config: Any) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    access_log=False, **config))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        limit = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < limit and self.thread.is_alive(), "the service did not start"
            time.sleep(0.02)
        scheme = "https" if config.get("ssl_certfile") else "http"
        self.url = f"{scheme}://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def call(self, path: str, body: Any = None, *, raw: bytes | None = None, token: str | None = TOKEN,
             method: str | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method or ("POST" if data else "GET"))
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                text = r.read().decode()
                code = r.status
        except urllib.error.HTTPError as e:
            text, code = e.read().decode(), e.code
        try:
            return code, json.loads(text)
        except json.JSONDecodeError:
            return code, text

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = write_example(tmp_path_factory.mktemp("example"), seed=5, n_train=300, n_new=40)
    train = from_tables(table_paths(d), **KW)
    for seed in (0, 1):
        get_method("laser-vfl")("fast", seed=seed, epochs=2).fit(train).save(d / f"model-{seed}")
    return d


def new_tables(d: Path) -> dict[str, Path]:
    return table_paths(d, "new")


@pytest.fixture(scope="module")
def service(example: Path) -> Iterator[Service]:
    predictor = TablePredictor(example / "model-0", new_tables(example))
    s = Service(create_app(predictor, ServiceConfig(token=TOKEN, max_ids=50, max_body_bytes=4000)))
    try:
        yield s
    finally:
        s.stop()


def offline(d: Path, model: str = "model-0") -> dict[str, np.ndarray]:
    """Probabilities per ID as the library predicts the new tables."""
    m = get_method("laser-vfl").load(d / model)
    data = from_tables(new_tables(d), id_column="customer_id", active_party="bank")
    return dict(zip([str(i) for i in data.ids], m.predict_proba(data)))


def test_predict_answers_what_the_library_predicts(example: Path, service: Service) -> None:
    want = offline(example)
    ids = sorted(want)[:7]
    code, body = service.call("/v1/predict", {"ids": [int(i) for i in ids[:3]] + ids[3:] + ["no-such-user"]})
    assert code == 200, body
    assert body["model_version"].startswith("model-0@") and body["parties_timed_out"] == []
    got = {str(r["id"]): r for r in body["results"]}
    for i in ids:
        r = got[i]
        assert r["status"] == "ok" and r["parties"]
        np.testing.assert_allclose([r["probabilities"]["0"], r["probabilities"]["1"]], want[i], rtol=1e-6)
        assert r["prediction"] == int(np.argmax(want[i]))
    assert got["no-such-user"]["status"] == "unknown_id" and "no party holds it" in got["no-such-user"]["error"]
    code, body = service.call("/v1/predict", {"ids": ["no-such-user"], "allow_prior_only": True})
    assert code == 200 and body["results"][0]["status"] == "prior_only" and body["results"][0]["parties"] == []


def test_the_active_partys_own_features_predict_a_user_not_in_its_table(example: Path, service: Service) -> None:
    values = {"income_eur": 2500.0, "debt_ratio": 0.4, "age": 37}
    code, body = service.call("/v1/predict", {"ids": ["555"], "features": {"555": values}})
    assert code == 200, body
    r = body["results"][0]
    assert r["status"] == "ok" and r["parties"] == ["bank"]
    import pandas as pd

    m = get_method("laser-vfl").load(example / "model-0")
    tables = {"bank": pd.DataFrame([{"customer_id": 555, **values}]),
              "shop": pd.DataFrame(columns=["customer_id", "share_online", "share_discount"]),
              "telco": pd.read_csv(example / "new" / "telco.csv").iloc[:0]}
    want = m.predict_proba(from_tables(tables, id_column="customer_id", active_party="bank"))[0]
    np.testing.assert_allclose([r["probabilities"]["0"], r["probabilities"]["1"]], want, rtol=1e-6)


@pytest.mark.parametrize(("body", "raw", "code", "field"), [
    (None, b'{"ids": [1, 2', 400, "body: malformed JSON"),
    ({"ids": [1.5]}, None, 422, "ids[0]:"),
    ({"ids": []}, None, 422, "ids:"),
    ({"idz": [1]}, None, 422, "ids: Field required"),
    ({"ids": ["7", 7]}, None, 422, "ids[1]:"),
    ({"ids": ["7"], "deadline_ms": -1}, None, 422, "deadline_ms:"),
    ({"ids": ["7"], "features": {"7": {"income": 1}}}, None, 422, "features.7.income:"),
    ({"ids": ["7"], "features": {"7": {"income_eur": "x", "debt_ratio": 0, "age": 1}}}, None, 422,
     "features.7.income_eur: expected a finite number"),
    ({"ids": ["7"], "features": {"7": {"income_eur": 1, "age": 1}}}, None, 422, "features.7.debt_ratio: missing"),
    ({"ids": ["7"], "features": {"8": {}}}, None, 422, "features.8: this ID is not in 'ids'"),
    ({"ids": [str(i) for i in range(51)]}, None, 413, "ids: 51 IDs exceed the limit of 50"),
    ({"ids": ["x" * 5000]}, None, 413, "body: more than 4000 bytes"),
])
def test_bad_input_is_a_4xx_naming_the_field(service: Service, body: Any, raw: bytes | None, code: int,
                                             field: str) -> None:
    got, answer = service.call("/v1/predict", body, raw=raw)
    assert got == code, answer
    assert answer["error"].startswith(field), answer
    assert service.call("/healthz")[0] == 200  # nothing crashed or blocks


def test_the_token_guards_predictions_and_reload(service: Service) -> None:
    assert service.call("/v1/predict", {"ids": ["1"]}, token=None)[0] == 401
    code, body = service.call("/v1/predict", {"ids": ["1"]}, token="wrong-token-0123456789")
    assert code == 401 and "bearer token" in body["error"]
    assert service.call("/admin/reload", {}, token=None)[0] == 401
    assert service.call("/healthz", token=None)[0] == 200


def test_operations_endpoints(service: Service) -> None:
    service.call("/v1/predict", {"ids": ["1"]})
    code, ready = service.call("/readyz")
    assert code == 200 and ready["ready"] and set(ready["parties"]) == set(PARTIES)
    code, text = service.call("/metrics")
    assert code == 200
    for name in ("partialvfl_serve_request_seconds_bucket", "partialvfl_serve_batch_ids_bucket",
                 'partialvfl_serve_party_timeouts_total{party="shop"}', "partialvfl_serve_model_info{version="):
        assert name in text, name
    code, schema = service.call("/openapi.json")
    assert code == 200 and "ids" in json.dumps(schema["paths"]["/v1/predict"])


def test_reload_swaps_the_model_without_dropping_requests(example: Path, service: Service) -> None:
    ids = sorted(offline(example))[:5]
    before = service.call("/v1/predict", {"ids": ids})[1]
    with ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(service.call, "/v1/predict", {"ids": ids}) for _ in range(24)]
        time.sleep(0.05)
        code, answer = service.call("/admin/reload", {"model": str(example / "model-1")})
        results = [c.result() for c in calls]
    assert code == 200 and answer["model_version"].startswith("model-1@"), answer
    assert all(c == 200 for c, _ in results)  # none dropped; each answered by one whole model
    assert {b["model_version"].split("@")[0] for _, b in results} <= {"model-0", "model-1"}
    after = service.call("/v1/predict", {"ids": ids})[1]
    assert after["model_version"].startswith("model-1@")
    want = offline(example, "model-1")
    np.testing.assert_allclose([r["probabilities"]["1"] for r in after["results"]], [want[i][1] for i in ids],
                               rtol=1e-6)
    assert [r["probabilities"] for r in after["results"]] != [r["probabilities"] for r in before["results"]]
    code, answer = service.call("/admin/reload", {"model": str(example / "not-a-model")})
    assert code == 422 and "previous model keeps serving" in answer["error"]
    service.call("/admin/reload", {"model": str(example / "model-0")})


class _Gate:
    """A predictor whose first batch waits for the test: the requests queued meanwhile become one batch."""

    party_names = ("a",)
    version = "v"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[list[str]] = []

    def predict(self, ids: list[str], features: dict, deadline: float | None) -> BatchOutcome:
        self.calls.append(list(ids))
        if len(self.calls) == 1:
            self.release.wait(60)
        return BatchOutcome(dict.fromkeys(ids), dict.fromkeys(ids, "ok"), {i: ["a"] for i in ids})


def test_requests_queued_behind_a_batch_go_to_the_parties_as_one_batch() -> None:
    gate = _Gate()
    batcher = MicroBatcher(gate)
    try:
        first = batcher.submit(Job(["1"], {}, None))
        while not gate.calls:
            time.sleep(0.01)
        rest = [batcher.submit(Job([str(i), "shared"], {}, None)) for i in range(2, 7)]
        gate.release.set()
        first.result(60)
        outcomes = [f.result(60) for f in rest]
    finally:
        batcher.stop(60)
    assert gate.calls == [["1"], ["2", "shared", "3", "4", "5", "6"]]  # one round, each ID once
    assert all(o is outcomes[0] for o in outcomes)


class _SlowTables(TablePredictor):
    """In-process tables whose batches wait until the test lets them go."""

    go: threading.Event
    started: threading.Event

    def predict(self, ids: list[str], features: dict, deadline: float | None = None) -> BatchOutcome:
        self.started.set()
        self.go.wait(60)
        return super().predict(ids, features, deadline)


def test_a_graceful_stop_answers_the_requests_in_flight(example: Path) -> None:
    predictor = _SlowTables(example / "model-0", new_tables(example))
    predictor.go, predictor.started = threading.Event(), threading.Event()
    s = Service(create_app(predictor))
    ids = sorted(offline(example))[:2]
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(s.call, "/v1/predict", {"ids": ids})
        assert predictor.started.wait(60)
        s.server.should_exit = True  # what SIGTERM does
        time.sleep(0.5)
        assert call.running()  # still waiting for its batch: not cut off
        predictor.go.set()
        code, body = call.result(60)
    s.thread.join(60)
    assert code == 200 and [r["status"] for r in body["results"]] == ["ok", "ok"]
    assert not s.thread.is_alive()


def test_serve_refuses_bad_options(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from partialvfl.cli import main

    tables = [f"--table={p}={example / 'new' / f'{p}.csv'}" for p in PARTIES]
    short = tmp_path / "token"
    short.write_text("abc\n")
    cases = [
        ([], "one of them"),
        ([*tables, "--federation", "f.toml"], "one of them"),
        ([*tables, "--token-file", str(short)], "--token-file"),
        ([*tables, "--max-ids", "0"], "--max-ids"),
        ([*tables, "--tls-cert", "c.pem"], "--tls-key"),
        ([f"--table=bank={example / 'new' / 'bank.csv'}"], "no --table for ['shop', 'telco']"),
    ]
    for extra, words in cases:
        assert main(["serve", "--model", str(example / "model-0"), *extra]) == 2, extra
        assert words in capsys.readouterr().err, extra


def test_https_with_client_certificates(example: Path, tmp_path: Path) -> None:
    import ssl

    from partialvfl.cli.serve import uvicorn_tls
    from partialvfl.federation.grpc.certs import init_dev_pki

    made = init_dev_pki(tmp_path / "pki", ["service", "client"])
    (cert, key), (client_cert, client_key) = made["service"], made["client"]
    ca = tmp_path / "pki" / "ca.pem"
    predictor = TablePredictor(example / "model-0", new_tables(example))
    s = Service(create_app(predictor), **uvicorn_tls(str(cert), str(key), str(ca)))
    try:
        body = json.dumps({"ids": sorted(offline(example))[:1]}).encode()
        trusted = ssl.create_default_context(cafile=str(ca))
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):  # no client certificate
            urllib.request.urlopen(urllib.request.Request(s.url + "/v1/predict", data=body), context=trusted,
                                   timeout=60).read()
        trusted.load_cert_chain(str(client_cert), str(client_key))
        with urllib.request.urlopen(urllib.request.Request(s.url + "/v1/predict", data=body), context=trusted,
                                    timeout=60) as r:
            assert r.status == 200 and json.loads(r.read())["results"][0]["status"] == "ok"
    finally:
        s.stop()
