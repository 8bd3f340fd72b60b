"""One cell of a grid: fit its method once, evaluate it on every test mechanism, return its store rows.

:func:`run_cell` is what every executor runs (in this process, in a process-pool worker, or as a Ray task); it
never raises: an exception becomes ``failed`` rows (:func:`failed_rows`) carrying the error.
"""

from __future__ import annotations

import importlib
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from partialvfl.bench.grid import Cell, DatasetSpec
from partialvfl.bench.store import SourceChanged, now_utc, source_fingerprint
from partialvfl.utils.threads import resolve_threads, step_flops_of, use_threads

__all__ = ["CellResult", "Notify", "check_source", "data_stats", "failed_rows", "import_modules", "run_cell",
           "variant_of"]

#: the package's source as this process found it when it started running fits (see :func:`check_source`)
_SOURCE_AT_START = source_fingerprint()


def check_source() -> None:
    """Refuse to run (or record) a fit once the package's source files differ from those this process started with:
    its modules are a mix of old (imported) and new (imported lazily later) code.  :class:`SourceChanged` names them."""
    now = source_fingerprint()
    if now != _SOURCE_AT_START:
        raise SourceChanged(_SOURCE_AT_START, now)

Notify = Callable[[str, str], None]


@dataclass
class CellResult:
    """What one fit produced: its store rows (one per test mechanism), or the error that stopped it."""

    cell_key: str
    description: str
    rows: list[dict[str, Any]]
    error: str | None = None
    seconds: float = 0.0


def variant_of(params: dict[str, Any]) -> str | None:
    """``'labelled-only'`` when a fitted model's parameters say it did not pretrain on unlabelled data."""
    if "pretrain" not in params:
        return None
    value = params["pretrain"]
    if isinstance(value, str):
        return "labelled-only" if value.strip().lower() in ("", "none", "off", "no", "false") else None
    return None if value else "labelled-only"


_IMPORTED: set[str] = set()


def import_modules(modules: Sequence[str]) -> None:
    """Import each module once per process (a grid's plugin modules that register methods or datasets)."""
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


def _fit_and_evaluate(cell: Cell, grid_name: str, version: str, notify: Notify | None,
                      threads: int | str = "auto", run: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    import torch

    from partialvfl.data.holdout import hold_out_labels
    from partialvfl.data.protocol import ProtocolConfig, make_protocol, with_test_mechanism
    from partialvfl.federation.wire.messages import MessageLog
    from partialvfl.methods.base import get_method
    from partialvfl.methods.evaluation import evaluate

    started = now_utc()
    source = _source(cell.dataset)
    tests = [m for m in cell.test_mechanisms if m != "validation"] or ["mcar0"]
    config = ProtocolConfig(**cell.dataset.protocol_kwargs(), train_missing=cell.train_mechanism,
                            test_missing=tests[0], seed=cell.seed)
    train, first_test = make_protocol(config, source)
    fit_data, val = (train, None) if cell.role == "test" else hold_out_labels(train, cell.validation_fraction,
                                                                             cell.seed)
    model = get_method(cell.method.name)(cell.method.preset, seed=cell.seed, **(run or {}), **cell.overrides)

    def on_epoch(stage: str, epoch: int, metrics: dict[str, float]) -> None:
        if notify is not None:
            notify(cell.key, f"{stage} epoch {epoch}")

    log = MessageLog(keep_entries=False)
    step_flops = step_flops_of(type(model), model.resolve_params(cell.dataset.name), train.feature_shapes)
    n_threads = resolve_threads(threads, step_flops, torch.get_num_threads())  # within this worker's budget
    t0 = time.perf_counter()
    with use_threads(n_threads):
        model.fit(fit_data, log=log, on_epoch=on_epoch)
    fit_seconds = float(getattr(model, "fit_seconds_", None) or time.perf_counter() - t0)
    params = dict(getattr(model, "params_", {}))
    base = {**_row_identity(cell, grid_name, version), "params": params, "variant": variant_of(params),
            "fit_seconds": fit_seconds, "bytes_communicated": log.total_bytes(), "started_at": started,
            "device": run_description(model),
            "status": "done", "data_stats": data_stats(fit_data, params)}
    rows = []
    for mech in cell.test_mechanisms:
        if notify is not None:
            notify(cell.key, f"evaluating {mech}")
        if mech == "validation":
            data = val
        else:
            data = first_test if mech == tests[0] else with_test_mechanism(config, mech, source)
        with use_threads(n_threads):
            res = evaluate(model, data)
        rows.append({
            **base, "config_hash": cell.row_key(mech), "test_mechanism": mech,
            "metric": "accuracy" if "accuracy" in res else "rmse", "accuracy": res.get("accuracy"),
            "rmse": res.get("rmse"), "by_observed": res.get("by_observed_parties", {}),
            "n_test": res.get("n_samples"), "predict_seconds": res.get("predict_seconds"), "finished_at": now_utc(),
        })
    return rows


def run_description(model: Any) -> str:
    """How a fit ran, for the store's ``device`` column: ``cpu``, ``cuda:0 (NVIDIA H100 80GB HBM3) bf16 compiled``."""
    from partialvfl.utils.devices import describe

    parts = [describe(model.torch_device)]
    if model.precision != "fp32":
        parts.append(model.precision)
    if model.compile:
        parts.append("compiled")
    return " ".join(parts)


def data_stats(train: Any, params: dict[str, Any]) -> dict[str, Any]:
    """What the training data looked like to the method: distinct observed patterns among the labelled rows and
    the mean batch size pattern batching (LASER-VFL's) would give with the method's batch size; the split's
    importance shares when the splitter records them."""
    import numpy as np

    rows = np.flatnonzero(train.labeled & train.observed.any(axis=1))
    _, counts = np.unique(train.observed[rows], axis=0, return_counts=True)
    out: dict[str, Any] = {"labelled_rows": int(len(rows)), "patterns": int(len(counts))}
    bs = params.get("batch_size")
    if isinstance(bs, int) and bs > 0 and len(counts):
        n_batches = int(np.sum(np.ceil(counts / bs)))
        out.update(pattern_batches=n_batches, mean_pattern_batch=round(float(len(rows) / n_batches), 2),
                   mixed_batches=int(np.ceil(len(rows) / bs)))
    if "split" in train.info:
        out["split"] = train.info["split"]
    return out


def _row_identity(cell: Cell, grid_name: str, version: str) -> dict[str, Any]:
    """The columns every row of a cell shares, done or failed."""
    return {
        "cell_hash": cell.key, "grid": grid_name, "code_version": version, "method": cell.method.name,
        "label": cell.method.display, "preset": cell.method.preset, "overrides": cell.overrides,
        "dataset": cell.dataset.display, "source": cell.dataset.name, "dataset_config": cell.dataset.key(),
        "parties": cell.dataset.parties, "labels": cell.dataset.labels, "aligned": cell.dataset.aligned,
        "train_mechanism": cell.train_mechanism, "seed": cell.seed, "role": cell.role,
        "hostname": socket.gethostname(), "tuning": cell.tuning,
    }


def failed_rows(cell: Cell, grid_name: str, version: str, error: str, started: str) -> list[dict[str, Any]]:
    """The store rows that record a failed fit (one per test mechanism, status ``failed``)."""
    return [{**_row_identity(cell, grid_name, version), "config_hash": cell.row_key(mech), "test_mechanism": mech,
             "started_at": started, "finished_at": now_utc(), "status": "failed", "error": error}
            for mech in cell.test_mechanisms]


def run_cell(cell: Cell, grid_name: str, version: str, imports: Sequence[str] = (),
             notify: Notify | None = None, *, threads: int | str = "auto",
             run: dict[str, Any] | None = None) -> CellResult:
    """Fit one cell and evaluate it on every test mechanism; an exception becomes ``failed`` rows, never a raise.

    ``threads``: torch threads for the fit (``auto``: the thread policy, within this process's current number);
    ``run``: how the method runs (``device``, ``precision``, ``compile``: not part of the cell's key).
    """
    t0 = time.perf_counter()
    started = now_utc()
    if notify is not None:
        notify(cell.key, "started")
    try:
        check_source()
        import_modules(imports)
        rows = _fit_and_evaluate(cell, grid_name, version, notify, threads, run)
        check_source()  # an edit during the fit: its lazily imported modules may be the new code
        error = None
    except Exception as e:  # a failed fit is a result, recorded with its error
        error = "".join(traceback.format_exception(e))[-4000:]
        rows = failed_rows(cell, grid_name, version, error, started)
    return CellResult(cell.key, cell.describe(), rows, error, time.perf_counter() - t0)
