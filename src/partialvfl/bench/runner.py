"""Run a grid: one fit per cell (dataset, method, training mechanism, seed), evaluated on every test mechanism.

* Resumable: a cell whose rows are all ``done`` in the store is skipped (``force=True`` recomputes it); a cell is
  written in one transaction when it finishes, so a run killed at any moment loses at most the fits in flight and
  never leaves half a cell or a duplicate.  Failed cells are retried on the next run.
* Each fit is :func:`~partialvfl.bench.cell.run_cell` (:mod:`.cell`), whatever runs it.
* Parallel by default: a process pool (``spawn``) of ``workers`` processes, each with a budget of
  ``cores // workers`` torch threads so the workers never oversubscribe the cores; ``workers=1`` runs in this
  process.  Within its budget a fit takes the threads the thread policy gives it (``threads="auto"``: one for a
  small model, :mod:`partialvfl.utils.threads`), and OpenMP's idle threads sleep instead of spinning.
  ``executor="ray"`` runs the same cells on a Ray cluster (:mod:`.ray_executor`).
* A tuned grid (:mod:`.tuning`) runs in two phases: every candidate's validation cell, then the chosen candidates'
  other cells (a rerun of the same command resumes either phase).
* Progress: a bar for the whole grid and a status line with the fits in flight (elapsed time, last reported epoch);
  at the end a :class:`RunSummary` (done, failed with the error, skipped as already done).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partialvfl.bench.cell import CellResult, Notify, import_modules, run_cell
from partialvfl.bench.gpus import plan_workers, ray_resources
from partialvfl.bench.grid import Cell, Grid, tuning_candidates
from partialvfl.bench.grid_file import check_methods, load_grid
from partialvfl.bench.store import ResultStore, code_version
from partialvfl.bench.tuning import choose
from partialvfl.utils.threads import available_cores, configure_openmp, resolve_threads, thread_budget

__all__ = ["RunSummary", "available_cores", "run_grid"]


@dataclass
class RunSummary:
    """The outcome of a run of a grid."""

    grid: str
    total: int
    done: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    wall_seconds: float = 0.0
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        """Whether every fit succeeded and the run was not interrupted."""
        return not self.failed and not self.interrupted

    def text(self) -> str:
        """The summary in words, as ``partialvfl bench`` prints it."""
        lines = [
            f"grid {self.grid!r}: {self.total} fits; {len(self.done)} done, {len(self.failed)} failed, "
            f"{len(self.skipped)} skipped (already done); wall time {self.wall_seconds:.1f} s"
            + (" (interrupted)" if self.interrupted else "")
        ]
        for what, err in self.failed:
            first = err.strip().splitlines()[-1] if err.strip() else "unknown error"
            lines.append(f"  FAILED {what}: {first}")
        if self.interrupted:
            lines.append("  rerun the same command to resume: finished fits are kept and skipped")
        return "\n".join(lines)


# ---------------------------------------------------------------------- local executors
_QUEUE: Any = None
_DEVICE: str | None = None  # this worker's device (a GPU worker's own GPU)


def _queue_notify(key: str, text: str) -> None:
    if _QUEUE is not None:
        with contextlib.suppress(Exception):  # progress is best effort
            _QUEUE.put_nowait((key, text, time.time()))


def _init_worker(threads: int, imports: Sequence[str], queue: Any, devices: Any = None) -> None:
    """Process-pool initializer: split the cores, import the grid's plugin modules, keep the progress queue, take
    a device from ``devices`` (a queue holding one per worker)."""
    global _QUEUE, _DEVICE
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the workers
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    configure_openmp()
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set in this process
        torch.set_num_interop_threads(1)
    _QUEUE = queue
    if devices is not None:
        _DEVICE = devices.get()
        if _DEVICE.startswith("cuda:"):
            torch.cuda.set_device(torch.device(_DEVICE))
    import_modules(imports)


def _worker_run(cell: Cell, grid_name: str, version: str, imports: Sequence[str], threads: int | str,
                run: dict[str, Any]) -> CellResult:
    if _DEVICE is not None:
        run = {**run, "device": _DEVICE}
    return run_cell(cell, grid_name, version, imports, _queue_notify, threads=threads, run=run)


def _run_serial(cells: Sequence[Cell], grid: Grid, version: str, status: Notify,
                threads: int | str, run: dict[str, Any]) -> Iterator[CellResult]:
    for cell in cells:
        yield run_cell(cell, grid.name, version, grid.imports, status, threads=threads, run=run)


def _run_pool(cells: Sequence[Cell], grid: Grid, version: str, workers: int, status: Notify,
              tick: Callable[[], None], threads: int | str, run: dict[str, Any],
              devices: Sequence[str]) -> Iterator[CellResult]:
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    dq = ctx.Queue()
    for d in devices:  # one per worker: each takes its own when it starts
        dq.put(d)
    budget = thread_budget(workers) if threads == "auto" else int(threads)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(budget, tuple(grid.imports), q, dq))
    completed = False
    try:
        futures = {pool.submit(_worker_run, c, grid.name, version, tuple(grid.imports), threads, run): c
                   for c in cells}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            while True:
                try:
                    key, text, _ = q.get_nowait()
                except queue_mod.Empty:
                    break
                status(key, text)
            tick()
            for f in finished:
                cell = futures[f]
                try:
                    yield f.result()
                except BrokenProcessPool as e:
                    yield CellResult(cell.key, cell.describe(), [], f"worker process died: {e}")
        completed = True
    finally:
        if completed:
            pool.shutdown(wait=True)
        else:  # interrupted: drop queued fits and stop the ones in flight now (their rows were never written)
            procs = list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:
                proc.terminate()


def _run_options(device: str, fits_per_gpu: int | None, precision: str, compile: bool,
                 executor: str) -> dict[str, Any]:
    """``device``/``precision``/``compile`` checked before any fit (a device this machine lacks, for the local
    executor; Ray's nodes have their own)."""
    from partialvfl.utils.devices import check_precision, resolve_device

    check_precision(precision, what="--precision")
    if executor == "local":
        resolve_device(device, what="--device")
    elif fits_per_gpu is None and device.strip().lower().startswith("cuda:"):
        ray_resources(device, fits_per_gpu, 1)  # refused: Ray picks the GPUs
    out: dict[str, Any] = {"device": device, "precision": precision}
    if compile:
        out["compile"] = True
    return out


# ---------------------------------------------------------------------- the grid
class _Status:
    """The 'in flight' status line: which fits run, for how long, and their last reported epoch."""

    def __init__(self, cells: Sequence[Cell], bar: Any) -> None:
        self.names = {c.key: c.describe() for c in cells}
        self.running: dict[str, tuple[float, str]] = {}
        self.finished: set[str] = set()
        self.bar = bar

    def __call__(self, key: str, text: str) -> None:
        if key in self.finished:  # a late progress message of a fit already written
            return
        start = self.running.get(key, (time.time(), ""))[0]
        self.running[key] = (start, "" if text == "started" else text)
        self.render()

    def finish(self, key: str) -> None:
        self.finished.add(key)
        self.running.pop(key, None)
        self.render()

    def render(self) -> None:
        if self.bar is None:
            return
        now = time.time()
        parts = [f"{self.names.get(k, k)} {now - t0:.0f}s" + (f" {what}" if what else "")
                 for k, (t0, what) in self.running.items()]
        self.bar.set_description_str(("in flight: " + " | ".join(parts)) if parts else "in flight: -")


def run_grid(
    grid: Grid | str | Path,
    store: str | Path,
    *,
    workers: int | None = None,
    executor: str = "local",
    address: str | None = None,
    force: bool = False,
    progress: bool = True,
    threads: int | str = "auto",
    device: str = "cpu",
    fits_per_gpu: int | None = None,
    precision: str = "fp32",
    compile: bool = False,  # torch's word
) -> RunSummary:
    """Run every unfinished cell of ``grid`` and write its rows to the store in ``store`` (a directory).

    ``threads``: torch threads per fit, ``auto`` (the thread policy within each worker's share of the cores) or a
    number.  ``device``, ``fits_per_gpu``, ``precision``, ``compile``: where and how the fits run
    (:mod:`partialvfl.bench.gpus`); they are not part of a cell's key, and the ``device`` column records them.
    """
    if not isinstance(grid, Grid):
        grid = load_grid(grid)
    if executor not in ("local", "ray"):
        raise ValueError(f"executor must be 'local' or 'ray', got {executor!r}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    resolve_threads(threads, None, 1)  # a bad value fails before any fit
    run = _run_options(device, fits_per_gpu, precision, compile, executor)
    configure_openmp()  # the workers inherit it; this process too if it has not loaded torch yet
    check_methods(grid)
    t_start = time.perf_counter()
    results = ResultStore(store)
    summary = RunSummary(grid.name, 0)
    version = code_version()
    try:
        cells = grid.cells()  # a tuned grid: its candidates' validation cells; the chosen ones' cells follow
        _run_phase(cells, grid, results, summary, version, workers, executor, address, force, progress, threads,
                   run, device, fits_per_gpu)
        if grid.tuning is not None and not summary.interrupted:
            known = {c.key for c in cells}
            rest = [c for c in grid.cells(tuning_choices(grid, results)) if c.key not in known]
            _run_phase(rest, grid, results, summary, version, workers, executor, address, force, progress, threads,
                       run, device, fits_per_gpu)
    finally:
        results.close()
    summary.wall_seconds = time.perf_counter() - t_start
    return summary


def tuning_choices(grid: Grid, results: ResultStore) -> dict[tuple[str, int, str], int]:
    """A tuned grid's chosen candidates, from the validation rows in the store (:func:`~.tuning.choose`)."""
    assert grid.tuning is not None
    rows: dict[str, list[dict[str, Any]]] = {}
    for r in results.rows(status="done"):
        rows.setdefault(r["cell_hash"], []).append(r)
    cands = {key: [c.key for c in group] for key, group in tuning_candidates(grid).items()}
    return choose(cands, rows, grid.tuning, grid.train_mechanisms)


def _run_phase(cells: Sequence[Cell], grid: Grid, results: ResultStore, summary: RunSummary, version: str,
               workers: int | None, executor: str, address: str | None, force: bool, progress: bool,
               threads: int | str, run: dict[str, Any], device: str, fits_per_gpu: int | None) -> None:
    """Run the unfinished ``cells`` (one phase of a grid), writing their rows and counting them in ``summary``;
    ``run``, ``device``, ``fits_per_gpu``: where and how the fits run (see :func:`run_grid`)."""
    done_keys = results.done_keys()
    summary.total += len(cells)
    todo = []
    for c in cells:
        if not force and all(c.row_key(t) in done_keys for t in c.test_mechanisms):
            summary.skipped.append(c.describe())
        else:
            todo.append(c)
    devices = [device]
    if executor == "local":
        from partialvfl.utils.devices import gpu_count  # torch: after configure_openmp

        workers, devices = plan_workers(device, fits_per_gpu, workers, gpus=gpu_count(),
                                        cpu_workers=available_cores())
        workers = min(workers, max(1, len(todo)))

    from tqdm.auto import tqdm

    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc=f"grid {grid.name}", unit="fit",
               file=sys.stderr, disable=not progress, dynamic_ncols=True, position=0)
    line = tqdm(total=0, bar_format="{desc}", file=sys.stderr, disable=not progress, position=1, leave=False)
    status = _Status(todo, line if progress else None)
    if executor == "ray":
        from partialvfl.bench.ray_executor import run_on_ray

        stream = run_on_ray(todo, grid, version, address=address, status=status, run=run,
                            resources=ray_resources(device, fits_per_gpu, 1))  # one torch thread per task
    elif workers == 1:
        stream = _run_serial(todo, grid, version, status, threads, {**run, "device": devices[0]})
    else:
        stream = _run_pool(todo, grid, version, workers, status, status.render, threads, run, devices)
    try:
        for result in stream:
            if result.rows:
                results.write(result.rows)
            if result.error is None:
                summary.done.append(result.description)
            else:
                summary.failed.append((result.description, result.error))
            status.finish(result.cell_key)
            bar.update(1)
            bar.set_postfix(done=len(summary.done), failed=len(summary.failed), refresh=False)
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
        line.close()
        bar.close()
