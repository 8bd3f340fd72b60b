"""How many torch threads a fit uses, and OpenMP waiting that survives a shared machine.

Why: torch's intra-op threads are OpenMP threads, and by default an idle OpenMP thread *spins* at every barrier.
When the cores are shared (other processes, or grid workers x threads > cores) a spinning thread burns the time
slice the thread doing the work needs, and every parallel region waits for a descheduled thread: measured on a
2-core machine at load 5 (``benchmarks/engine.py``, FALSE-VFL stage-1 step), two spinning threads were 2-10x
*slower* than one; with passive waiting, two threads were as fast as one.  The policy, applied by the CLI, the
grid runner and the benchmarks:

* :func:`configure_openmp` sets ``OMP_WAIT_POLICY=PASSIVE`` (unless the environment says otherwise) before torch
  is loaded: idle threads sleep, so an oversubscribed machine degrades in proportion instead of collapsing;
* :func:`choose_threads`: a fit whose estimated work per step is below :data:`SMALL_STEP_FLOPS` uses one thread
  (small matmuls gain nothing from a second thread and would only pay its synchronisation); a larger one uses its
  share of the cores;
* :func:`thread_budget`: N grid workers never oversubscribe: each gets at most ``cores // N`` threads.

``--threads N`` (CLI) or :func:`use_threads` overrides the choice.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["SMALL_STEP_FLOPS", "available_cores", "choose_threads", "configure_openmp", "mlp_flops",
           "resolve_threads", "step_flops_of", "thread_budget", "use_threads"]

#: Below this many floating-point operations per training step (forward and backward), a fit uses one thread.
SMALL_STEP_FLOPS = 2e9


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def configure_openmp(environ: MutableMapping[str, str] | None = None) -> bool:
    """Make idle OpenMP threads sleep instead of spin (``OMP_WAIT_POLICY=PASSIVE``) unless already configured.

    Takes effect only in a process that has not loaded torch yet (and in processes it starts); returns whether it
    does in this one.
    """
    env = os.environ if environ is None else environ
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return "torch" not in sys.modules


def thread_budget(workers: int = 1, cores: int | None = None) -> int:
    """Threads each of ``workers`` parallel fits may use without oversubscribing the cores."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    return max(1, (cores or available_cores()) // workers)


def choose_threads(step_flops: float | None, budget: int) -> int:
    """One thread for a small (or unknown) step, else the whole ``budget``."""
    if step_flops is None or step_flops < SMALL_STEP_FLOPS:
        return 1
    return max(1, budget)


def resolve_threads(requested: int | str | None, step_flops: float | None, budget: int) -> int:
    """``--threads``: a positive number as given, ``auto`` (or ``None``) by :func:`choose_threads`."""
    if requested is None or requested == "auto":
        return choose_threads(step_flops, budget)
    try:
        n = int(requested)
    except (TypeError, ValueError):
        raise ValueError(f"threads must be a positive integer or 'auto', got {requested!r}") from None
    if n < 1:
        raise ValueError(f"threads must be a positive integer or 'auto', got {requested!r}")
    return n


def mlp_flops(widths: Sequence[int], rows: float) -> float:
    """Forward FLOPs of an MLP with layer widths ``[in, hidden..., out]`` on ``rows`` rows (2 per multiply-add)."""
    return 2.0 * rows * sum(a * b for a, b in zip(widths[:-1], widths[1:]))


def step_flops_of(method_cls: Any, params: Mapping[str, Any], feature_shapes: Sequence[Sequence[int]]
                  ) -> float | None:
    """The method's own estimate of one training step's FLOPs (``estimated_step_flops``), if it has one."""
    estimate = getattr(method_cls, "estimated_step_flops", None)
    return None if estimate is None else estimate(dict(params), [tuple(s) for s in feature_shapes])


@contextmanager
def use_threads(n: int) -> Iterator[None]:
    """Run a block with ``n`` torch threads, restoring the previous number afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)
