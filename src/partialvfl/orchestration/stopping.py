"""Stopping a fit cleanly: a request to checkpoint at the next step boundary and stop, from a signal or a caller.

A :class:`StopRequest` passed to :func:`~partialvfl.orchestration.fit.run_fit` reaches the fit's checkpointer; the
training loop then checkpoints after the step in progress and raises
:class:`~partialvfl.federation.runtime.checkpoint.FitInterrupted` (a resume with the same options continues from there).
:func:`stop_on_signals` is the opt-in context manager that turns SIGINT/SIGTERM into such a request, as the
``partialvfl fit`` command does; a service may instead call :meth:`StopRequest.request` from another thread.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from partialvfl.federation.runtime.checkpoint import Checkpointer

__all__ = ["StopRequest", "stop_on_signals"]


class StopRequest:
    """Ask a running fit to checkpoint at the next step boundary and stop.

    :meth:`request` only sets flags, so it is safe in a signal handler and from another thread; a request made
    before the fit starts stops it after its first step.
    """

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._checkpointers: list[Checkpointer] = []

    def request(self, signum: int | None = None) -> None:
        """Stop at the next step boundary (``signum``: the signal that asked, reported by ``FitInterrupted``)."""
        self.signum = signum
        self.requested = True
        for ck in list(self._checkpointers):
            ck.request_stop(signum)

    def attach(self, checkpointer: Checkpointer) -> None:
        """Route this request to ``checkpointer`` (a fit does this with its own)."""
        self._checkpointers.append(checkpointer)
        if self.requested:
            checkpointer.request_stop(self.signum)


@contextmanager
def stop_on_signals(stop: StopRequest | None = None) -> Iterator[StopRequest]:
    """While the block runs, SIGINT/SIGTERM request a checkpoint and a stop of the fits given the yielded request
    (a second signal stops at once); the previous handlers are put back on the way out.  Main thread only."""
    stop = stop if stop is not None else StopRequest()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: Any) -> None:
        stop.request(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print(f"{signal.Signals(signum).name}: checkpointing at the next step, then stopping (again to stop now)",
              file=sys.stderr, flush=True)

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
