"""Operators per step: what a training step asks of torch, counted on any device (the CPU proxy of kernel launches).

On a GPU a step's time is its kernels' time only if the host keeps the queue full; a step that dispatches thousands of
small operators, or waits for the device again and again, leaves it idle (design.md: "count kernels per step and the
busy fraction, not only seconds").  :class:`OpCounter` is a ``TorchDispatchMode`` that sees every ATen operator a
block dispatches (forward, backward and optimiser alike, after autograd), sorted into:

* ``kernels``: operators that compute (a GPU launches at least one kernel for each): everything below but the rest;
* ``views``: aliasing and metadata operators (``view``, ``t``, ``detach``, ``expand``, slicing, profiler marks,
  empty allocations): no kernel on any device;
* ``transfers``: copies between devices (host to device, device to host); ``blocking_transfers`` those that make the
  host wait (on CUDA, every copy that is not ``non_blocking`` synchronises the stream).  An indexing operator given
  CPU index tensors for a tensor on another device counts as one too: the kernel copies the indices over itself,
  from pageable memory, and on CUDA that copy synchronises the stream (it appears as no operator of its own);
* ``readbacks``: a value read back to Python (``.item()``, ``float(t)``, ``bool(t)``): on a GPU, each waits for every
  queued kernel;
* ``optimizer``: the operators of optimiser steps (``torch.optim``), a subset of all of the above (fused Adam: a
  few per step; where torch has no fused kernel, e.g. on ``meta``, a dozen per parameter tensor).

The counts do not depend on the batch size or the device (the same operators run on the CPU, a GPU or ``meta``), so
they can be measured on a CPU; on a GPU :func:`device_activity` reads the profiler's kernels and the busy fraction.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["DeviceActivity", "OpCount", "OpCounter", "busy_fraction", "count_ops", "device_activity"]

#: operators that allocate, mark or describe without computing (besides every view operator, which torch flags)
NO_KERNEL = frozenset({
    "detach", "lift_fresh", "lift_fresh_copy", "_record_function_enter_new", "_record_function_exit", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "scalar_tensor", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "_local_scalar_dense", "is_same_size", "_has_compatible_shallow_copy_type",
    "set_", "resize_", "_reshape_alias", "alias", "_unsafe_view", "pin_memory", "_pin_memory", "is_pinned",
})
#: operators that copy (possibly between devices)
COPIES = frozenset({"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize"})
#: indexing operators that accept CPU index tensors for a tensor on another device (and copy them over, blocking)
INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put"})


@dataclass
class OpCount:
    """Operators dispatched per step (averages over ``steps``), by kind, and the most frequent ones."""

    steps: int
    ops: float
    kernels: float
    views: float
    transfers: float
    blocking_transfers: float
    readbacks: float
    casts: float
    optimizer: float = 0.0
    by_name: dict[str, float] = field(default_factory=dict)

    def as_dict(self, top: int = 15) -> dict[str, Any]:
        """The figures, rounded, with the ``top`` most frequent operators."""
        out: dict[str, Any] = {k: round(getattr(self, k), 1) for k in (
            "ops", "kernels", "views", "transfers", "blocking_transfers", "readbacks", "casts", "optimizer")}
        out["steps_counted"] = self.steps
        out["top_ops"] = dict(list(self.by_name.items())[:top])
        return out


def _devices(value: Any) -> set[torch.device]:
    return {t.device for t in tree_leaves(value) if isinstance(t, torch.Tensor)}


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched inside its ``with`` block (see the module docstring for the kinds)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: collections.Counter[str] = collections.Counter()
        self.kinds: collections.Counter[str] = collections.Counter()
        self._in_step = 0  # inside an optimiser's step (its hooks below)
        self._hooks: list[Any] = []

    def __enter__(self) -> OpCounter:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def pre(*_: Any) -> None:
            self._in_step += 1

        def post(*_: Any) -> None:
            self._in_step -= 1

        self._hooks = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.by_name[name] += 1
        self.kinds["ops"] += 1
        if self._in_step:
            self.kinds["optimizer"] += 1
        out = func(*args, **kwargs)
        if name == "_local_scalar_dense":
            self.kinds["readbacks"] += 1
            if args and isinstance(args[0], torch.Tensor) and args[0].device.type not in ("cpu", "meta"):
                self.kinds["blocking_transfers"] += 1
        elif name in COPIES:
            self._copy(name, args, kwargs, out)
        elif name in INDEXING:
            self.kinds["kernels"] += 1
            self._implicit_copies(args)
        elif func.is_view or name in NO_KERNEL:
            self.kinds["views"] += 1
        else:
            self.kinds["kernels"] += 1
        return out

    def _copy(self, name: str, args: Any, kwargs: Any, out: Any) -> None:
        """A copy: a transfer when it crosses devices (blocking unless ``non_blocking``), a cast when it changes
        the dtype, a kernel either way (a same-device copy too)."""
        source = args[0] if name != "copy_" else args[1]
        target = out if name != "copy_" else args[0]
        self.kinds["kernels"] += 1
        if isinstance(source, torch.Tensor) and isinstance(target, torch.Tensor):
            if source.dtype != target.dtype:
                self.kinds["casts"] += 1
            if len(_devices((source, target))) > 1:
                self.kinds["transfers"] += 1
                non_blocking = bool(kwargs.get("non_blocking", False) or (name == "copy_" and len(args) > 2
                                                                          and args[2]))
                if not non_blocking:
                    self.kinds["blocking_transfers"] += 1

    def _implicit_copies(self, args: Any) -> None:
        """Indices on the CPU for a tensor elsewhere: the kernel copies them over, blocking (one per tensor)."""
        if not args or not isinstance(args[0], torch.Tensor) or args[0].device.type == "cpu":
            return
        for t in tree_leaves(args[1:2]):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0:
                self.kinds["transfers"] += 1
                self.kinds["blocking_transfers"] += 1

    def result(self, steps: int) -> OpCount:
        """The counts so far, per step over ``steps`` steps."""
        n = max(int(steps), 1)
        by_name = {k: round(v / n, 1) for k, v in self.by_name.most_common()}
        return OpCount(steps=n, by_name=by_name, **{k: self.kinds[k] / n for k in (
            "ops", "kernels", "views", "transfers", "blocking_transfers", "readbacks", "casts", "optimizer")})


def count_ops(step: Callable[[], Any], steps: int = 3, warmup: int = 1) -> OpCount:
    """Operators per step of ``step()``, averaged over ``steps`` calls after ``warmup`` uncounted ones (lazy set-up,
    first optimiser states)."""
    for _ in range(warmup):
        step()
    with OpCounter() as counter:
        for _ in range(steps):
            step()
    return counter.result(steps)


# ---------------------------------------------------------------------- a GPU's side: the profiler's events
@dataclass
class DeviceActivity:
    """What the device did over ``steps`` steps of ``wall_s`` seconds (per step): kernels, their time, copies,
    launch calls, and the busy fraction (the union of the device's kernel and copy intervals over the wall time)."""

    steps: int
    wall_s: float
    kernels: float
    kernel_s: float
    copies: float
    copy_s: float
    launch_calls: float
    busy_fraction: float

    def as_dict(self) -> dict[str, Any]:
        """The figures per profiled step, rounded, as JSON-ready values."""
        return {"steps_profiled": self.steps, "wall_ms_per_step": round(1e3 * self.wall_s / self.steps, 2),
                "kernels_per_step": round(self.kernels, 1), "kernel_ms_per_step": round(1e3 * self.kernel_s, 2),
                "copies_per_step": round(self.copies, 1), "copy_ms_per_step": round(1e3 * self.copy_s, 2),
                "launch_calls_per_step": round(self.launch_calls, 1),
                "busy_percent": round(100 * self.busy_fraction, 1)}


def busy_fraction(intervals: Iterable[tuple[float, float]], wall: float) -> float:
    """The share of ``wall`` covered by the union of ``(start, end)`` intervals (same unit), in [0, 1]."""
    if wall <= 0:
        return 0.0
    covered, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        covered += b - max(a, end)
        end = b
    return min(covered / wall, 1.0)


#: host-side CUDA runtime and driver calls that launch a kernel (what the issue's "launch calls" counts)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel", "cudaGraphLaunch")


def device_activity(events: Iterable[tuple[str, str, float, float]], steps: int, wall_s: float) -> DeviceActivity:
    """Per step, from profiler events ``(name, kind, start_us, end_us)``: ``kind`` is ``kernel``, ``memcpy``,
    ``memset`` (device side) or ``cpu`` (host side, where the launch calls are)."""
    n = max(int(steps), 1)
    kernels, copies, device, launches = [], [], [], 0
    for name, kind, start, end in events:
        if kind == "kernel":
            kernels.append(end - start)
            device.append((start, end))
        elif kind in ("memcpy", "memset"):
            copies.append(end - start)
            device.append((start, end))
        elif kind == "cpu" and name.startswith(LAUNCH_CALLS):
            launches += 1
    return DeviceActivity(steps=n, wall_s=wall_s, kernels=len(kernels) / n, kernel_s=sum(kernels) / 1e6 / n,
                          copies=len(copies) / n, copy_s=sum(copies) / 1e6 / n, launch_calls=launches / n,
                          busy_fraction=busy_fraction(device, wall_s * 1e6))
