"""The service's Prometheus metrics (``GET /metrics``), in a registry of their own (one per service)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from partialvfl.serving.predictors import BatchOutcome
from partialvfl.serving.spans import PARTS

__all__ = ["ServiceMetrics"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
ESS_BUCKETS = (1.5, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000)


SPAN_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServiceMetrics:
    """Latency per request, batch sizes (requests and IDs), per-party timeouts and errors, the model version, and
    the spans of each batch (:mod:`partialvfl.serving.spans`): each request's wait in the queue, the batch, its
    coordinator / party compute / wire parts, and each party's compute and wire per call; and for an
    importance-sampling method each prediction's effective sample size (and how many fall below the model's
    ``predict_low_ess``)."""

    def __init__(self, party_names: Sequence[str]) -> None:
        self.party_names = tuple(party_names)
        self.registry = r = CollectorRegistry()
        self.queue = Histogram("partialvfl_serve_queue_seconds", "A request's wait in the service's queue (arrival "
                               "to its batch's start)", buckets=SPAN_BUCKETS, registry=r)
        self.batch_seconds = Histogram("partialvfl_serve_batch_seconds", "A micro-batch's prediction, start to end",
                                       buckets=SPAN_BUCKETS, registry=r)
        self.batch_part = Histogram("partialvfl_serve_batch_part_seconds", "A batch's time along its critical "
                                    "path: coordinator (outside party calls), party_compute (the slowest party's own "
                                    "handling in each round), wire (the rest of each round)", ["part"],
                                    buckets=SPAN_BUCKETS, registry=r)
        self.party_call = Histogram("partialvfl_serve_party_call_seconds", "One call to a party: its compute (as "
                                    "the party reports it) and the wire (the rest of the call)", ["party", "part"],
                                    buckets=SPAN_BUCKETS, registry=r)
        self._parts = {p: self.batch_part.labels(part=p) for p in PARTS}
        self.latency = Histogram("partialvfl_serve_request_seconds", "Time to answer POST /v1/predict",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("partialvfl_serve_requests", "POST /v1/predict requests by HTTP status", ["code"],
                                registry=r)
        self.batch_requests = Histogram("partialvfl_serve_batch_requests", "Requests per micro-batch",
                                        buckets=SIZE_BUCKETS, registry=r)
        self.batch_ids = Histogram("partialvfl_serve_batch_ids", "Distinct IDs per micro-batch", buckets=SIZE_BUCKETS,
                                   registry=r)
        self.timeouts = Counter("partialvfl_serve_party_timeouts", "Batches a party did not answer in time", ["party"],
                                registry=r)
        self.errors = Counter("partialvfl_serve_party_errors", "Batches a party failed (down, restarted)", ["party"],
                              registry=r)
        self.model = Gauge("partialvfl_serve_model_info", "The model version serving (value 1)", ["version"],
                           registry=r)
        self.ess = Histogram("partialvfl_serve_importance_ess", "Effective sample size of each prediction's "
                             "importance weights (methods that predict by importance sampling: FALSE-VFL)",
                             buckets=ESS_BUCKETS, registry=r)
        self.low_ess = Counter("partialvfl_serve_low_ess_predictions", "Predictions whose importance weights' "
                               "effective sample size was below the model's predict_low_ess (they rest on few "
                               "samples)", registry=r)
        self._by_code: dict[int, Counter] = {}  # the requests counter's child per status (a lookup per request)
        for p in party_names:  # every party's series exists from the start (at 0)
            self.timeouts.labels(party=p)
            self.errors.labels(party=p)

    def request(self, seconds: float, code: int) -> None:
        """Count a finished request by status code and record its latency."""
        self.latency.observe(seconds)
        counter = self._by_code.get(code)
        if counter is None:
            counter = self._by_code[code] = self.requests.labels(code=str(code))
        counter.inc()

    def batch(self, n_requests: int, n_ids: int, outcome: BatchOutcome) -> None:
        """Record a batch: its requests and IDs, the parties that timed out or failed, its ESS and its spans."""
        self.batch_requests.observe(n_requests)
        self.batch_ids.observe(n_ids)
        for p in outcome.timed_out:
            self.timeouts.labels(party=p).inc()
        for p in outcome.failed:
            self.errors.labels(party=p).inc()
        if outcome.ess is not None and len(outcome.ess):
            for value in outcome.ess:
                self.ess.observe(float(value))
            low = int((outcome.ess < outcome.low_ess).sum())
            if low:
                self.low_ess.inc(low)
        timing = outcome.timing
        if timing is None:
            return
        for wait in timing.queue():
            self.queue.observe(wait)
        self.batch_seconds.observe(timing.seconds)
        if not timing.calls:  # in process: the whole batch is the model's computation here
            return
        for part, seconds in timing.parts().items():
            self._parts[part].observe(seconds)
        for c in timing.calls:
            if c.ok:
                name = self.party_names[c.party]
                self.party_call.labels(party=name, part="compute").observe(c.party_seconds)
                self.party_call.labels(party=name, part="wire").observe(c.wire_seconds)

    def set_version(self, version: str) -> None:
        """Show ``version`` as the served model's version."""
        self.model.clear()
        self.model.labels(version=version).set(1)

    def render(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
