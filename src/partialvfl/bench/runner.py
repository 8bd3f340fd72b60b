"""Run a grid: one fit per cell (dataset, method, training mechanism, seed), evaluated on every test mechanism.

* Resumable: a cell whose rows are all ``done`` in the store is skipped (``force=True`` recomputes it); a cell is
  written in one transaction when it finishes, so a run killed at any moment loses at most the fits in flight and
  never leaves half a cell or a duplicate.  Failed cells are retried on the next run.
* Parallel by default: a process pool (``spawn``) of ``workers`` processes, each with
  ``torch.set_num_threads(max(1, cores // workers))`` so the workers do not oversubscribe the cores; ``workers=1``
  runs in this process.  ``executor="ray"`` runs the same cells on a Ray cluster (:mod:`.ray_executor`).
* Progress: a bar for the whole grid and a status line with the fits in flight (elapsed time, last reported epoch);
  at the end a :class:`RunSummary` (done, failed with the error, skipped as already done).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from partialvfl.bench.grid import Cell, DatasetSpec, Grid, check_methods, load_grid
from partialvfl.bench.store import ResultStore, code_version, now_utc

__all__ = ["CellResult", "RunSummary", "available_cores", "run_cell", "run_grid", "variant_of"]

Notify = Callable[[str, str], None]


@dataclass
class CellResult:
    """What one fit produced: its store rows (one per test mechanism), or the error that stopped it."""

    cell_key: str
    description: str
    rows: list[dict[str, Any]]
    error: str | None = None
    seconds: float = 0.0


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
        return not self.failed and not self.interrupted

    def text(self) -> str:
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


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def variant_of(params: dict[str, Any]) -> str | None:
    """``'labelled-only'`` when a fitted model's parameters say it did not pretrain on unlabelled data."""
    if "pretrain" not in params:
        return None
    value = params["pretrain"]
    if isinstance(value, str):
        return "labelled-only" if value.strip().lower() in ("", "none", "off", "no", "false") else None
    return None if value else "labelled-only"


# ---------------------------------------------------------------------- one cell (runs in a worker)
_IMPORTED: set[str] = set()


def _import_modules(modules: Sequence[str]) -> None:
    for m in modules:
        if m not in _IMPORTED:
            importlib.import_module(m)
            _IMPORTED.add(m)


_SOURCES: dict[tuple[str, str | None, str], Any] = {}


def _source(spec: DatasetSpec) -> Any:
    """The raw dataset, loaded once per process (the last few are kept)."""
    from partialvfl.data.sources import load_source

    key = spec.source_key()
    if key not in _SOURCES:
        if len(_SOURCES) >= 3:
            _SOURCES.pop(next(iter(_SOURCES)))
        _SOURCES[key] = load_source(spec.name, spec.data_dir, **spec.options)
    return _SOURCES[key]


def _test_set(config: Any, mechanism: str, source: Any) -> Any:
    """The test set of ``config`` under another test mechanism.

    The protocol draws the test mask from its own seeded stage, so it depends only on (seed, test mechanism, test
    samples): the training side is rebuilt under the cheap ``mcar0`` and thrown away.
    """
    from partialvfl.data.protocol import make_protocol

    return make_protocol(replace(config, train_missing="mcar0", test_missing=mechanism), source)[1]


def _fit_and_evaluate(cell: Cell, grid_name: str, version: str, notify: Notify | None) -> list[dict[str, Any]]:
    from partialvfl.data.protocol import ProtocolConfig, make_protocol
    from partialvfl.federation.messages import MessageLog
    from partialvfl.methods.base import get_method
    from partialvfl.methods.evaluation import evaluate

    started = now_utc()
    source = _source(cell.dataset)
    config = ProtocolConfig(
        **cell.dataset.protocol_kwargs(), train_missing=cell.train_mechanism,
        test_missing=cell.test_mechanisms[0], seed=cell.seed,
    )
    train, first_test = make_protocol(config, source)
    model = get_method(cell.method.name)(cell.method.preset, seed=cell.seed, **cell.overrides)

    def on_epoch(stage: str, epoch: int, metrics: dict[str, float]) -> None:
        if notify is not None:
            notify(cell.key, f"{stage} epoch {epoch}")

    log = MessageLog(keep_entries=False)
    t0 = time.perf_counter()
    model.fit(train, log=log, on_epoch=on_epoch)
    fit_seconds = float(getattr(model, "fit_seconds_", None) or time.perf_counter() - t0)
    n_bytes = log.total_bytes()
    params = dict(getattr(model, "params_", {}))
    base = {
        "cell_hash": cell.key,
        "grid": grid_name,
        "code_version": version,
        "method": cell.method.name,
        "label": cell.method.display,
        "preset": cell.method.preset,
        "overrides": cell.overrides,
        "params": params,
        "variant": variant_of(params),
        "dataset": cell.dataset.name,
        "dataset_config": cell.dataset.key(),
        "parties": cell.dataset.parties,
        "labels": cell.dataset.labels,
        "aligned": cell.dataset.aligned,
        "train_mechanism": cell.train_mechanism,
        "seed": cell.seed,
        "fit_seconds": fit_seconds,
        "bytes_communicated": n_bytes,
        "hostname": socket.gethostname(),
        "started_at": started,
        "status": "done",
    }
    rows = []
    for i, mech in enumerate(cell.test_mechanisms):
        if notify is not None:
            notify(cell.key, f"evaluating {mech}")
        test = first_test if i == 0 else _test_set(config, mech, source)
        res = evaluate(model, test)
        metric = "accuracy" if "accuracy" in res else "rmse"
        rows.append({
            **base,
            "config_hash": cell.row_key(mech),
            "test_mechanism": mech,
            "metric": metric,
            "accuracy": res.get("accuracy"),
            "rmse": res.get("rmse"),
            "by_observed": res.get("by_observed_parties", {}),
            "n_test": res.get("n_samples"),
            "predict_seconds": res.get("predict_seconds"),
            "finished_at": now_utc(),
        })
    return rows


def failed_rows(cell: Cell, grid_name: str, version: str, error: str, started: str) -> list[dict[str, Any]]:
    """The store rows that record a failed fit (one per test mechanism, status ``failed``)."""
    return [{
        "config_hash": cell.row_key(mech), "cell_hash": cell.key, "grid": grid_name, "code_version": version,
        "method": cell.method.name, "label": cell.method.display, "preset": cell.method.preset,
        "overrides": cell.overrides, "dataset": cell.dataset.name, "dataset_config": cell.dataset.key(),
        "parties": cell.dataset.parties, "labels": cell.dataset.labels, "aligned": cell.dataset.aligned,
        "train_mechanism": cell.train_mechanism, "test_mechanism": mech, "seed": cell.seed,
        "hostname": socket.gethostname(), "started_at": started, "finished_at": now_utc(), "status": "failed",
        "error": error,
    } for mech in cell.test_mechanisms]


def run_cell(cell: Cell, grid_name: str, version: str, imports: Sequence[str] = (),
             notify: Notify | None = None) -> CellResult:
    """Fit one cell and evaluate it on every test mechanism; an exception becomes ``failed`` rows, never a raise."""
    t0 = time.perf_counter()
    started = now_utc()
    if notify is not None:
        notify(cell.key, "started")
    try:
        _import_modules(imports)
        rows = _fit_and_evaluate(cell, grid_name, version, notify)
        error = None
    except Exception as e:  # noqa: BLE001 - a failed fit is a result, recorded with its error
        error = "".join(traceback.format_exception(e))[-4000:]
        rows = failed_rows(cell, grid_name, version, error, started)
    return CellResult(cell.key, cell.describe(), rows, error, time.perf_counter() - t0)


# ---------------------------------------------------------------------- local executors
_QUEUE: Any = None


def _queue_notify(key: str, text: str) -> None:
    if _QUEUE is not None:
        with contextlib.suppress(Exception):  # progress is best effort
            _QUEUE.put_nowait((key, text, time.time()))


def _init_worker(threads: int, imports: Sequence[str], queue: Any) -> None:
    """Process-pool initializer: split the cores, import the grid's plugin modules, keep the progress queue."""
    global _QUEUE
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the workers
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set in this process
        torch.set_num_interop_threads(1)
    _QUEUE = queue
    _import_modules(imports)


def _worker_run(cell: Cell, grid_name: str, version: str, imports: Sequence[str]) -> CellResult:
    return run_cell(cell, grid_name, version, imports, _queue_notify)


def _run_serial(cells: Sequence[Cell], grid: Grid, version: str, status: Notify) -> Iterator[CellResult]:
    for cell in cells:
        yield run_cell(cell, grid.name, version, grid.imports, status)


def _run_pool(cells: Sequence[Cell], grid: Grid, version: str, workers: int, status: Notify,
              tick: Callable[[], None]) -> Iterator[CellResult]:
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    threads = max(1, available_cores() // workers)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(threads, tuple(grid.imports), q))
    completed = False
    try:
        futures = {pool.submit(_worker_run, c, grid.name, version, tuple(grid.imports)): c for c in cells}
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
) -> RunSummary:
    """Run every unfinished cell of ``grid`` and write its rows to the store in ``store`` (a directory)."""
    if not isinstance(grid, Grid):
        grid = load_grid(grid)
    if executor not in ("local", "ray"):
        raise ValueError(f"executor must be 'local' or 'ray', got {executor!r}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    check_methods(grid)
    t_start = time.perf_counter()
    results = ResultStore(store)
    cells = grid.cells()
    done_keys = results.done_keys()
    summary = RunSummary(grid.name, len(cells))
    todo = []
    for c in cells:
        if not force and all(c.row_key(t) in done_keys for t in c.test_mechanisms):
            summary.skipped.append(c.describe())
        else:
            todo.append(c)
    version = code_version()
    workers = min(workers or available_cores(), max(1, len(todo)))

    from tqdm.auto import tqdm

    bar = tqdm(total=len(cells), initial=len(summary.skipped), desc=f"grid {grid.name}", unit="fit",
               file=sys.stderr, disable=not progress, dynamic_ncols=True, position=0)
    line = tqdm(total=0, bar_format="{desc}", file=sys.stderr, disable=not progress, position=1, leave=False)
    status = _Status(todo, line if progress else None)
    if executor == "ray":
        from partialvfl.bench.ray_executor import run_on_ray

        stream = run_on_ray(todo, grid, version, address=address, status=status)
    elif workers == 1:
        stream = _run_serial(todo, grid, version, status)
    else:
        stream = _run_pool(todo, grid, version, workers, status, status.render)
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
        results.close()
    summary.wall_seconds = time.perf_counter() - t_start
    return summary
