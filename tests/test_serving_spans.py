"""Where a served batch's time goes (issue 46): the spans are exported as Prometheus metrics and, opt in, as
OpenTelemetry traces.

A stand-in for the federation's predictor answers each batch after "calling" two parties (one round, the calls
timed as the gRPC transport times them: :class:`CallSpan`, the party's own handling time in the reply); the service
must export each request's queue wait, each batch's coordinator / party-compute / wire parts (adding up to the batch)
and each party's compute and wire, as histograms on ``/metrics`` and as spans of an OpenTelemetry SDK tracer.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from partialvfl.federation.grpc.transport import CallSpan
from partialvfl.serving.app import create_app
from partialvfl.serving.predictors import OK, BatchOutcome
from partialvfl.serving.spans import BatchTiming
from test_serving import Service


class _Model:
    class index_:  # the fitted model's attribute
        class task:
            is_classification, classes = True, [0, 1]


class TwoParties:
    """Answers every ID after one round of calls to 'bank' and 'shop' (the shop computes 4 ms of its 6 ms call)."""

    party_names = ("bank", "shop")
    version = "stand-in@1"
    model = _Model()
    lanes = 1

    def check_features(self, features: Mapping[str, Any], ids: Sequence[str]) -> dict[str, np.ndarray]:
        return {}

    def predict(self, ids: Sequence[str], features: Mapping[str, np.ndarray], deadline: float | None = None
                ) -> BatchOutcome:
        time.sleep(0.002)  # the coordinator's own work before the round
        t0 = time.perf_counter()
        time.sleep(0.006)
        t1 = time.perf_counter()
        calls = [CallSpan(0, "infer", 1, 1, t0, t0 + 0.003, 0.002), CallSpan(1, "infer", 1, 1, t0, t1, 0.004)]
        return BatchOutcome({i: np.array([0.3, 0.7]) for i in ids}, dict.fromkeys(ids, OK),
                            {i: ["bank", "shop"] for i in ids}, calls=calls)


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # the client library sorts them
    pattern = rf"^{re.escape(name)}{{{re.escape(want)}}} (\S+)$" if labels else rf"^{re.escape(name)} (\S+)$"
    found = re.search(pattern, text, re.M)
    assert found, f"{name} {labels} not exported"
    return float(found.group(1))


def test_a_batch_splits_along_its_critical_path_into_parts_that_add_up() -> None:
    calls = [CallSpan(0, "a", 1, 1, 1.00, 1.03, 0.01), CallSpan(1, "a", 1, 1, 1.00, 1.05, 0.02),
             CallSpan(1, "b", 1, 2, 1.06, 1.07, 0.005)]
    timing = BatchTiming([0.90, 0.95], 0.99, 1.10, calls)
    parts = timing.parts()
    assert parts["party_compute"] == pytest.approx(0.02 + 0.005)  # the slowest call of each round
    assert parts["wire"] == pytest.approx(0.03 + 0.005)
    assert sum(parts.values()) == pytest.approx(timing.seconds)
    assert timing.queue() == pytest.approx([0.09, 0.04])
    assert timing.per_party(["bank", "shop"])["shop"] == pytest.approx({"compute": 0.025, "wire": 0.035})


def test_the_spans_are_exported_as_metrics_and_opentelemetry_traces() -> None:
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    service = Service(create_app(TwoParties(), tracer_provider=provider))
    try:
        for i in range(3):
            code, _ = service.call("/v1/predict", {"ids": [i]}, token=None)
            assert code == 200
        _, text = service.call("/metrics", token=None)
    finally:
        service.stop()
    assert metric(text, "partialvfl_serve_queue_seconds_count") == 3
    assert metric(text, "partialvfl_serve_batch_seconds_count") == 3
    batch = metric(text, "partialvfl_serve_batch_seconds_sum")
    parts = {p: metric(text, "partialvfl_serve_batch_part_seconds_sum", part=p)
             for p in ("coordinator", "party_compute", "wire")}
    assert sum(parts.values()) == pytest.approx(batch, rel=1e-6)
    assert parts["party_compute"] == pytest.approx(3 * 0.004) and parts["coordinator"] >= 3 * 0.002
    assert metric(text, "partialvfl_serve_party_call_seconds_sum", party="bank", part="compute") == \
        pytest.approx(3 * 0.002)
    assert metric(text, "partialvfl_serve_party_call_seconds_count", party="shop", part="wire") == 3
    spans = exporter.get_finished_spans()
    batches = [s for s in spans if s.name == "partialvfl.batch"]
    assert len(batches) == 3
    children = [s for s in spans if s.parent is not None and s.parent.span_id == batches[0].context.span_id]
    assert sorted(s.name for s in children) == ["partialvfl.call", "partialvfl.call", "partialvfl.queue"]
    call = next(s for s in children if s.name == "partialvfl.call" and s.attributes["partialvfl.party"] == "shop")
    assert call.attributes["partialvfl.compute_seconds"] == pytest.approx(0.004)
    assert batches[0].start_time <= call.start_time <= call.end_time <= batches[0].end_time
    assert batches[0].attributes["partialvfl.party_compute_seconds"] == pytest.approx(0.004)

