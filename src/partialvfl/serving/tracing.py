"""OpenTelemetry traces of the service's batches, opt in (``partialvfl serve --otel-traces ...``; the ``otel`` extra:
``opentelemetry-sdk``).

Each micro-batch is one trace: a ``partialvfl.batch`` span from its start to its end, with a ``partialvfl.queue``
child (from its first request's arrival to the batch's start) and one ``partialvfl.call`` child per call to a party
(its compute and wire seconds as attributes); the batch's attributes give its requests, IDs, lane and its
coordinator / party-compute / wire parts (:mod:`partialvfl.serving.spans`).  The spans are made after the batch,
from the instants it recorded, so tracing adds nothing to a batch's own path but the export (batched, on the SDK's
thread).  Exporters: ``otlp`` (the ``opentelemetry-exporter-otlp`` package, configured by the usual ``OTEL_*``
environment variables), ``console`` (JSON on stderr), or a file path (one JSON span per line).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from partialvfl.serving.predictors import BatchOutcome

__all__ = ["BatchTracer", "tracer_provider"]


def tracer_provider(target: str) -> Any:
    """An SDK tracer provider exporting to ``target`` (``otlp``, ``console`` or a file path) in batches."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as e:
        raise ImportError("OpenTelemetry traces need the SDK: pip install 'partialvfl[otel]'") from e
    if target == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise ImportError("--otel-traces otlp needs the OTLP exporter: pip install "
                              "opentelemetry-exporter-otlp (or give 'console' or a file path)") from e
        exporter: Any = OTLPSpanExporter()
    else:
        out = sys.stderr if target == "console" else open(target, "a", encoding="utf-8")  # noqa: SIM115 - the
        # provider's exporter owns it until shutdown
        exporter = ConsoleSpanExporter(out=out, formatter=lambda span: json.dumps(json.loads(span.to_json())) + "\n")
    provider = TracerProvider(resource=Resource.create({"service.name": "partialvfl-serve"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class BatchTracer:
    """Turns each batch's :class:`~partialvfl.serving.spans.BatchTiming` into spans of ``provider``'s tracer."""

    def __init__(self, provider: Any, party_names: Sequence[str]) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("partialvfl.serving")
        self.party_names = tuple(party_names)
        # perf_counter instants -> wall-clock nanoseconds (OpenTelemetry's clock)
        self._offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)

    def _ns(self, instant: float) -> int:
        return self._offset_ns + int(instant * 1e9)

    def batch(self, n_requests: int, n_ids: int, outcome: BatchOutcome) -> None:
        """The spans of one batch (called after it, with its outcome)."""
        from opentelemetry import trace

        timing = outcome.timing
        if timing is None:
            return
        parts = timing.parts() if timing.calls else {}
        attrs = {"partialvfl.requests": n_requests, "partialvfl.ids": n_ids, "partialvfl.lane": timing.lane,
                 "partialvfl.parties_timed_out": list(outcome.timed_out),
                 **{f"partialvfl.{k}_seconds": v for k, v in parts.items()}}
        root = self.tracer.start_span("partialvfl.batch", start_time=self._ns(timing.started), attributes=attrs)
        context = trace.set_span_in_context(root)
        queue = timing.queue()
        if timing.arrivals:
            span = self.tracer.start_span("partialvfl.queue", context=context,
                                          start_time=self._ns(min(timing.arrivals)),
                                          attributes={"partialvfl.requests": len(queue),
                                                      "partialvfl.max_wait_seconds": max(queue)})
            span.end(end_time=self._ns(timing.started))
        for c in timing.calls:
            span = self.tracer.start_span("partialvfl.call", context=context, start_time=self._ns(c.start),
                                          attributes={"partialvfl.party": self.party_names[c.party],
                                                      "partialvfl.kind": c.kind, "partialvfl.ok": c.ok,
                                                      "partialvfl.compute_seconds": c.party_seconds,
                                                      "partialvfl.wire_seconds": c.wire_seconds})
            span.end(end_time=self._ns(c.end))
        root.end(end_time=self._ns(timing.ended))

    def shutdown(self) -> None:
        """Export what is left and stop the exporter."""
        self.provider.shutdown()
