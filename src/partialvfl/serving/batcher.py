"""Micro-batching: the requests that arrive while a batch is being predicted (or within ``window`` seconds of the
first) become one batch, so each party answers one round for all of them.

One thread owns the predictor: it takes a request, gathers the others queued behind it (up to ``max_ids`` IDs),
predicts their distinct IDs together under the earliest of their deadlines and hands each request its own rows.
Control jobs (a reload) run on the same thread between two batches, so no request is dropped or sees half a model.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partialvfl.serving.predictors import BatchOutcome

__all__ = ["Job", "MicroBatcher"]

log = logging.getLogger("partialvfl.serve")


@dataclass
class Job:
    """One request: distinct normalised IDs, the active party's values for some of them, an absolute deadline."""

    ids: list[str]
    features: dict[str, np.ndarray]
    deadline_at: float | None
    future: Future = field(default_factory=Future)


@dataclass
class _Control:
    run: Callable[[], Any]
    future: Future = field(default_factory=Future)


class MicroBatcher:
    """The service's batch thread over ``predictor`` (anything with ``predict(ids, features, deadline)``).

    ``on_batch(n_requests, n_ids, outcome)`` is called after every batch (metrics).  :meth:`stop` finishes what is
    queued, then ends the thread.
    """

    def __init__(self, predictor: Any, *, window: float = 0.0, max_ids: int = 4096,
                 on_batch: Callable[[int, int, BatchOutcome], None] | None = None) -> None:
        self.predictor = predictor
        self.window = float(window)
        self.max_ids = int(max_ids)
        self.on_batch = on_batch
        self._queue: queue.Queue[Job | _Control | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="serve-batches", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Future:
        self._queue.put(job)
        return job.future

    def control(self, run: Callable[[], Any]) -> Future:
        """Run ``run()`` on the batch thread between two batches; its future holds the result."""
        c = _Control(run)
        self._queue.put(c)
        return c.future

    def stop(self, timeout: float | None = None) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        pending: Job | _Control | None = None
        while True:
            item = pending if pending is not None else self._queue.get()
            pending = None
            if item is None:
                return
            if isinstance(item, _Control):
                _settle(item.future, item.run)
                continue
            batch, pending = self._gather(item)
            self._run(batch)

    def _gather(self, first: Job) -> tuple[list[Job], Job | _Control | None]:
        """``first`` and the jobs queued behind it (waiting up to ``window``); returns the batch and the first item
        that did not fit (a control job, the end, a job with features or one past ``max_ids``)."""
        batch, n = [first], len(first.ids)
        if first.features:
            return batch, None
        until = time.monotonic() + self.window
        while n < self.max_ids:
            wait = until - time.monotonic()
            try:
                item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, Job) or item.features or n + len(item.ids) > self.max_ids:
                return batch, item
            batch.append(item)
            n += len(item.ids)
        return batch, None

    def _run(self, batch: list[Job]) -> None:
        ids = list(dict.fromkeys(i for job in batch for i in job.ids))
        features = {k: v for job in batch for k, v in job.features.items()}
        ends = [job.deadline_at for job in batch if job.deadline_at is not None]
        deadline = max(0.0, min(ends) - time.monotonic()) if ends else None
        try:
            outcome = self.predictor.predict(ids, features, deadline)
        except BaseException as e:  # every request of the batch learns it; the thread goes on
            log.exception("a batch of %d IDs failed", len(ids))
            for job in batch:
                job.future.set_exception(e)
            return
        for job in batch:
            job.future.set_result(outcome)
        if self.on_batch is not None:
            self.on_batch(len(batch), len(ids), outcome)


def _settle(future: Future, run: Callable[[], Any]) -> None:
    try:
        future.set_result(run())
    except BaseException as e:
        future.set_exception(e)
