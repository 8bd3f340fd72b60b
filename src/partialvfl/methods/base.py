"""The contract every method follows, and the registry that maps names to methods.

A method is an estimator (``fit``, ``predict_proba``, ``predict``, ``score``, ``save``/``load``) whose work is split
between coordinator code (this class: the active party's label-side role) and a :class:`PartyProgram` that runs at
every party.  The two talk only through the :class:`~partialvfl.federation.runtime.coordinator.Federation`'s
transport, so
the same method runs in one process (the default, :class:`LocalFederation`) or across hosts (gRPC).

What subclasses implement:

* ``name`` (registry key), ``party_program`` (the registered program name);
* ``params``: the declared :class:`~partialvfl.methods.params.ParamSpace` (defaults, types, ranges, help, presets
  per dataset), in a torch-free ``*_spec`` module (a plugin may instead list ``default_params()``); a fitted or
  loaded model reads them typed as ``self.settings_.<name>`` (:mod:`partialvfl.methods.settings`), and keeps the
  plain dict ``params_`` for model files and reports;
* ``_party_config(k)``: the JSON-able config sent to party ``k`` at setup (must include what the program needs to
  build its modules, e.g. ``feature_dim``/``feature_shape`` from ``self.index_``);
* ``_fit(view, handle, loop)``: training, with the training data attached at the parties under ``handle``; every
  epoch goes through ``loop`` (a :class:`~partialvfl.methods.training.TrainingLoop`: progress, checkpoints, resume);
* ``_predict(view, handle, rows)``: class probabilities ``(len(rows), C)`` (classification) or values
  ``(len(rows),)`` (regression) for ``rows``, each of which has at least one observed party;
* ``_coordinator_modules()``: the active party's trained modules by name (saved, checkpointed and restored in
  place); ``_coordinator_extra_state()`` / ``_load_coordinator_extra_state(state)`` for anything else it holds, and
  ``_build_coordinator()`` to make the modules of a loaded model before their weights are read.

Samples with no observed party are never sent to ``_predict``: they get the training label prior (classification:
the labelled training class frequencies; regression: the labelled training mean).  ``evaluate`` counts them.

A row's prediction depends only on the model, the row's data and its ID, never on the other rows of its batch: what
``_predict`` draws at random for a row (Monte Carlo samples, a tie-break) comes from :meth:`VFLMethod._row_seeds`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

import numpy as np

from partialvfl.data.conform import arrange
from partialvfl.data.dataset import UNLABELED, CoordinatorView, Task, VerticalDataset
from partialvfl.data.ids import id_seeds
from partialvfl.federation.runtime.coordinator import Federation, LocalFederation
from partialvfl.federation.wire.messages import MessageLog
from partialvfl.federation.wire.program import StateFileError
from partialvfl.methods.label_dp import rr_keep_probability
from partialvfl.methods.model_files import ModelFileError, read_coordinator_state, read_model_meta, write_model_dir
from partialvfl.methods.params import ParamSpace, inferred_space, parse_bool, with_common
from partialvfl.methods.private_fit import (
    PrivacyHooks,
    check_dp_options,
    label_dp_view,
    label_prior,
    plans_for,
    privacy_report,
    private_parties,
    restore_privacy,
)
from partialvfl.methods.registry import METHODS, get_method, load_all, method_names, register_method
from partialvfl.methods.schedule import EarlyStopping, SchedulePlan, plan_schedule, resolve_min_steps, validation_score
from partialvfl.methods.settings import TypedParams
from partialvfl.methods.training import EpochCallback, TrainingLoop, check_finite_output
from partialvfl.methods.widths import fit_widths
from partialvfl.utils.jsonable import json_default
from partialvfl.utils.progress import PROGRESS_MODES, progress_mode, report_line

if TYPE_CHECKING:
    from torch import nn

    from partialvfl.federation.runtime.checkpoint import Checkpointer

__all__ = ["IndexInfo", "METHODS", "ModelFileError", "VFLMethod", "get_method", "load_all", "method_names",
           "register_method"]

FORMAT_VERSION = 2  # 2: feature names, preprocessing, digests (format 1 models still load)


@dataclass(frozen=True)
class IndexInfo:
    """What a fitted model remembers of its training data: task (with the class labels), party names in order,
    feature widths, shapes and names per party (``None`` in models saved before names were kept), the label holder."""

    task: Task
    party_names: tuple[str, ...]
    feature_dims: tuple[int, ...]
    feature_shapes: tuple[tuple[int, ...], ...]
    active_party: int
    feature_names: tuple[tuple[str, ...], ...] | None = None

    @property
    def n_parties(self) -> int:
        return len(self.party_names)

    @classmethod
    def of(cls, view: CoordinatorView) -> IndexInfo:
        """What a model keeps of the data it was fitted on (no values): task, parties, shapes, feature names."""
        feature_names = view.feature_names
        names = None if feature_names is None else tuple(tuple(str(c) for c in f) for f in feature_names)
        return cls(view.task, tuple(view.party_names), tuple(view.feature_dims),
                   tuple(tuple(s) for s in view.feature_shapes), view.active_party, names)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["task"] = self.task.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IndexInfo:
        names = d.get("feature_names")
        return cls(Task.from_dict(d["task"]), tuple(d["party_names"]), tuple(d["feature_dims"]),
                   tuple(tuple(s) for s in d["feature_shapes"]), int(d["active_party"]),
                   None if names is None else tuple(tuple(f) for f in names))


class VFLMethod(PrivacyHooks, TypedParams, ABC):
    """Base class of every method: parameters, presets, the estimator API, save/load."""

    name: ClassVar[str] = ""
    party_program: ClassVar[str] = ""
    #: the declared parameters and presets (``methods/*_spec.py``); methods without one list ``default_params()``
    params: ClassVar[ParamSpace | None] = None
    presets: ClassVar[tuple[str, ...]] = ("fast", "paper")
    #: while a fit validates for early stopping (:meth:`_row_seeds` then gives ``None``)
    _validating: bool = False
    #: whether batches of predictions may be in flight side by side at the parties (the lanes of a prediction
    #: service): not for a method whose parties keep state from one inference round to the next (FALSE-VFL's
    #: ``encode`` then ``decode``: another batch's ``encode`` in between would replace it)
    parallel_inference: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.params is not None:
            cls.presets = cls.params.preset_names

    def __init__(self, preset: str = "fast", *, seed: int = 0, progress: bool | str = False, device: Any = "cpu",
                 precision: str = "fp32", compile: bool = False,  # noqa: A002 - torch's word
                 label_dp: float | None = None, label_dp_seed: int | None = None, label_dp_prior: bool = False,
                 dp_options: Mapping[str, Any] | None = None, **params: Any) -> None:
        """``progress``: ``True`` shows a bar over the epochs when stderr is a terminal (nothing per epoch when it is
        not), ``"epochs"`` one line per epoch (its metrics), ``False`` nothing."""
        from partialvfl.utils.devices import check_precision, resolve_device

        # what get_params returns: the arguments as given (scikit-learn's clone checks they are the same objects)
        self._run_options: dict[str, Any] = {
            "preset": preset, "seed": seed, "progress": progress, "device": device, "precision": precision,
            "compile": compile, "label_dp": label_dp, "label_dp_seed": label_dp_seed, "label_dp_prior": label_dp_prior,
            "dp_options": dp_options}
        self._given_params = dict(params)
        if preset not in self.presets:
            raise ValueError(f"{self.name}: unknown preset {preset!r}; choose one of {', '.join(self.presets)}")
        if not (isinstance(progress, bool) or progress in PROGRESS_MODES):
            raise ValueError(f"{self.name}: progress must be True, False or 'epochs', got {progress!r}")
        self.preset = preset
        self.seed = int(seed)
        self.progress = progress
        # how it runs, not what it learns (not parameters: a model fitted on a GPU is the same model)
        self.device = device
        self.device_ = resolve_device(device, what="device")
        self.precision = check_precision(precision, what="precision")
        self.compile = parse_bool(compile, f"{self.name}: compile")
        self.overrides = self.param_space().validate(params, owner=self.name)
        self.history_: list[dict[str, Any]] = []
        if label_dp is not None:
            rr_keep_probability(label_dp, 2)  # a positive, finite epsilon, or an error naming it
        self.label_dp = None if label_dp is None else float(label_dp)
        self.label_dp_seed = None if label_dp_seed is None else int(label_dp_seed)
        self.label_dp_prior = parse_bool(label_dp_prior, f"{self.name}: label_dp_prior")
        self.dp_options_ = check_dp_options(dp_options)

    # ------------------------------------------------------------------ parameters
    @classmethod
    def param_space(cls) -> ParamSpace:
        """The declared parameters (or, for a method without a declaration, its defaults with names checked)."""
        if cls.params is not None:
            return with_common(cls.params)
        legacy = cls.preset_params.__func__ is not VFLMethod.preset_params.__func__  # type: ignore[attr-defined]
        return with_common(inferred_space(cls.default_params(), {
            p: (lambda ds, p=p: cls.preset_params(p, ds or None)) if legacy else (lambda ds: {}) for p in cls.presets}))

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        """Every tunable of the method with its default."""
        if cls.params is None:
            raise NotImplementedError(f"{cls.__name__} declares no parameters (params) and lists no defaults")
        return with_common(cls.params).defaults()

    @classmethod
    def preset_params(cls, preset: str, dataset: str | None) -> dict[str, Any]:
        """Overrides the preset applies on top of the defaults (may depend on the dataset)."""
        return cls.param_space().preset(preset, dataset, owner=cls.name) if cls.params is not None else {}

    @classmethod
    def epoch_param_names(cls) -> list[str]:
        """The parameters that count training epochs (what the CLI's ``--epochs N`` sets, all of them)."""
        if cls.params is not None:
            return cls.params.epoch_names()
        return [k for k in cls.default_params() if k in ("epochs", "pretrain_epochs") or k.startswith("epochs_")]

    def resolve_params(self, dataset: str | None) -> dict[str, Any]:
        """Defaults, then the preset's values for ``dataset``, then this instance's overrides (validated); a
        schedule's ``min_steps = null`` resolved (:func:`~partialvfl.methods.schedule.resolve_min_steps`)."""
        return resolve_min_steps(self.param_space().resolve(self.preset, dataset, self.overrides, owner=self.name),
                                 self.overrides)

    #: the keyword options of ``__init__`` that are not declared parameters (how a fit runs, label DP, party DP)
    RUN_OPTIONS: ClassVar[tuple[str, ...]] = ("preset", "seed", "progress", "device", "precision", "compile",
                                              "label_dp", "label_dp_seed", "label_dp_prior", "dp_options")

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """scikit-learn's ``get_params``: every run option (``RUN_OPTIONS``) and every declared parameter this model
        was given, as given (``type(self)(**model.get_params())`` is the same unfitted model, so
        ``sklearn.base.clone`` works).  A declared parameter not given is absent: it follows the preset, which is
        resolved per dataset at ``fit`` (``param_space().names`` lists every name ``set_params`` accepts).
        ``deep`` is accepted for scikit-learn; a method holds no nested estimator."""
        return {**self._run_options, **self._given_params}

    def set_params(self, **params: Any) -> Self:
        """scikit-learn's ``set_params``: change run options and declared parameters (by name or alias), validated
        as ``__init__`` validates them (nothing is changed if one is refused); returns ``self``.  A fitted model
        keeps what it learnt; the new values apply to the next ``fit``."""
        options = {k: v for k, v in params.items() if k in self.RUN_OPTIONS}
        declared = {k: v for k, v in params.items() if k not in self.RUN_OPTIONS}
        given = dict(self._given_params)
        space = self.param_space()
        for name in declared:  # a new value for a parameter given under another name (an alias) replaces it
            canonical = space.canonical(name, owner=self.name)
            given = {k: v for k, v in given.items() if space.canonical(k, owner=self.name) != canonical}
        fresh = type(self)(**{**self._run_options, **options}, **given, **declared)  # validated, or raises
        vars(self).update({k: v for k, v in vars(fresh).items() if k != "history_"})  # fitted state kept
        return self

    # ------------------------------------------------------------------ subclass hooks
    @abstractmethod
    def _party_config(self, party: int) -> dict[str, Any]:
        """JSON-able configuration sent to party ``party`` at setup."""

    @abstractmethod
    def _fit(self, view: CoordinatorView, handle: str, loop: TrainingLoop) -> None:
        """Train, with the training data attached at every party under ``handle``; epochs run through ``loop``."""

    @abstractmethod
    def _predict(self, view: CoordinatorView, handle: str, rows: np.ndarray) -> np.ndarray:
        """Probabilities (classification) or values (regression) for ``rows`` (each with >= 1 observed party)."""

    def _coordinator_modules(self) -> dict[str, nn.Module]:
        """The active party's modules by name (their ``state_dict`` is saved under that name)."""
        return {}

    def _plan(self, federation: Federation) -> None:  # noqa: B027 - optional
        """Fix the parameters a method derives from what the parties announce (``federation.announced_policies()``;
        e.g. a wire protocol within their policies), in ``params_``, before anything is set up."""

    def _build_coordinator(self) -> None:  # noqa: B027 - optional
        """Make the coordinator's modules (seeded) for a model being loaded; weights are read afterwards."""

    def _coordinator_extra_state(self) -> dict[str, Any]:
        """What the active party holds besides its modules' weights (plain values and tensors)."""
        return {}

    def _load_coordinator_extra_state(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional
        """Restore :meth:`_coordinator_extra_state`."""


    def _coordinator_state(self) -> dict[str, Any]:
        """The active party's part of a saved model or checkpoint: module weights by name, plus extras."""
        state: dict[str, Any] = {name: {k: v.detach().clone() for k, v in m.state_dict().items()}
                                 for name, m in self._coordinator_modules().items()}
        state.update(self._coordinator_extra_state())
        return state

    def _load_coordinator_in_place(self, state: dict[str, Any]) -> None:
        """Load :meth:`_coordinator_state` into the existing modules (optimisers keep pointing at them)."""
        for name, module in self._coordinator_modules().items():
            module.load_state_dict(state[name])
        self._load_coordinator_extra_state(state)

    def _load_coordinator_state(self, state: dict[str, Any]) -> None:
        """Build the coordinator's modules for a loaded model and read their weights."""
        self._build_coordinator()
        self._load_coordinator_in_place(state)
        for module in self._coordinator_modules().values():
            module.eval()

    # ------------------------------------------------------------------ helpers for subclasses
    @property
    def transport(self):  # noqa: ANN201 - Transport
        return self.federation_.transport

    def _tensor(self, data: Any, dtype: Any = None) -> Any:
        """``data`` (an array, e.g. row indices or labels) as a tensor on the coordinator's device."""
        import torch

        from partialvfl.utils.devices import to_device

        return to_device(torch.as_tensor(data, dtype=dtype), self.device_)  # on a GPU: queued, the host goes on

    def _on_device(self, module: nn.Module) -> nn.Module:
        """``module`` (built seeded on the CPU: the same initial weights on every device) on the coordinator's."""
        return module.to(self.device_)

    def _row_seeds(self, view: CoordinatorView, rows: np.ndarray, *keys: object, secret: bytes = b""
                   ) -> np.ndarray | None:
        """Each of ``rows``' own seed (int64) for what a prediction draws at random for it (Monte Carlo samples, a
        tie-break), from the model's seed, ``secret`` (for seeds that cross to a party: something it does not hold,
        e.g. :meth:`_label_side_digest`), ``keys`` and the row's normalised ID (:func:`~partialvfl.data.ids.
        id_seeds`): a row's prediction then depends on its data and ID alone, never on the rest of its batch.

        ``None`` while a fit validates for early stopping: those draws stay the training's own (by batch or
        position), because a federation's training view knows its users by alignment tokens, not by ID, and a fit
        must validate alike in one process and across a federation (and as it did before per-row seeds)."""
        if self._validating:
            return None
        return id_seeds(np.asarray(view.ids)[np.asarray(rows, dtype=np.int64)], self.seed, *keys, secret=secret)

    def _label_side_digest(self) -> bytes:
        """SHA-256 of the active party's module weights: a secret of the fitted model that never leaves the label
        side (the parties get the model's seed at setup, never these weights); the same for a saved and loaded
        model, and for an in-process and a federated fit that are bit for bit the same model."""
        import torch

        digest = hashlib.sha256()
        for name, module in sorted(self._coordinator_modules().items()):
            for key, value in sorted(module.state_dict().items()):
                digest.update(f"{name}.{key}".encode())
                if value.is_meta:  # no data to hash (the meta device runs shapes only): its shape stands in
                    digest.update(repr((tuple(value.shape), str(value.dtype))).encode())
                    continue
                digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.digest()

    def _computing(self) -> contextlib.AbstractContextManager[None]:
        """The context the coordinator computes in (bf16 autocast with ``precision='bf16'``)."""
        from partialvfl.utils.devices import autocast

        return autocast(self.device_, self.precision)

    def _recorder(self, on_epoch: EpochCallback | None) -> EpochCallback:
        """The loop's epoch report: a history row, a progress line (with ``progress``), then ``on_epoch``."""

        def record(stage: str, epoch: int, metrics: dict[str, float]) -> None:
            row = {"stage": stage, "epoch": epoch, **{k: float(v) for k, v in metrics.items()}}
            self.history_.append(row)
            parts = " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
            report_line(f"[{self.name}] {stage} epoch {epoch}: {parts}", progress_mode(self.progress)[1])
            if on_epoch is not None:
                on_epoch(stage, epoch, dict(metrics))

        return record

    # ------------------------------------------------------------------ estimator API
    def fit(self, train: VerticalDataset, *, federation: Federation | None = None, log: MessageLog | None = None,
            checkpointer: Checkpointer | None = None, on_epoch: EpochCallback | None = None,
            party_dp: Mapping[int | str, tuple[float, float]] | None = None) -> Self:
        """Fit on ``train`` (labelled and unlabelled samples, any per-sample observed mask), in process by default.

        ``checkpointer`` checkpoints every N steps and resumes from its last checkpoint; ``on_epoch(stage, epoch,
        metrics)`` is called after every epoch; ``party_dp``: ``{party: (epsilon, delta)}``, the in-process parties'
        own differential-privacy budgets (``[policy] dp_epsilon, dp_delta`` of a deployed party).
        Without ``federation`` the parties run in this process on the model's ``device`` and ``precision``.
        """
        if federation is not None and party_dp:
            raise ValueError("party_dp sets the budgets of the in-process parties; a given federation's parties "
                             "keep their own (LocalFederation.for_dataset(..., party_dp=...))")
        fed = federation or LocalFederation.for_dataset(train, log=log, party_dp=party_dp, device=self.device_,
                                                        precision=self.precision, compile=self.compile)
        handle = fed.attach(train, "train")
        dataset_name = train.info.get("dataset") or train.info.get("protocol", {}).get("dataset") or train.name or None
        self.fit_federated(fed, train.coordinator_view(), handle, dataset=dataset_name, data_info=train.info,
                           checkpointer=checkpointer, on_epoch=on_epoch)
        fed.release(handle)
        return self

    def fit_federated(self, federation: Federation, view: CoordinatorView, handle: str, *,
                      dataset: str | None = None, data_info: dict[str, Any] | None = None,
                      checkpointer: Checkpointer | None = None, on_epoch: EpochCallback | None = None) -> Self:
        """Fit with the training data already attached at the parties under ``handle`` (any deployment).

        ``checkpointer``: checkpoint every N steps into its directory and, if it holds a checkpoint, resume from it
        (the resumed fit ends in the same parameters as an uninterrupted one); ``on_epoch(stage, epoch, metrics)``:
        called after every epoch.
        """
        if view.n_parties != federation.n_parties:
            raise ValueError(f"the data has {view.n_parties} parties, the federation {federation.n_parties}")
        if not view.labeled.any():
            raise ValueError(f"{self.name}: the training data has no labelled sample")
        self.federation_ = federation
        federation.transport.device = self.device_  # replies arrive on the coordinator's device
        self.index_ = IndexInfo.of(view)
        self.params_ = self.resolve_params(dataset)
        self._plan(federation)
        self.data_info_ = dict(data_info or {})
        private = private_parties(self, federation)  # refuses a method without differential privacy, naming it
        # the labels the coordinator trains with (randomized under label DP; RRWithPrior: a first fit gives priors)
        view = label_dp_view(self, view, federation, handle, dataset)
        prior = label_prior(self, view)
        self.label_prior_ = _label_prior(view) if prior is None else prior
        self.history_ = []
        schedule = self.schedule_ = plan_schedule(self.settings_, view, self.seed) if self._has_schedule() else None
        self.width_choice_ = fit_widths(self, federation)  # within every party's announced width caps
        if self.width_choice_ is not None:
            report_line(self.width_choice_)
        federation.setup(self.party_program, [self._party_config(k) for k in range(view.n_parties)], self.seed,
                         plans=plans_for(self, private, "fit"))
        self.preprocessing_ = self._preprocess(federation, handle)
        if checkpointer is not None:
            checkpointer.bind(federation)
        train_view = view
        stopping = None
        if schedule is not None and schedule.early_stopping:
            train_view = dataclasses.replace(view, labeled=view.labeled & ~np.isin(np.arange(view.n_samples),
                                                                                  schedule.rows))
            stopping = self._early_stopping(schedule, train_view, view, handle, checkpointer)
        loop = TrainingLoop(
            federation.transport, name=self.name, history=self.history_, report=self._recorder(on_epoch),
            save_coordinator=self._coordinator_state, load_coordinator=self._load_coordinator_in_place,
            checkpointer=checkpointer, fingerprint=self._fingerprint(view),
            show_progress=progress_mode(self.progress)[0], stopping=stopping,
        )
        t0 = time.perf_counter()
        try:
            with self._computing():
                self._fit(train_view, handle, loop)
        finally:
            if stopping is not None:
                stopping.close()
        loop.finish()
        if schedule is not None and loop.stopping_result is not None:
            schedule.result = loop.stopping_result
        self.fit_seconds_ = time.perf_counter() - t0
        self.resumed_step_ = loop.resumed_step
        self.privacy_ = privacy_report(self, federation, private)
        return self

    def _has_schedule(self) -> bool:
        """Whether the method declares the schedule parameters (every built-in method does; plugins may not)."""
        return "min_steps" in self.param_space().names

    def _early_stopping(self, schedule: SchedulePlan, train_view: CoordinatorView, view: CoordinatorView,
                        handle: str, checkpointer: Checkpointer | None) -> EarlyStopping:
        """Early stopping on the held-out rows: scored with the model's own prediction on the training data
        (their labels were hidden from training); parties keep their best state beside the checkpoints, if any."""
        rows, y = schedule.rows, view.y[schedule.rows]
        classification = view.task is None or view.task.is_classification

        def validate() -> tuple[float, float]:
            self._validating = True  # the training's own draws (see _row_seeds)
            try:
                return validation_score(self._predict(train_view, handle, rows), y, classification)
            finally:
                self._validating = False

        where = checkpointer.directory / "early-stopping" if checkpointer is not None else None
        return EarlyStopping(validate, schedule.patience, self.federation_, where)

    def _supervised_epochs(self, stage: str, epochs: int, steps_per_epoch: int) -> int:
        """The epochs the supervised stage runs: ``epochs`` raised to the schedule's ``min_steps`` (recorded in
        ``schedule_``); methods without a schedule run ``epochs``."""
        schedule = getattr(self, "schedule_", None)
        return epochs if schedule is None else schedule.stage(stage, epochs, steps_per_epoch)

    def _preprocess(self, federation: Federation, handle: str) -> dict[str, Any]:
        """Have every party fit its own standardisation on its training rows (unless ``standardize=false``, or the
        data is already standardised by the paper's protocol); returns what was done, for ``model.json``."""
        already = self.data_info_.get("standardized")
        on = self.settings_.standardize and not already
        federation.preprocess(handle, standardize=on)
        how = ("each party, on its own training rows" if on else
               f"none here: the data was standardised already ({already})" if already else "none (standardize=false)")
        return {"standardize": on, "how": how}

    def _fingerprint(self, view: CoordinatorView) -> dict[str, Any]:
        """What must match for a checkpoint to be resumed: method, seed, parameters and a digest of the data index."""
        digest = hashlib.sha256()
        for arr in (view.observed, view.labeled, np.where(view.labeled, view.y, 0)):
            digest.update(np.ascontiguousarray(arr).tobytes())
        digest.update("\x1f".join(str(i) for i in view.ids).encode())
        params = json.loads(json.dumps(self.params_, default=json_default))
        return {"method": self.name, "seed": self.seed, "params": params, "data": digest.hexdigest()[:16],
                "n_samples": view.n_samples}

    def _check_fitted(self) -> None:
        if not hasattr(self, "federation_"):
            raise RuntimeError(f"{self.name}: call fit (or load) before predicting")

    @property
    def classes_(self) -> np.ndarray:
        """The class labels as the model saw them in training (scikit-learn's ``classes_``)."""
        self._check_fitted()
        if not self.index_.task.is_classification:
            raise AttributeError(f"{self.name}: a regression model has no classes_")
        return np.array(list(self.index_.task.classes))

    def conform(self, data: VerticalDataset) -> VerticalDataset:
        """``data`` with the model's parties and columns, matched by name (any order); data whose parties or
        feature names disagree with the training data's is refused, naming the party and the first mismatch."""
        self._check_fitted()
        idx = self.index_
        return arrange(data, idx.party_names, idx.feature_names, idx.feature_dims, active_party=idx.active_party)

    @contextlib.contextmanager
    def attached(self, data: VerticalDataset) -> Iterator[tuple[VerticalDataset, str]]:
        """``data`` conformed to the model (:meth:`conform`) and attached at the parties for the ``with`` block:
        yields the conformed data and its handle, and releases the handle on the way out."""
        data = self.conform(data)
        handle = self.federation_.attach(data)
        try:
            yield data, handle
        finally:
            self.federation_.release(handle)

    def predict_output(self, data: VerticalDataset) -> np.ndarray:
        """Probabilities (classification, ``(N, C)``) or predicted values (regression, ``(N,)``) for ``data``."""
        with self.attached(data) as (data, handle):
            return self.predict_output_federated(data.coordinator_view(), handle)

    def predict_output_federated(self, view: CoordinatorView, handle: str) -> np.ndarray:
        """As :meth:`predict_output`, for samples already attached at the parties under ``handle``.

        The view's labels are not used (the model predicts with its own task); a non-finite output is an error.
        """
        self._check_fitted()
        n = view.n_samples
        task = self.index_.task
        no_labels = np.full(n, UNLABELED, dtype=np.int64) if task.is_classification else np.full(n, np.nan)
        view = dataclasses.replace(view, task=task, y=no_labels, labeled=np.zeros(n, dtype=bool))
        some = view.observed.any(axis=1)
        if task.is_classification:
            out = np.tile(self.label_prior_, (n, 1)).astype(np.float64)
        else:
            out = np.full(n, float(self.label_prior_[0]))
        rows = np.flatnonzero(some)
        if rows.size:
            t0 = time.perf_counter()
            out[rows] = self._predict(view, handle, rows)  # float32 here (heads, softmax); bf16 at the parties
            self.predict_seconds_ = time.perf_counter() - t0
        check_finite_output(self.name, out, view.ids)
        return out

    def parties_used(self, view: CoordinatorView | VerticalDataset) -> np.ndarray:
        """``(N, K)``: which parties' features the prediction of each row of ``view`` uses (its ``observed`` holds
        which parties hold, or answered for, each row).  By default every party that holds the row; a method that
        predicts some rows from fewer parties says so here.  A row with none is predicted by :meth:`fallback`."""
        return np.array(view.observed, dtype=bool)

    def fallback(self) -> str:
        """What a row whose prediction uses no party's features (:meth:`parties_used`) is predicted from."""
        return "the training label prior"

    def predict_proba(self, data: VerticalDataset) -> np.ndarray:
        """Class probabilities ``(N, C)``, columns in the order of :attr:`classes_`."""
        self._check_fitted()
        if not self.index_.task.is_classification:
            raise ValueError(f"{self.name}: predict_proba is for classification; use predict for regression")
        return self.predict_output(data)

    def predict(self, data: VerticalDataset) -> np.ndarray:
        """Class labels (values of :attr:`classes_`, as scikit-learn) or predicted values (regression)."""
        out = self.predict_output(data)
        return self.classes_[out.argmax(axis=1)] if self.index_.task.is_classification else out

    def score(self, data: VerticalDataset) -> float:
        """Accuracy (classification; labels matched by value, a class unseen in training counts as an error) or
        RMSE (regression) over the labelled samples of ``data``."""
        from partialvfl.methods.evaluation import evaluate

        res = evaluate(self, data)
        return res["accuracy"] if self.index_.task.is_classification else res["rmse"]

    # ------------------------------------------------------------------ persistence
    def _meta(self) -> dict[str, Any]:
        """What ``model.json`` says about the model."""
        return {
            "format": FORMAT_VERSION,
            "method": self.name,
            "preset": self.preset,
            "seed": self.seed,
            "overrides": self.overrides,
            "params": self.params_,
            "index": self.index_.to_dict(),
            "label_prior": [float(v) for v in self.label_prior_],
            "preprocessing": getattr(self, "preprocessing_", None),
            "data_info": self.data_info_,
            "fit_seconds": getattr(self, "fit_seconds_", None),
            "schedule": schedule.to_dict() if (schedule := getattr(self, "schedule_", None)) is not None else None,
            "history": self.history_,
            **({"privacy": {**self.privacy_, "dp_options": self.dp_options_}}
               if getattr(self, "privacy_", None) else {}),
        }

    def save(self, directory: str | Path) -> Path:
        """Write ``model.json``, ``coordinator.pt`` and every party's state (``party-<k>.pt`` here in one process, on
        the party's own disk in a deployment) all at once: see :mod:`partialvfl.methods.model_files`."""
        self._check_fitted()
        fed = self.federation_
        return write_model_dir(Path(directory), self._meta(), self._coordinator_state(),
                               save_parties=lambda d, digest: fed.save(d, model=digest), forget_parties=fed.forget)

    @classmethod
    def load(cls, directory: str | Path, *, federation: Federation | None = None,
             log: MessageLog | None = None, device: Any = "cpu", precision: str = "fp32",
             compile: bool = False) -> VFLMethod:  # noqa: A002 - torch's word
        """Restore a saved model (any method when called on ``VFLMethod``) with its parties' states.

        The model runs on ``device`` whatever device it was fitted on (states are read to the CPU, then moved);
        without ``federation`` its parties run in this process on that device too.

        Raises :class:`~partialvfl.methods.model_files.ModelFileError` (one line naming the file) for a missing,
        corrupted, truncated or foreign file, and when a party's file belongs to another model.
        """
        from partialvfl.utils.devices import check_precision, resolve_device

        resolve_device(device, what="device")  # a bad device is the caller's error, not the file's
        check_precision(precision, what="precision")
        d = Path(directory)
        meta = read_model_meta(d)
        klass = get_method(meta["method"]) if cls is VFLMethod or not cls.name else cls
        if klass.name != meta["method"]:
            raise ModelFileError(f"{d} holds a {meta['method']!r} model, not {klass.name!r}")
        obj = klass._from_meta(meta, d, device=device, precision=precision, compile=compile)
        state = read_coordinator_state(d, meta)
        fed = federation or LocalFederation(obj.index_.party_names, obj.index_.active_party, log=log,
                                            device=obj.device_, precision=obj.precision, compile=obj.compile)
        fed.transport.device = obj.device_
        obj.federation_ = fed
        fed.setup(obj.party_program, [obj._party_config(k) for k in range(obj.index_.n_parties)], obj.seed,
                  plans=plans_for(obj, private_parties(obj, fed), "predict"))
        try:
            fed.load(d, model=meta.get("digest"))
        except StateFileError as e:
            raise ModelFileError(str(e)) from None
        try:
            obj._load_coordinator_state(state)
        except (KeyError, RuntimeError, TypeError, ValueError) as e:
            raise ModelFileError(f"{d / 'coordinator.pt'} does not fit the model model.json describes "
                                 f"({type(e).__name__}: {str(e)[:200]})") from None
        return obj

    @classmethod
    def _from_meta(cls, meta: dict[str, Any], d: Path, **run: Any) -> VFLMethod:
        """The estimator ``model.json`` describes, before any state is loaded (``run``: device, precision,
        compile)."""
        space = cls.param_space()
        try:
            obj = cls(meta["preset"], seed=meta["seed"], **run, **space.renamed(meta["overrides"]))
            obj.index_ = IndexInfo.from_dict(meta["index"])
            saved = space.renamed(meta["params"])
            # models saved before party standardisation existed were trained on features as they are
            values = {**space.defaults(), "standardize": False, **saved}
            declared = set(space.names)
            obj._set_params({k: v for k, v in values.items() if k in declared},
                            {k: v for k, v in values.items() if k not in declared})
            obj.label_prior_ = np.asarray(meta["label_prior"], dtype=np.float64)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFileError(f"{d / 'model.json'} does not describe a usable {cls.name!r} model "
                                 f"({type(e).__name__}: {e})") from None
        restore_privacy(obj, meta)
        obj.preprocessing_ = meta.get("preprocessing")
        obj.data_info_ = meta.get("data_info", {})
        obj.history_ = meta.get("history", [])
        obj.fit_seconds_ = meta.get("fit_seconds")
        obj.schedule_ = SchedulePlan.from_dict(meta["schedule"]) if meta.get("schedule") else None
        return obj


def _label_prior(view: CoordinatorView) -> np.ndarray:
    y = view.y[view.labeled]
    if view.task.is_classification:
        counts = np.bincount(y.astype(np.int64), minlength=view.task.n_classes).astype(np.float64)
        return counts / counts.sum()
    return np.array([float(np.mean(y))])
