"""Micro-batching: the requests that arrive while a batch is being predicted (or within ``window`` seconds of the
first) become one batch, so each party answers one round for all of them.

Across a federation (:class:`MicroBatcher`), one thread per *lane* (``predictor.lanes``: several batches in flight
at once): each takes a request, gathers the others queued behind it (up to ``max_ids`` IDs), predicts their distinct
IDs together under the earliest of their deadlines on its lane and hands each request its own rows.  Control jobs (a
reload) and the predictor's own upkeep (``predictor.due()`` / ``maintain()``: a party that came back joined again)
run with no batch in flight, between two batches, so no request is dropped or sees half a model.  In process
(:class:`LoopBatcher`), the batches are predicted on the event loop itself, between two turns of it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partialvfl.serving.predictors import BatchOutcome
from partialvfl.serving.spans import BatchTiming

__all__ = ["AUTO_WINDOW", "Job", "LoopBatcher", "MicroBatcher"]

log = logging.getLogger("partialvfl.serve")
#: seconds the first request of an in-process batch waits for others once requests arrive together
AUTO_WINDOW = 0.002


@dataclass
class Job:
    """One request: distinct normalised IDs, the active party's values for some of them, an absolute deadline."""

    ids: list[str]
    features: dict[str, np.ndarray]
    deadline_at: float | None
    future: Future = field(default_factory=Future)  # an asyncio future with LoopBatcher
    arrived: float = field(default_factory=time.perf_counter)  # when it was queued (the queue span)


@dataclass
class _Control:
    run: Callable[[], Any]
    future: Future = field(default_factory=Future)


class MicroBatcher:
    """The service's batch threads over ``predictor`` (anything with ``predict(ids, features, deadline)``; with
    ``lanes`` > 1, ``predict(ids, features, deadline, lane=i)`` on thread ``i``; with ``due()`` and ``maintain()``,
    its upkeep between batches).

    ``on_batch(n_requests, n_ids, outcome)`` is called after every batch (metrics).  :meth:`stop` finishes what is
    queued, then ends the threads.
    """

    def __init__(self, predictor: Any, *, window: float = 0.0, max_ids: int = 4096,
                 on_batch: Callable[[int, int, BatchOutcome], None] | None = None) -> None:
        self.predictor = predictor
        self.window = float(window)
        self.max_ids = int(max_ids)
        self.on_batch = on_batch
        self.lanes = max(1, int(getattr(predictor, "lanes", 1)))
        self._queue: queue.Queue[Job | _Control | None] = queue.Queue()
        self._state = threading.Condition()
        self._in_flight = 0  # batches being predicted
        self._exclusive = False  # a control job or the upkeep runs: no batch starts
        self._threads = [threading.Thread(target=self._loop, args=(lane,), daemon=True,
                                          name="serve-batches" if lane == 0 else f"serve-batches-{lane}")
                         for lane in range(self.lanes)]
        for t in self._threads:
            t.start()

    def submit(self, job: Job) -> Future:
        """Queue ``job`` for the next batch; its future gets the job's answer."""
        self._queue.put(job)
        return job.future

    def control(self, run: Callable[[], Any]) -> Future:
        """Run ``run()`` on the batch thread between two batches; its future holds the result."""
        c = _Control(run)
        self._queue.put(c)
        return c.future

    def stop(self, timeout: float | None = None) -> None:
        """Stop the batching threads after the jobs already queued (waiting up to ``timeout`` each)."""
        self._queue.put(None)  # each thread passes it on to the next
        for t in self._threads:
            t.join(timeout)

    # ------------------------------------------------------------------ the threads
    def _loop(self, lane: int) -> None:
        pending: Job | _Control | None = None
        while True:
            item = pending if pending is not None else self._queue.get()
            pending = None
            if item is None:
                self._queue.put(None)
                return
            if isinstance(item, _Control):
                with self._alone():
                    _settle(item.future, item.run)
                continue
            batch, pending = self._gather(item)
            self._upkeep()
            with self._state:
                while self._exclusive:
                    self._state.wait()
                self._in_flight += 1
            try:
                self._run(batch, lane)
            finally:
                with self._state:
                    self._in_flight -= 1
                    self._state.notify_all()

    @contextmanager
    def _alone(self) -> Iterator[None]:
        """Hold every lane: wait for the batches in flight, start none until the block ends."""
        with self._state:
            while self._exclusive:
                self._state.wait()
            self._exclusive = True
            while self._in_flight:
                self._state.wait()
        try:
            yield
        finally:
            with self._state:
                self._exclusive = False
                self._state.notify_all()

    def _upkeep(self) -> None:
        """The predictor's upkeep (a party that came back joined again), alone, when it says it is due."""
        due = getattr(self.predictor, "due", None)
        if due is None or not due():
            return
        with self._alone():
            if due():  # another lane may have done it meanwhile
                try:
                    self.predictor.maintain()
                except Exception:  # the batches go on without the returned party; tried again later
                    log.exception("the predictor's upkeep failed")

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

    def _run(self, batch: list[Job], lane: int = 0) -> None:
        _predict(self.predictor, batch, lane, self.lanes, self.on_batch)


def _predict(predictor: Any, batch: list[Job], lane: int, lanes: int,
             on_batch: Callable[[int, int, BatchOutcome], None] | None) -> None:
    """Predict ``batch``'s distinct IDs together under the earliest of its deadlines; settle each job's future."""
    timing = BatchTiming([job.arrived for job in batch], time.perf_counter(), lane=lane)
    ids = list(dict.fromkeys(i for job in batch for i in job.ids))
    features = {k: v for job in batch for k, v in job.features.items()}
    ends = [job.deadline_at for job in batch if job.deadline_at is not None]
    deadline = max(0.0, min(ends) - time.monotonic()) if ends else None
    try:
        outcome = (predictor.predict(ids, features, deadline, lane=lane) if lanes > 1
                   else predictor.predict(ids, features, deadline))
    except BaseException as e:  # every request of the batch learns it; the service goes on
        log.exception("a batch of %d IDs failed", len(ids))
        for job in batch:
            job.future.set_exception(e)
        return
    timing.ended, timing.calls = time.perf_counter(), outcome.calls
    outcome.timing = timing
    for job in batch:
        job.future.set_result(outcome)
    if on_batch is not None:
        on_batch(len(batch), len(ids), outcome)


def _settle(future: Future, run: Callable[[], Any]) -> None:
    try:
        future.set_result(run())
    except BaseException as e:
        future.set_exception(e)


class LoopBatcher:
    """Micro-batching on the event loop itself, for a predictor that computes in this process (``--table``).

    A request's job waits in a list; the first one schedules a flush, and every request read meanwhile joins its
    batch, which is predicted right there, on the loop.  The flush comes after the callbacks already due when
    requests arrive one at a time; once a batch held several (requests arrive together: the load is up), the first
    one waits ``window`` seconds (default :data:`AUTO_WINDOW`) for the others, which measured half the CPU per request
    at 16 clients (issue 34).  No batch thread: a thread would only hand
    the one interpreter lock back and forth with the loop (in process the prediction is computation, not waiting),
    which measured twice the CPU per batch (issue 34).  Control jobs (a reload, which reads files) run on a thread
    of their own while no batch runs: the requests that arrive meanwhile wait, none is dropped.  The interface is
    :class:`MicroBatcher`'s; ``submit`` must be called on the loop.
    """

    def __init__(self, predictor: Any, *, window: float | None = None, max_ids: int = 4096,
                 on_batch: Callable[[int, int, BatchOutcome], None] | None = None) -> None:
        self.predictor = predictor
        self.window = AUTO_WINDOW if window is None else float(window)
        self.always_wait = window is not None  # a window asked for waits before every batch
        self.max_ids = int(max_ids)
        self.on_batch = on_batch
        self.lanes = 1
        self._pending: deque[Job] = deque()
        self._scheduled = False
        self._controls: deque[_Control] = deque()  # waiting for their turn (one at a time, no batch meanwhile)
        self._controlling = False
        self._last_size = 0  # requests in the last batch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._control_thread = ThreadPoolExecutor(1, thread_name_prefix="serve-control")

    def submit(self, job: Job) -> asyncio.Future:
        """Queue ``job`` (on the loop); its answer comes in an asyncio future (set on the loop: no thread hop)."""
        self._loop = asyncio.get_running_loop()
        job.future = self._loop.create_future()  # type: ignore[assignment]
        self._pending.append(job)
        self._schedule()
        return job.future  # type: ignore[return-value]

    def control(self, run: Callable[[], Any]) -> Future:
        """Run ``run()`` on a thread while no batch runs; its future holds the result (callable from any thread)."""
        c = _Control(run)
        if self._loop is None:  # nothing served yet: no batch can be running
            _settle(c.future, run)
            return c.future
        self._loop.call_soon_threadsafe(self._enqueue_control, c)
        return c.future

    def stop(self, timeout: float | None = None) -> None:
        """Let a running control job finish (uvicorn has answered every request before the app stops)."""
        self._control_thread.shutdown(wait=True)

    # ------------------------------------------------------------------ on the loop
    def _schedule(self) -> None:
        if self._scheduled or self._controlling or not self._pending:
            return
        self._scheduled = True
        assert self._loop is not None
        if self.window > 0 and (self.always_wait or self._last_size > 1):
            self._loop.call_later(self.window, self._flush)
        else:
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self._controlling:
            return
        pending = self._pending
        while pending:
            batch = [pending.popleft()]
            n = len(batch[0].ids)
            while not batch[0].features and pending and not pending[0].features \
                    and n + len(pending[0].ids) <= self.max_ids:
                n += len(pending[0].ids)
                batch.append(pending.popleft())
            _predict(self.predictor, batch, 0, 1, self.on_batch)
            self._last_size = len(batch)
            if pending and self.window > 0 and (self.always_wait or self._last_size > 1):
                break  # the rest waits for its own window
        self._schedule()

    def _enqueue_control(self, c: _Control) -> None:
        self._controls.append(c)
        if not self._controlling:
            self._next_control()

    def _next_control(self) -> None:
        if not self._controls:
            self._controlling = False
            self._schedule()
            return
        self._controlling = True
        c = self._controls.popleft()
        assert self._loop is not None
        loop = self._loop

        def run() -> None:
            _settle(c.future, c.run)
            loop.call_soon_threadsafe(self._next_control)

        self._control_thread.submit(run)
