"""The ``ops`` section of ``benchmarks/engine.py``: operators per step, and on a GPU what the device did (issue 36).

For the cpu-grid configuration's FALSE-VFL-I stage-1 step and the FashionMNIST paper configuration's stage-1 and
stage-2 steps, it prints:

* the ATen operators each step dispatches (``partialvfl.utils.opcount``: a ``TorchDispatchMode`` count, mean of 3
  steps after a warm-up), sorted into kernels, views, transfers (and how many make the host wait), readbacks and
  dtype casts.  The counts hardly depend on the batch size or the device, so they are the CPU-measurable proxy of a
  GPU's kernel launches;
* the step's wall time (median of the timed steps, the device synchronised after each);
* on a GPU, the PyTorch profiler's view of the same steps: kernels and memory copies per step, their device time,
  the host's kernel-launch calls and the **busy fraction** (the union of the device's kernel and copy intervals over
  the profiled wall time; the profiler slows the host, so the unprofiled wall time is printed beside it and
  ``kernel_share_of_wall`` divides the kernel time by that).

The cpu-grid step is counted twice: ``engine_step`` is the engine's own stepper (``fvl_stepper``: the coordinator's
modules under a plain ``torch.optim.Adam``, each step its own encode round; the definition of issue 36's "2,043
operators per step"), ``fit_step`` the step a fit runs (the stage's fused Adam, the next batch's encode riding with
``update``).  The paper steps are the stages' own steps (``engine_paper.py``), on the CPU at ``--paper-batch``
(default 32 there: ResNet-18 parties at batch 1,024 take minutes per step on a CPU), on a GPU at the paper's.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# this checkout's counter, also when an older checkout is on PYTHONPATH (the before of a before/after): one instrument
# measures both (an older counter may lack a kind, e.g. the blocking copies of indexing with CPU indices)
_path = Path(__file__).resolve().parents[1] / "src" / "partialvfl" / "utils" / "opcount.py"
_spec = importlib.util.spec_from_file_location("_opcount", _path)
assert _spec is not None and _spec.loader is not None
_opcount = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_opcount)
count_ops, device_activity = _opcount.count_ops, _opcount.device_activity

__all__ = ["ops_section", "profile_steps"]


def profile_steps(step: Any, steps: int, device: torch.device, sync: Any) -> dict[str, Any]:
    """The profiler's kernels, copies, launch calls and busy fraction per step over ``steps`` steps on a CUDA
    ``device`` (``{}`` elsewhere)."""
    if device.type != "cuda":
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = time.perf_counter() - t0
    events = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kind = "memcpy" if "memcpy" in e.name.lower() else "memset" if "memset" in e.name.lower() else "kernel"
        else:
            kind = "cpu"
        events.append((e.name, kind, float(e.time_range.start), float(e.time_range.end)))
    return device_activity(events, steps, wall).as_dict()


def counted(step: Any, steps: int) -> Any:
    """:func:`count_ops` of ``step`` with its parties answering one by one (a dispatch mode sees only its own
    thread, and a concurrent round runs each party in a thread of its own; the operators are the same)."""
    transport = getattr(step, "transport", None)
    concurrent = getattr(transport, "concurrent", "absent")
    if concurrent != "absent":
        transport.concurrent = False
    try:
        return count_ops(step, steps=steps, warmup=1)
    finally:
        if concurrent != "absent":
            transport.concurrent = concurrent


def sync_points(step: Any, steps: int, device: torch.device) -> dict[str, Any]:
    """On a CUDA ``device``: the host's waits for the GPU per step (``torch.cuda.set_sync_debug_mode``: every
    synchronising call warns, with the Python line that made it), and the most frequent lines; ``{}`` elsewhere."""
    if device.type != "cuda":
        return {}
    import collections
    import warnings

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    lines = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))
    return {"syncs_per_step": round(sum(lines.values()) / max(steps, 1), 1),
            "where": {k: round(v / max(steps, 1), 1) for k, v in lines.most_common(6)}}


def _measured(step: Any, steps: int, device: torch.device, timed: Any, sync: Any) -> dict[str, Any]:
    """Operators per step, wall time per step, and (on a GPU) the profiler's figures and the host's waits, for one
    stepper.  The operators are counted with the parties answering one by one (a dispatch mode sees only its own
    thread; the operators are the same either way)."""
    counts = counted(step, steps=3)
    step()  # one step as measured below (concurrent rounds start their threads and streams here)
    wall = [timed(step, 1)[0] for _ in range(steps)]
    out: dict[str, Any] = {**counts.as_dict(), "wall_ms_per_step": round(1e3 * statistics.median(wall), 2),
                           "wall_ms_min": round(1e3 * min(wall), 2), "steps_timed": steps,
                           "steps_per_epoch": getattr(step, "steps_per_epoch", None)}
    try:  # a profiler failure costs its own figures, not the section's
        activity = profile_steps(step, steps, device, sync)
    except Exception as e:
        activity = {"profiler_error": f"{type(e).__name__}: {e}"}
    if activity:
        if "kernel_ms_per_step" in activity:
            activity["kernel_share_of_wall_percent"] = round(
                100 * activity["kernel_ms_per_step"] / out["wall_ms_per_step"], 1)
        out["device"] = activity
        try:
            out["device"]["host_waits"] = sync_points(step, 2, device)
        except Exception as e:
            out["device"]["host_waits"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _on_meta(engine: Any, quick: bool, train: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The fit steps' counts with the coordinator and every party on the ``meta`` device (shapes, no values: free),
    the paper steps at the paper's batch sizes: what a GPU would be asked, transfers and blocking copies included
    (on the CPU nothing is transferred).  Optimisers differ there (no fused Adam on meta: a few more operators)."""
    from engine_paper import paper_steppers

    saved, engine.DEVICE = engine.DEVICE, torch.device("meta")
    try:
        out = {"cpu_grid_stage1_fit_step": counted(engine.fit_stepper(train, params), steps=3).as_dict(top=8)}
        steppers, config = paper_steppers(quick, engine.method, engine.federation, None)
        for name, step in steppers.items():
            out[f"paper_{name}"] = counted(step, steps=2).as_dict(top=8)
        out["paper_configuration"] = config
    finally:
        engine.DEVICE = saved
    out["note"] = ("coordinator and parties on the meta device: the same operators as on a GPU but for the "
                   "optimisers (no fused Adam on meta) and the read-backs (none on meta); the paper steps at the "
                   "paper's batch sizes")
    return out


def ops_section(engine: Any, quick: bool, steps: int, paper_batch: int | None) -> dict[str, Any]:
    """Operators (and on a GPU the profiler's figures) per step of the cpu-grid and paper configurations.

    ``engine``: the ``benchmarks/engine.py`` module (its device, helpers and configurations).
    """
    from engine_paper import paper_steppers

    device, timed, sync = engine.DEVICE, engine.timed, engine.sync
    params = engine._fvl_params(quick)
    train = engine.fvl_data(quick)
    out: dict[str, Any] = {"configuration": "quick (digits, 4 parties)" if quick else
                           "cpu grid (FashionMNIST 4,000 rows, 8 parties, MLP 128, batch 256, kappa 10)"}
    out["cpu_grid_stage1"] = {
        "engine_step": _measured(engine.fvl_stepper(train, None, params), steps, device, timed, sync),
        "fit_step": _measured(engine.fit_stepper(train, params), steps, device, timed, sync),
    }
    batch = paper_batch if paper_batch is not None else (None if device.type == "cuda" else 32)
    steppers, config = paper_steppers(quick, engine.method, engine.federation, batch)
    out["paper_configuration"] = config
    for name, step in steppers.items():
        out[f"paper_{name}"] = _measured(step, steps, device, timed, sync)
    if device.type == "cpu":
        out["on_a_device"] = _on_meta(engine, quick, train, params)
    out["note"] = ("ops: ATen operators dispatched per step (TorchDispatchMode, mean of 3 steps after 1 warm-up); "
                   "kernels: those that compute (a GPU launches a kernel for each); views: aliasing and metadata "
                   "(no kernel); transfers: copies between devices, blocking: those the host waits for; readbacks: "
                   "values read back to Python (a GPU sync each); casts: dtype conversions"
                   + ("; device: the PyTorch profiler over the timed steps" if device.type == "cuda" else
                      "; no GPU: no profiler figures"))
    return out
