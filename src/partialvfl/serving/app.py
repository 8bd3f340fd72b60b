"""The HTTP JSON API of the prediction service (FastAPI on uvicorn; the OpenAPI schema at ``/openapi.json``).

* ``POST /v1/predict``: ``{"ids": [...], "features": {ID: {column: value}}, "deadline_ms": 50,
  "allow_prior_only": false}`` -> per ID its status, class, probabilities and the parties used, with the model
  version and the parties that timed out or failed for this request;
* ``GET /healthz`` (the process answers), ``GET /readyz`` (a model is loaded; the parties' last known state),
  ``GET /metrics`` (Prometheus text: latency histogram, batch sizes, per-party timeouts and errors);
* ``POST /admin/reload``: load a new model version between two batches (no request is dropped);
* ``POST /v1/explain``: ``{"ids": [...], "features": {...}, "class": LABEL, "permutations": N}`` -> per ID each
  party's contribution to its prediction (:mod:`partialvfl.methods.explain`), computed between two batches.

Bad input is a 4xx whose ``error`` names the field (``ids[3]``, ``features.17.income``, ``body``); a bearer token
(``--token-file``) guards ``/v1`` and ``/admin``.  Every request is logged as one JSON line (``partialvfl.access``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from partialvfl.data.dataset import DataValidationError
from partialvfl.data.ids import normalize_ids, show_id
from partialvfl.federation.wire.transport import PartiesRefused
from partialvfl.serving.batcher import Job, LoopBatcher, MicroBatcher
from partialvfl.serving.metrics import ServiceMetrics
from partialvfl.serving.predictors import NO_ANSWER, OK, UNKNOWN, BatchOutcome, FeatureError

__all__ = ["ServiceConfig", "create_app"]

access_log = logging.getLogger("partialvfl.access")


@dataclass(frozen=True)
class ServiceConfig:
    """The service's limits and options (the ``serve`` flags)."""

    token: str | None = None
    max_ids: int = 1000
    max_body_bytes: int = 1 << 20
    deadline: float | None = None  # seconds; None: the federation file's deadline (no deadline in process)
    batch_window: float | None = None  # seconds; None: in process AUTO_WINDOW under load, across a federation 0
    max_batch_ids: int = 4096
    otel_traces: str | None = None  # export each batch's spans as OpenTelemetry traces: otlp, console or a file


class PredictRequest(BaseModel):
    """A prediction request."""

    model_config = ConfigDict(extra="forbid")
    ids: list[StrictStr | StrictInt] = Field(min_length=1, description="the users to predict")
    features: dict[str, dict[str, StrictInt | StrictFloat | StrictStr | None]] = Field(
        default_factory=dict, description="the active party's own feature values by ID, for users not in its table "
                                          "(in-process mode only)")
    deadline_ms: float | None = Field(default=None, gt=0, description="parties not answering within it are "
                                                                      "missing blocks for this request")
    allow_prior_only: bool = Field(default=False, description="IDs no party (that answered) holds get the training "
                                                              "label prior instead of an error status")


class ExplainRequest(BaseModel):
    """An explanation request: each party's contribution to the predictions of these users."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    ids: list[StrictStr | StrictInt] = Field(min_length=1, description="the users whose predictions to explain")
    features: dict[str, dict[str, StrictInt | StrictFloat | StrictStr | None]] = Field(
        default_factory=dict, description="the active party's own feature values by ID, for users not in its table")
    explained_class: StrictStr | StrictInt | None = Field(
        default=None, alias="class", description="the class whose probability to explain (default: each user's "
                                                 "predicted class)")
    permutations: StrictInt | None = Field(default=None, ge=2, le=10_000, description="a permutation estimate "
                                           "with this many orders (default: exact up to 10 parties)")


_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _field(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a JSON field path (``ids[2]``, ``features.17.income``)."""
    if len(loc) > 1 and loc[-1] in _UNION_TAGS:  # which member of a union failed: not part of the field
        loc = loc[:-1]
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


class BodyLimit:
    """Refuses a body over ``limit`` bytes (declared or streamed) with 413 before the route reads it."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_big(scope, receive, send)
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooBig
            return message

        try:
            await self.app(scope, limited, send)
        except _TooBig:
            await self._too_big(scope, receive, send)

    async def _too_big(self, scope: dict, receive: Callable, send: Callable) -> None:
        await _error(413, f"body: more than {self.limit} bytes (--max-body-bytes)")(scope, receive, send)


def _header(scope: dict, name: bytes) -> bytes | None:
    """A request header's value (``name`` in lower case, as ASGI gives them), the first if repeated."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


class _TooBig(Exception):
    pass


class PredictRoute:
    """``POST /v1/predict`` answered straight from ASGI: the body read, ``answer(body, authorization)`` awaited, its
    response sent.  FastAPI's routing, dependency injection and request objects are not needed for one JSON body in
    and one out, and measured about a quarter of the service's time per request (issue 34); the route FastAPI
    declares for the same path documents it (OpenAPI) and answers alike.  Everything else goes on to FastAPI."""

    def __init__(self, app: Any, answer: Callable[[bytes, str | None], Awaitable[Any]]) -> None:
        self.app, self.answer = app, answer

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/predict" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client is gone: nothing to answer
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        authorization = _header(scope, b"authorization")
        response = await self.answer(b"".join(chunks), None if authorization is None else authorization.decode(
            "latin-1"))
        await response(scope, receive, send)


class AccessLog:
    """Logs every request as one JSON line (``partialvfl.access``) and times ``POST /v1/predict`` for the metrics.

    Plain ASGI (it only watches the response's status go by): Starlette's ``@app.middleware("http")`` runs every
    request through a task group and a memory stream, which measured a tenth of the service's time per request."""

    def __init__(self, app: Any, metrics: ServiceMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500  # what the server answers if the application raises before it starts a response

        async def watched(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            seconds = time.perf_counter() - t0
            path = scope.get("path", "")
            if path == "/v1/predict":
                self.metrics.request(seconds, status)
            client = scope.get("client")
            access_log.info(json.dumps({"time": round(time.time(), 3), "method": scope.get("method"), "path": path,
                                        "status": status, "ms": round(1000 * seconds, 2),
                                        "client": client[0] if client else None}))


def _validation_error(errors: Sequence[Any]) -> JSONResponse:
    """422 naming the first wrong field (``ids[2]``, ``deadline_ms``), every one (up to 20) under ``errors``."""
    by_field: dict[str, list[str]] = {}
    for e in errors:
        by_field.setdefault(_field(tuple(e.get("loc", ()))), []).append(str(e.get("msg")))
    listed = [{"field": f, "message": " or ".join(m)} for f, m in list(by_field.items())[:20]]
    return _error(422, f"{listed[0]['field']}: {listed[0]['message']}", errors=listed)


class ReloadRequest(BaseModel):
    """A reload: the saved model directory to serve next (default: the serving one, read again)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(default=None, description="a saved model directory (default: the one serving)")


def _json_value(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


def create_app(predictor: Any, config: ServiceConfig | None = None, *, tracer_provider: Any = None) -> FastAPI:
    """The service over ``predictor`` (:mod:`partialvfl.serving.predictors`); started and stopped with the app.
    ``tracer_provider``: an OpenTelemetry SDK tracer provider for the batches' spans (else one made for
    ``config.otel_traces``, if set; shut down with the app)."""
    cfg = config or ServiceConfig()
    metrics = ServiceMetrics(predictor.party_names)
    metrics.set_version(predictor.version)
    tracer = None
    if tracer_provider is None and cfg.otel_traces:
        from partialvfl.serving.tracing import tracer_provider as make_provider

        tracer_provider = make_provider(cfg.otel_traces)
    if tracer_provider is not None:
        from partialvfl.serving.tracing import BatchTracer

        tracer = BatchTracer(tracer_provider, predictor.party_names)

    def on_batch(n_requests: int, n_ids: int, outcome: Any) -> None:
        metrics.batch(n_requests, n_ids, outcome)
        if tracer is not None:
            tracer.batch(n_requests, n_ids, outcome)

    if getattr(predictor, "on_event_loop", False):
        batcher: MicroBatcher | LoopBatcher = LoopBatcher(predictor, window=cfg.batch_window,
                                                          max_ids=cfg.max_batch_ids, on_batch=on_batch)
    else:
        batcher = MicroBatcher(predictor, window=cfg.batch_window or 0.0, max_ids=cfg.max_batch_ids,
                               on_batch=on_batch)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # FastAPI's lifespan protocol
        yield
        await asyncio.to_thread(batcher.stop)  # in-flight requests finished (uvicorn waits for them), queue empty
        close = getattr(batcher.predictor, "close", None)
        if close is not None:
            close()
        if tracer is not None:
            tracer.shutdown()

    app = FastAPI(title="partialvfl prediction service", version="1", lifespan=lifespan,
                  description="Predictions from whichever parties answer in time (any-subset prediction).")
    app.state.batcher, app.state.metrics, app.state.config = batcher, metrics, cfg

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return _error(400, f"body: malformed JSON ({first.get('ctx', {}).get('error', first.get('msg'))})")
        return _validation_error(exc.errors())

    def token_refusal(authorization: str | None) -> JSONResponse | None:
        """The 401 for a request without the bearer token (``--token-file``), if one is required."""
        if cfg.token is None:
            return None
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), cfg.token.encode()):
            return JSONResponse({"error": "Authorization: a valid bearer token is required"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        return None

    async def authorized(authorization: str | None = Header(default=None)) -> None:  # async: no worker thread
        refused = token_refusal(authorization)
        if refused is not None:
            raise HTTPException(401, "Authorization: a valid bearer token is required",
                                headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    async def answer(raw: bytes, authorization: str | None) -> JSONResponse:
        """``POST /v1/predict``: the answer to a request body (read as JSON whatever its content type)."""
        refused = token_refusal(authorization)
        if refused is not None:
            return refused
        try:
            body = PredictRequest.model_validate(json.loads(raw))
        except json.JSONDecodeError as e:
            return _error(400, f"body: malformed JSON ({e})")
        except UnicodeDecodeError:
            return _error(400, "body: not UTF-8 text")
        except ValidationError as e:
            return _validation_error(e.errors())
        if len(body.ids) > cfg.max_ids:
            return _error(413, f"ids: {len(body.ids)} IDs exceed the limit of {cfg.max_ids} per request (--max-ids)")
        try:
            keys = _distinct_ids(body.ids)
            features = batcher.predictor.check_features(body.features, keys)
        except FeatureError as e:
            return _error(422, str(e))
        except DataValidationError as e:
            return _error(422, str(e))
        deadline = body.deadline_ms / 1000 if body.deadline_ms is not None else cfg.deadline
        job = Job(keys, features, None if deadline is None else time.monotonic() + deadline)
        try:
            submitted = batcher.submit(job)
            outcome = await (submitted if isinstance(submitted, asyncio.Future) else asyncio.wrap_future(submitted))
        except FeatureError as e:
            return _error(422, str(e))
        except Exception as e:  # the batch failed as a whole: say so, the service goes on
            return _error(503, f"prediction failed: {type(e).__name__}: {e}")
        return JSONResponse(_response(batcher.predictor, body, keys, outcome))

    # each added middleware wraps the ones before: the access log outermost (it sees the body limit's 413 too)
    app.add_middleware(PredictRoute, answer=answer)
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)
    app.add_middleware(AccessLog, metrics=metrics)

    @app.post("/v1/predict", dependencies=[Depends(authorized)],
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": PredictRequest.model_json_schema()}}}})
    async def predict(request: Request) -> JSONResponse:
        """Predict the given IDs from the parties that answer within the deadline (any content type: the body is
        read as JSON).  Declared here for the OpenAPI schema; :class:`PredictRoute` answers before routing."""
        return await answer(await request.body(), request.headers.get("authorization"))

    @app.post("/v1/explain", dependencies=[Depends(authorized)],
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": ExplainRequest.model_json_schema(by_alias=True)}}}})
    async def explain(request: Request) -> JSONResponse:
        """Each party's contribution to the predictions of the given IDs (exact Shapley values of the predicted
        class's probability and log-odds), computed between two batches; a party whose policy refuses explanations,
        or whose lookup budget they would exceed, makes it a 403 naming the party and the rule."""
        try:
            body = ExplainRequest.model_validate(json.loads(await request.body()))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"body: malformed JSON ({e})")
        except ValidationError as e:
            return _validation_error(e.errors())
        if len(body.ids) > cfg.max_ids:
            return _error(413, f"ids: {len(body.ids)} IDs exceed the limit of {cfg.max_ids} per request (--max-ids)")
        try:
            keys = _distinct_ids(body.ids)
            features = batcher.predictor.check_features(body.features, keys)
        except (FeatureError, DataValidationError) as e:
            return _error(422, str(e))
        options = {"explained_class": body.explained_class, "permutations": body.permutations}
        try:
            outcome = await asyncio.wrap_future(batcher.control(
                lambda: batcher.predictor.explain(keys, features, **options)))
        except ValueError as e:  # features refused, a class the model lacks, a method that cannot explain
            return _error(422, str(e))
        except PartiesRefused as e:
            return _error(403, str(e))
        except Exception as e:  # the explanation failed as a whole: say so, the service goes on
            return _error(503, f"explanation failed: {type(e).__name__}: {e}")
        return JSONResponse(_explain_response(batcher.predictor, body, keys, outcome))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """The process answers."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """A model is loaded; each party's last known state (``ok``, ``timed_out``, ``down``)."""
        p = batcher.predictor
        parties = dict(getattr(p, "state", {}) or dict.fromkeys(p.party_names, "ok"))
        ready = any(s != "down" for s in parties.values())
        return JSONResponse({"ready": ready, "model_version": p.version, "parties": parties},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        """Prometheus text format."""
        body, content_type = metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    @app.post("/admin/reload", dependencies=[Depends(authorized)],
              openapi_extra={"requestBody": {"content": {"application/json": {
                  "schema": ReloadRequest.model_json_schema()}}}})
    async def reload(request: Request) -> JSONResponse:
        """Load a model version between two batches; requests wait for it, none is dropped."""
        raw = await request.body()
        try:
            target = ReloadRequest.model_validate(json.loads(raw) if raw.strip() else {}).model
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"body: malformed JSON ({e})")
        except ValidationError as e:
            return _validation_error(e.errors())
        try:
            version = await asyncio.wrap_future(reload_model(batcher, target))
        except Exception as e:  # the old model keeps serving
            return _error(422, f"model: {type(e).__name__}: {e} (the previous model keeps serving)")
        metrics.set_version(version)
        return JSONResponse({"model_version": version})

    return app


def reload_model(batcher: MicroBatcher | LoopBatcher, model_dir: str | None) -> Any:
    """Swap the batcher's predictor for one with the model at ``model_dir`` (default: the current one again), on
    the batch thread; the future holds the new version."""
    def run() -> str:
        current = batcher.predictor
        target = model_dir or current.model_dir
        batcher.predictor = current.reloaded(target)
        return batcher.predictor.version

    return batcher.control(run)


def _explain_response(predictor: Any, body: ExplainRequest, keys: list[str], outcome: Any) -> dict[str, Any]:
    """Per ID: its status and, for an ID some party holds, its prediction and each party's contribution."""
    expl = outcome.explanation
    results = []
    for raw, key in zip(body.ids, keys):
        row = outcome.row_of.get(key)
        if row is None or expl is None:
            results.append({"id": raw, "status": UNKNOWN, "parties": [],
                            "error": "no party (that answered) holds it: nothing to explain"})
            continue
        results.append({"id": raw, "status": OK, **expl.row(row)})
    return {"model_version": predictor.version, "method": predictor.model.name,
            "estimate": expl.estimate if expl is not None else None,
            "permutations": expl.permutations if expl is not None else None,
            "parties_absent": outcome.absent, "results": results}


def _distinct_ids(ids: list[str | int]) -> list[str]:
    keys = normalize_ids(ids, "ids", unique=False)
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        j = first.setdefault(k, i)
        if j != i:
            raise DataValidationError(f"ids[{i}]: {show_id(ids[i])} repeats ids[{j}]")
    return keys


def _response(predictor: Any, body: PredictRequest, keys: list[str], outcome: BatchOutcome) -> dict[str, Any]:
    task = predictor.model.index_.task
    classes = [_json_value(c) for c in task.classes] if task.is_classification else None
    results = []
    for raw, key in zip(body.ids, keys):
        status, row = outcome.status[key], outcome.output.get(key)
        item: dict[str, Any] = {"id": raw, "status": status, "parties": outcome.parties[key]}
        if status != OK:
            held = "the parties holding it did not answer in time" if status == NO_ANSWER else "no party holds it"
            if not body.allow_prior_only:
                item["error"] = f"{held}; pass allow_prior_only for the training label prior"
                results.append(item)
                continue
            item["status"], row = "prior_only", predictor.prior()
        if classes is not None and row is not None:
            item["prediction"] = classes[int(np.argmax(row))]
            item["probabilities"] = {str(c): float(p) for c, p in zip(classes, row)}
        elif row is not None:
            item["prediction"] = float(np.ravel(row)[0])
        results.append(item)
    return {"model_version": predictor.version, "parties_timed_out": outcome.timed_out,
            "parties_failed": outcome.failed, "results": results}
