"""Parties of one in-process round answering at the same time: a thread each, and on a GPU a CUDA stream each.

In one process every party's handler runs in the coordinator's process.  Answered one after another, a round of K
parties costs K times one party's host work (Python, operator dispatch, kernel launches), and on a GPU the device
idles while the host prepares the next party's kernels: with small per-party networks the step is bound by the host,
not by the GPU (``docs/results/gpu.md``, "Keeping the GPU busy").  :class:`ConcurrentParties` answers the round's
requests in a thread per party instead, so one party's Python work overlaps another's dispatch (torch releases the
GIL inside its operators), and on a CUDA device each party computes on its own stream, so their kernels can overlap
on the GPU too.

What it keeps: each party runs only its own handler on its own data, and its operations run in the same order as
when answered alone; a party's floats do not depend on the others', so the results are those of the one-by-one path
on the same device (on the CPU bit for bit: ``tests/test_concurrent_parties.py``).  Streams are ordered as the
one-by-one path orders them: a party's stream waits for the work the coordinator queued before the round (its
request tensors), and the coordinator's stream waits for every party's before it reads a reply.  A tensor that
crosses streams is only freed after that ordering point (the coordinator is blocked during a round), so the caching
allocator cannot hand its memory to another stream while it is read.

Only programs that say they can run so (:attr:`~partialvfl.federation.wire.program.PartyProgram.answers_concurrently`:
no process-wide state in their handlers, such as torch's global random generator) and only their own kinds (never
``setup``, which seeds the global generator) are answered concurrently; parties with a differential-privacy budget
are answered alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["ConcurrentParties", "concurrent_default"]


def concurrent_default(devices: Sequence[torch.device]) -> bool:
    """Whether parties on ``devices`` answer concurrently when the caller does not say: on CUDA devices (where a
    step is bound by the host's dispatch), not on the CPU (where the parties' kernels already share its cores and
    the one-by-one path is the reference)."""
    return bool(devices) and all(torch.device(d).type == "cuda" for d in devices)


class ConcurrentParties:
    """A thread per party (created on first use) and, for a party on a CUDA device, its own stream."""

    def __init__(self, n_parties: int) -> None:
        self.n_parties = n_parties
        self._pool: ThreadPoolExecutor | None = None
        self._streams: dict[int, Any] = {}

    def _stream(self, party: int, device: torch.device) -> Any:
        stream = self._streams.get(party)
        if stream is None:
            stream = self._streams[party] = torch.cuda.Stream(device=device)
        return stream

    def run(self, calls: dict[int, tuple[torch.device, Callable[[], Any]]]) -> dict[int, Any]:
        """Run ``calls`` (party -> (its device, the delivery)) at the same time; every party's result, or the
        exception it raised, once all have finished (a failure never leaves another party's handler running)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(1, self.n_parties), thread_name_prefix="party")
        grad = torch.is_grad_enabled()  # thread-local: the round runs in the caller's mode, as one by one
        callers = {}  # device -> the coordinator's current stream there (what the parties' streams wait for)
        for device, _ in calls.values():
            if device.type == "cuda" and device not in callers:
                callers[device] = torch.cuda.current_stream(device)
        futures: dict[int, Future] = {}
        for party, (device, call) in calls.items():
            stream = self._stream(party, device) if device.type == "cuda" else None
            futures[party] = self._pool.submit(_on_stream, call, grad, stream, callers.get(device))
        out: dict[int, Any] = {}
        for party, future in futures.items():
            try:
                out[party] = future.result()
            except Exception as e:  # handed back in its place, raised where the caller would
                out[party] = e
        for party, (device, _) in calls.items():  # the coordinator reads the replies after the parties' work
            if party in self._streams and device in callers:
                callers[device].wait_stream(self._streams[party])
        return out

    def close(self) -> None:
        """Stop the threads (idle ones: a round has always finished)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _on_stream(call: Callable[[], Any], grad: bool, stream: Any, caller: Any) -> Any:
    """``call()`` in this worker thread with the caller's grad mode, on ``stream`` after the caller's work."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad))
        if stream is not None:
            stream.wait_stream(caller)  # the request's tensors were queued on the caller's stream
            stack.enter_context(torch.cuda.stream(stream))
        return call()
