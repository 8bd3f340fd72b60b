"""The fit lifecycle: everything a fit does around a method's own training (``_fit``), the same for every method.

:func:`fit_federated` checks the data against the federation, resolves the parameters for the dataset (and the
method's ``_plan``), randomizes the labels under label DP (:mod:`partialvfl.methods.private_fit`), plans the
schedule and early stopping (:mod:`partialvfl.methods.schedule`), chooses widths within the parties' caps, sets the
parties up (with their privacy plans), has them fit their preprocessing, binds the checkpointer, runs ``_fit``
through a :class:`~partialvfl.methods.training.TrainingLoop` (history, progress, checkpoints with the fit's
fingerprint, early stopping) and records the privacy report.  :func:`fit` does the same for a dataset in this
process.  ``VFLMethod.fit`` / ``fit_federated`` are thin calls into these, so a method class holds the estimator
contract and the hooks it implements, not the lifecycle.

It lives in the methods layer, not in ``orchestration``: ``VFLMethod.fit`` (the estimator API users call) and the
methods' own nested fits (label DP's RRWithPrior first stage, a split network's pretraining candidates) run it, and
the methods layer may not import the one above it (``tests/test_layers.py``).  ``orchestration.run_fit`` runs the
federated fit (sessions, lost parties, stop requests) around it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from partialvfl.data.dataset import CoordinatorView, VerticalDataset
from partialvfl.federation.runtime.coordinator import Federation, LocalFederation
from partialvfl.methods.model_files import IndexInfo
from partialvfl.methods.private_fit import label_dp_view, label_prior, plans_for, privacy_report, private_parties
from partialvfl.methods.schedule import EarlyStopping, SchedulePlan, plan_schedule, validation_score
from partialvfl.methods.training import EpochCallback, TrainingLoop
from partialvfl.methods.widths import fit_widths
from partialvfl.utils.jsonable import json_default
from partialvfl.utils.progress import progress_mode, report_line

if TYPE_CHECKING:
    from partialvfl.federation.runtime.checkpoint import Checkpointer
    from partialvfl.federation.wire.messages import MessageLog

VFLMethod = Any  # a method (partialvfl.methods.base imports this module)

__all__ = ["fingerprint", "fit", "fit_federated", "label_prior_of"]


def fit(method: VFLMethod, train: VerticalDataset, *, federation: Federation | None = None,
        log: MessageLog | None = None, checkpointer: Checkpointer | None = None, on_epoch: EpochCallback | None = None,
        party_dp: Mapping[int | str, tuple[float, float]] | None = None) -> VFLMethod:
    """Fit ``method`` on ``train``, in process unless ``federation`` is given (see ``VFLMethod.fit``)."""
    if federation is not None and party_dp:
        raise ValueError("party_dp sets the budgets of the in-process parties; a given federation's parties "
                         "keep their own (LocalFederation.for_dataset(..., party_dp=...))")
    run = method.run_options
    fed = federation or LocalFederation.for_dataset(train, log=log, party_dp=party_dp, device=run.torch_device,
                                                    precision=run.precision, compile=run.compile)
    handle = fed.attach(train, "train")
    dataset_name = train.info.get("dataset") or train.info.get("protocol", {}).get("dataset") or train.name or None
    fit_federated(method, fed, train.coordinator_view(), handle, dataset=dataset_name, data_info=train.info,
                  checkpointer=checkpointer, on_epoch=on_epoch)
    fed.release(handle)
    return method


def fit_federated(method: VFLMethod, federation: Federation, view: CoordinatorView, handle: str, *,
                  dataset: str | None = None, data_info: dict[str, Any] | None = None,
                  checkpointer: Checkpointer | None = None, on_epoch: EpochCallback | None = None) -> VFLMethod:
    """Fit ``method`` with the training data already attached at the parties under ``handle`` (any deployment);
    see ``VFLMethod.fit_federated``."""
    if view.n_parties != federation.n_parties:
        raise ValueError(f"the data has {view.n_parties} parties, the federation {federation.n_parties}")
    if not view.labeled.any():
        raise ValueError(f"{method.name}: the training data has no labelled sample")
    method.federation_ = federation
    federation.transport.device = method.torch_device  # replies arrive on the coordinator's device
    method.calibration_ = None  # a calibration belongs to the model it was fitted on, not to the next fit
    method.index_ = IndexInfo.of(view)
    resolved = method.resolve_params(dataset)  # checked: the defaults, presets and overrides each were
    method._set_params(resolved, trusted=list(resolved))
    method._plan(federation)
    method.data_info_ = dict(data_info or {})
    private = private_parties(method, federation)  # refuses a method without differential privacy, naming it
    # the labels the coordinator trains with (randomized under label DP; RRWithPrior: a first fit gives priors)
    view = label_dp_view(method, view, federation, handle, dataset)
    prior = label_prior(method, view)
    method.label_prior_ = label_prior_of(view) if prior is None else prior
    method.history_ = []
    schedule = method.schedule_ = plan_schedule(method.settings_, view, method.seed) if _has_schedule(method) else None
    method.width_choice_ = fit_widths(method, federation)  # within every party's announced width caps
    if method.width_choice_ is not None:
        report_line(method.width_choice_)
    federation.setup(method.party_program, [method._party_config(k) for k in range(view.n_parties)], method.seed,
                     plans=plans_for(method, private, "fit"))
    method.preprocessing_ = _preprocess(method, federation, handle)
    if checkpointer is not None:
        checkpointer.bind(federation)
    train_view = view
    stopping = None
    if schedule is not None and schedule.early_stopping:
        train_view = dataclasses.replace(view, labeled=view.labeled & ~np.isin(np.arange(view.n_samples),
                                                                              schedule.rows))
        stopping = _early_stopping(method, schedule, train_view, view, handle, checkpointer)
    loop = TrainingLoop(
        federation.transport, name=method.name, history=method.history_, report=_recorder(method, on_epoch),
        save_coordinator=method._coordinator_state, load_coordinator=method._load_coordinator_in_place,
        checkpointer=checkpointer, fingerprint=fingerprint(method, view),
        show_progress=progress_mode(method.progress)[0], stopping=stopping,
    )
    t0 = time.perf_counter()
    try:
        with method._computing():
            method._fit(train_view, handle, loop)
    finally:
        if stopping is not None:
            stopping.close()
    loop.finish()
    if schedule is not None and loop.stopping_result is not None:
        schedule.result = loop.stopping_result
    method.fit_seconds_ = time.perf_counter() - t0
    method.resumed_step_ = loop.resumed_step
    method.privacy_ = privacy_report(method, federation, private)
    return method


def _has_schedule(method: VFLMethod) -> bool:
    """Whether the method declares the schedule parameters (every built-in method does; plugins may not)."""
    return "min_steps" in method.param_space().names


def _early_stopping(method: VFLMethod, schedule: SchedulePlan, train_view: CoordinatorView, view: CoordinatorView,
                    handle: str, checkpointer: Checkpointer | None) -> EarlyStopping:
    """Early stopping on the held-out rows: scored with the model's own prediction on the training data (their
    labels were hidden from training); parties keep their best state beside the checkpoints, if any."""
    rows, y = schedule.rows, view.y[schedule.rows]
    classification = view.task is None or view.task.is_classification

    def validate() -> tuple[float, float]:
        method._validating = True  # the training's own draws (see VFLMethod._row_seeds)
        try:
            return validation_score(method._predict(train_view, handle, rows), y, classification)
        finally:
            method._validating = False

    where = checkpointer.directory / "early-stopping" if checkpointer is not None else None
    return EarlyStopping(validate, schedule.patience, method.federation_, where)


def _preprocess(method: VFLMethod, federation: Federation, handle: str) -> dict[str, Any]:
    """Have every party fit its own standardisation on its training rows (unless ``standardize=false``, or the data
    is already standardised by the paper's protocol); returns what was done, for ``model.json``."""
    already = method.data_info_.get("standardized")
    on = method.settings_.standardize and not already
    federation.preprocess(handle, standardize=on)
    how = ("each party, on its own training rows" if on else
           f"none here: the data was standardised already ({already})" if already else "none (standardize=false)")
    return {"standardize": on, "how": how}


def fingerprint(method: VFLMethod, view: CoordinatorView) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed: method, seed, parameters and a digest of the data index."""
    digest = hashlib.sha256()
    for arr in (view.observed, view.labeled, np.where(view.labeled, view.y, 0)):
        digest.update(np.ascontiguousarray(arr).tobytes())
    digest.update("\x1f".join(str(i) for i in view.ids).encode())
    params = json.loads(json.dumps(method.params_, default=json_default))
    return {"method": method.name, "seed": method.seed, "params": params, "data": digest.hexdigest()[:16],
            "n_samples": view.n_samples}


def _recorder(method: VFLMethod, on_epoch: EpochCallback | None) -> EpochCallback:
    """The loop's epoch report: a history row, a progress line (with ``progress``), then ``on_epoch``."""

    def record(stage: str, epoch: int, metrics: dict[str, float]) -> None:
        row = {"stage": stage, "epoch": epoch, **{k: float(v) for k, v in metrics.items()}}
        method.history_.append(row)
        parts = " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
        report_line(f"[{method.name}] {stage} epoch {epoch}: {parts}", progress_mode(method.progress)[1])
        if on_epoch is not None:
            on_epoch(stage, epoch, dict(metrics))

    return record


def label_prior_of(view: CoordinatorView) -> np.ndarray:
    """The training label prior: the labelled class frequencies (classification) or the labelled mean."""
    y = view.y[view.labeled]
    if view.task.is_classification:
        counts = np.bincount(y.astype(np.int64), minlength=view.task.n_classes).astype(np.float64)
        return counts / counts.sum()
    return np.array([float(np.mean(y))])
