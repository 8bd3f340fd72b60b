"""The contract every method follows, and the registry that maps names to methods.

A method is an estimator (``fit``, ``predict_proba``, ``predict``, ``score``, ``save``/``load``) whose work is split
between coordinator code (this class: the active party's label-side role) and a :class:`PartyProgram` that runs at
every party.  The two talk only through the :class:`~partialvfl.federation.runtime.coordinator.Federation`'s
transport, so the same method runs in one process (the default, :class:`LocalFederation`) or across hosts (gRPC).
This class is the contract and the hooks; what a fit does around the hooks is :mod:`partialvfl.methods.lifecycle`,
what a saved model holds :mod:`partialvfl.methods.model_files`, how a fit runs :mod:`partialvfl.methods.run_options`.

What subclasses implement:

* ``name`` (registry key), ``party_program`` (the registered program name);
* ``params``: the declared :class:`~partialvfl.methods.params.ParamSpace` (defaults, types, ranges, help, presets
  per dataset), in a torch-free ``spec`` module (a plugin may instead list ``default_params()``); a fitted or
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
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

import numpy as np

from partialvfl.data.conform import arrange
from partialvfl.data.dataset import UNLABELED, CoordinatorView, VerticalDataset
from partialvfl.federation.runtime.coordinator import Federation
from partialvfl.federation.wire.messages import MessageLog
from partialvfl.methods import lifecycle
from partialvfl.methods.estimator_params import EstimatorParams
from partialvfl.methods.model_files import (
    ModelFileError,
    load_model,
    model_meta,
    read_model_meta,
    write_model_dir,
)
from partialvfl.methods.params import PRIVACY_PARAMS, ParamSpace, check_seed
from partialvfl.methods.private_fit import (
    DP_OPTIONS,
    PrivacyHooks,
    privacy_space,
)
from partialvfl.methods.registry import METHODS, get_method, load_all, method_names
from partialvfl.methods.row_seeds import RowSeeds
from partialvfl.methods.run_options import RunOptions
from partialvfl.methods.settings import TypedParams
from partialvfl.methods.training import EpochCallback, TrainingLoop, check_finite_output
from partialvfl.utils.devices import DeviceError

if TYPE_CHECKING:
    from torch import nn

    from partialvfl.federation.runtime.checkpoint import Checkpointer

__all__ = ["METHODS", "ModelFileError", "NotFittedError", "VFLMethod", "get_method", "load_all", "method_names"]


class NotFittedError(RuntimeError, AttributeError):
    """A model used before ``fit`` or ``load``.

    An ``AttributeError`` too, as scikit-learn's own: a fitted attribute (``classes_``) read before ``fit`` is absent
    (``hasattr`` is false), not an error of another kind.
    """


class VFLMethod(EstimatorParams, PrivacyHooks, TypedParams, RowSeeds, ABC):
    """Base class of every method: parameters, presets, the estimator API, save/load."""

    name: ClassVar[str] = ""
    party_program: ClassVar[str] = ""
    #: the declared parameters and presets (``methods/<family>/spec.py``); methods without one list ``default_params()``
    params: ClassVar[ParamSpace | None] = None
    presets: ClassVar[tuple[str, ...]] = ("fast", "paper")
    #: while a fit validates for early stopping (:meth:`_row_seeds` then gives ``None``)
    _validating: bool = False
    #: per-row figures a prediction can report beside its output (``predict_output(..., diagnostics={})``); the
    #: method's ``_predict`` then takes a ``diagnostics`` dict and fills one array per name for the rows it predicts
    prediction_diagnostics: ClassVar[tuple[str, ...]] = ()
    #: whether batches of predictions may be in flight side by side at the parties (the lanes of a prediction
    #: service): not for a method whose parties keep state from one inference round to the next (FALSE-VFL's
    #: ``encode`` then ``decode``: another batch's ``encode`` in between would replace it)
    parallel_inference: ClassVar[bool] = False
    #: why the method cannot predict from a subset of its parties (``None``: it can, so it explains its predictions)
    subset_refusal: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.params is not None:
            cls.presets = cls.params.preset_names

    def __init__(self, preset: str = "fast", *, seed: int = 0, progress: bool | str = False, device: Any = "cpu",
                 precision: str = "fp32", compile: bool = False,  # torch's word
                 **params: Any) -> None:
        """``progress``, ``device``, ``precision``, ``compile``: how the fit runs (:class:`~partialvfl.methods.
        run_options.RunOptions`); ``params``: declared parameters by name, the method's (:meth:`param_space`) and
        label DP's and party DP's (:data:`~partialvfl.methods.params.PRIVACY_PARAMS`), each checked here."""
        # what get_params returns: the arguments as given (scikit-learn's clone checks they are the same objects)
        self._run_given: dict[str, Any] = {"preset": preset, "seed": seed, "progress": progress, "device": device,
                                           "precision": precision, "compile": compile}
        self._given_params = dict(params)
        if preset not in self.presets:
            raise ValueError(f"{self.name}: unknown preset {preset!r}; choose one of {', '.join(self.presets)}")
        self.preset = preset
        self.seed = check_seed(seed, owner=self.name)  # declared (params.SEED): never a float truncated
        try:  # how it runs, not what it learns (not parameters: a model fitted on a GPU is the same model)
            self.run_options = RunOptions(progress, device, precision, compile)
        except DeviceError:
            raise  # names the device or precision as the command line's errors do
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        checked = self._given_space().validate(params, owner=self.name)  # the one check of each value given
        private = privacy_space().names
        self.overrides = {k: v for k, v in checked.items() if k not in private}
        dp = {**PRIVACY_PARAMS.defaults(), **{k: v for k, v in checked.items() if k in PRIVACY_PARAMS.names}}
        self.label_dp, self.label_dp_seed, self.label_dp_prior, self.label_dp_mechanism = (
            dp[k] for k in ("label_dp", "label_dp_seed", "label_dp_prior", "label_dp_mechanism"))
        # a label mechanism's own declared parameters (label_dp_mechanism's; checked against it at fit)
        self.label_dp_params = {k: v for k, v in checked.items() if k in private and k not in PRIVACY_PARAMS.names}
        self.dp_options = {k: dp[f"dp_{k}"] for k in DP_OPTIONS}

    progress = property(lambda self: self.run_options.progress, doc="RunOptions.progress")
    device = property(lambda self: self.run_options.device, doc="RunOptions.device, as given")
    torch_device = property(lambda self: self.run_options.torch_device, doc="the torch device the coordinator uses")
    precision = property(lambda self: self.run_options.precision, doc="RunOptions.precision")
    compile = property(lambda self: self.run_options.compile, doc="RunOptions.compile")

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

    def _plan(self, federation: Federation) -> None:  # optional
        """Fix the parameters a method derives from what the parties announce (``federation.announced_policies()``;
        e.g. a wire protocol within their policies), in ``params_``, before anything is set up."""

    def _build_coordinator(self) -> None:  # optional
        """Make the coordinator's modules (seeded) for a model being loaded; weights are read afterwards."""

    def _coordinator_extra_state(self) -> dict[str, Any]:
        """What the active party holds besides its modules' weights (plain values and tensors)."""
        return {}

    def _load_coordinator_extra_state(self, state: dict[str, Any]) -> None:  # optional
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
    def transport(self):  # Transport
        """The transport of the federation the model was fitted on or loaded with."""
        return self.federation_.transport

    def _tensor(self, data: Any, dtype: Any = None) -> Any:
        """``data`` (an array, e.g. row indices or labels) as a tensor on the coordinator's device."""
        import torch

        from partialvfl.utils.devices import to_device

        return to_device(torch.as_tensor(data, dtype=dtype), self.torch_device)  # on a GPU: queued, the host goes on

    def _on_device(self, module: nn.Module) -> nn.Module:
        """``module`` (built seeded on the CPU: the same initial weights on every device) on the coordinator's."""
        return module.to(self.torch_device)

    def _computing(self) -> contextlib.AbstractContextManager[None]:
        """The context the coordinator computes in (bf16 autocast with ``precision='bf16'``)."""
        from partialvfl.utils.devices import autocast

        return autocast(self.torch_device, self.precision)

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
        return lifecycle.fit(self, train, federation=federation, log=log, checkpointer=checkpointer,
                             on_epoch=on_epoch, party_dp=party_dp)

    def fit_federated(self, federation: Federation, view: CoordinatorView, handle: str, *,
                      dataset: str | None = None, data_info: dict[str, Any] | None = None,
                      checkpointer: Checkpointer | None = None, on_epoch: EpochCallback | None = None) -> Self:
        """Fit with the training data already attached at the parties under ``handle`` (any deployment).

        ``checkpointer``: checkpoint every N steps into its directory and, if it holds a checkpoint, resume from it
        (the resumed fit ends in the same parameters as an uninterrupted one); ``on_epoch(stage, epoch, metrics)``:
        called after every epoch.
        """
        return lifecycle.fit_federated(self, federation, view, handle, dataset=dataset, data_info=data_info,
                                       checkpointer=checkpointer, on_epoch=on_epoch)

    def _supervised_epochs(self, stage: str, epochs: int, steps_per_epoch: int) -> int:
        """The epochs the supervised stage runs: ``epochs`` raised to the schedule's ``min_steps`` (recorded in
        ``schedule_``); methods without a schedule run ``epochs``."""
        schedule = getattr(self, "schedule_", None)
        return epochs if schedule is None else schedule.stage(stage, epochs, steps_per_epoch)

    def _check_fitted(self) -> None:
        if not hasattr(self, "federation_"):
            raise NotFittedError(f"{self.name}: call fit (or load) before predicting")

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

    def predict_output(self, data: VerticalDataset, *, diagnostics: dict[str, np.ndarray] | None = None
                       ) -> np.ndarray:
        """Probabilities (classification, ``(N, C)``) or predicted values (regression, ``(N,)``) for ``data``.

        ``diagnostics``: a dict the method fills with one array per :attr:`prediction_diagnostics` name, one value per
        row (NaN where it does not apply, e.g. a row predicted from the label prior)."""
        with self.attached(data) as (data, handle):
            return self.predict_output_federated(data.coordinator_view(), handle, diagnostics=diagnostics)

    def predict_output_federated(self, view: CoordinatorView, handle: str, *,
                                 diagnostics: dict[str, np.ndarray] | None = None) -> np.ndarray:
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
        wanted = diagnostics is not None and bool(self.prediction_diagnostics)
        part: dict[str, np.ndarray] = {}
        if rows.size:
            t0 = time.perf_counter()
            # float32 here (heads, softmax); bf16 at the parties
            out[rows] = self._predict(view, handle, rows, diagnostics=part) if wanted else self._predict(
                view, handle, rows)
            calibration = getattr(self, "calibration_", None)  # the opt-in post-hoc calibration (fit or load)
            if calibration is not None:
                out[rows] = calibration.apply(out[rows], np.asarray(self.parties_used(view), bool)[rows])
            self.predict_seconds_ = time.perf_counter() - t0
        if wanted:
            for name in self.prediction_diagnostics:
                full = np.full(n, np.nan)
                if rows.size:
                    full[rows] = part[name]
                diagnostics[name] = full
        check_finite_output(self.name, out, view.ids)
        return out

    def _coalition_predictions(self, view: CoordinatorView, handle: str, masks: np.ndarray, wanted: np.ndarray
                               ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """For each coalition ``masks[m]`` (``(M, K)`` booleans), ``(m, rows, output)``: the raw outputs (as
        :meth:`_predict`'s) of ``rows`` (those of ``wanted[m]`` with a party of the coalition) predicted with the
        other parties treated as missing.  By default one masked prediction per coalition; a method shares what does
        not depend on the coalition where it can (:mod:`partialvfl.methods.coalitions`)."""
        from partialvfl.methods.coalitions import masked_predictions

        return masked_predictions(self, view, handle, masks, wanted)

    def explain(self, data: VerticalDataset, **options: Any) -> Any:
        """Each party's contribution to each row's prediction (exact Shapley values; ``options``: see
        :func:`~partialvfl.methods.explain.explain_attached`); an :class:`~partialvfl.methods.explain.Explanation`."""
        from partialvfl.methods.explain import explain_attached

        with self.attached(data) as (data, handle):
            return explain_attached(self, data.coordinator_view(), handle, **options)

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
        """The score scikit-learn's scorers expect, higher is better, over the labelled samples of ``data``.

        Args:
            data: samples with labels (unlabelled samples are not scored).

        Returns:
            Accuracy (classification; labels matched by value, a class unseen in training counts as an error) or
            the coefficient of determination R^2 (regression; the RMSE is in :func:`~partialvfl.methods.evaluation.
            evaluate` and ``partialvfl evaluate``).

        Raises:
            NotFittedError: the model is neither fitted nor loaded.
            DataValidationError: ``data`` carries no labels, or labels of the other kind of task.
        """
        from partialvfl.methods.evaluation import evaluate, r2_score

        self._check_fitted()
        if self.index_.task.is_classification:
            return evaluate(self, data)["accuracy"]
        return r2_score(self, data)

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | Path) -> Path:
        """Write ``model.json``, ``coordinator.pt`` and every party's state (``party-<k>.pt`` here in one process, on
        the party's own disk in a deployment) all at once: see :mod:`partialvfl.methods.model_files`."""
        self._check_fitted()
        fed = self.federation_
        return write_model_dir(Path(directory), model_meta(self), self._coordinator_state(),
                               save_parties=lambda d, digest: fed.save(d, model=digest), forget_parties=fed.forget)

    @classmethod
    def load(cls, directory: str | Path, *, federation: Federation | None = None,
             log: MessageLog | None = None, device: Any = "cpu", precision: str = "fp32",
             compile: bool = False) -> VFLMethod:  # torch's word
        """Restore a saved model (any method when called on ``VFLMethod``) with its parties' states.

        The model runs on ``device`` whatever device it was fitted on (states are read to the CPU, then moved);
        without ``federation`` its parties run in this process on that device too.

        Raises :class:`~partialvfl.methods.model_files.ModelFileError` (one line naming the file) for a missing,
        corrupted, truncated or foreign file, and when a party's file belongs to another model.
        """
        run = RunOptions(False, device, precision, compile)  # a bad option is the caller's error, not the file's
        d = Path(directory)
        meta = read_model_meta(d)
        klass = get_method(meta["method"]) if cls is VFLMethod or not cls.name else cls
        if klass.name != meta["method"]:
            raise ModelFileError(f"{d} holds a {meta['method']!r} model, not {klass.name!r}")
        return load_model(klass, d, meta, run, federation=federation, log=log)
