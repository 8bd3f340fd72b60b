"""The contract every method follows, and the registry that maps names to methods.

A method is an estimator (``fit``, ``predict_proba``, ``predict``, ``score``, ``save``/``load``) whose work is split
between coordinator code (this class: the active party's label-side role) and a :class:`PartyProgram` that runs at
every party.  The two talk only through the :class:`~partialvfl.federation.coordinator.Federation`'s transport, so
the same method runs in one process (the default, :class:`LocalFederation`) or across hosts (gRPC).

What subclasses implement:

* ``name`` (registry key), ``party_program`` (the registered program name);
* ``default_params()`` and ``preset_params(preset, dataset)``: every tunable with its default, and the ``fast`` /
  ``paper`` presets (per dataset where the paper differs per dataset);
* ``_party_config(k)``: the JSON-able config sent to party ``k`` at setup (must include what the program needs to
  build its modules, e.g. ``feature_dim``/``feature_shape`` from ``self.index_``);
* ``_fit(view, handle)``: training, with the training data attached at the parties under ``handle``;
* ``_predict(view, handle, rows)``: class probabilities ``(len(rows), C)`` (classification) or values
  ``(len(rows),)`` (regression) for ``rows``, each of which has at least one observed party;
* ``_coordinator_state()`` / ``_load_coordinator_state(state)``: what the active party alone holds.

Samples with no observed party are never sent to ``_predict``: they get the training label prior (classification:
the labelled training class frequencies; regression: the labelled training mean).  ``evaluate`` counts them.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

import numpy as np
import torch

from partialvfl.data.dataset import CoordinatorView, Task, VerticalDataset
from partialvfl.federation.coordinator import Federation, LocalFederation
from partialvfl.federation.messages import MessageLog
from partialvfl.utils.jsonable import json_default
from partialvfl.utils.progress import report_line

__all__ = ["IndexInfo", "METHODS", "VFLMethod", "get_method", "load_all", "method_names", "register_method"]

FORMAT_VERSION = 1

METHODS: dict[str, type[VFLMethod]] = {}

# Modules of this package that are not methods; every other module is imported on the first registry lookup (so
# `import partialvfl` stays light and a new method needs no edit here).
_NOT_METHOD_MODULES = {"base", "evaluation"}


def register_method(cls: type[VFLMethod]) -> type[VFLMethod]:
    """Class decorator: make a method available by name (CLI ``--method NAME``, bench grids)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no registry name")
    if cls.name in METHODS and METHODS[cls.name] is not cls:
        raise ValueError(f"method {cls.name!r} registered twice")
    METHODS[cls.name] = cls
    return cls


def load_all(*, skip_broken: bool = False) -> list[str]:
    """Import every method module of this package, which registers each method here and its party program with
    :func:`~partialvfl.federation.party.register_program`: the one discovery of methods and their programs (the
    registry lookups below, and the ``party serve`` command before a party serves).

    ``skip_broken``: log a module that fails to import and go on (a party keeps serving the other methods) instead of
    raising; returns the modules that failed.
    """
    import importlib
    import logging
    import pkgutil

    failed = []
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):  # not `import partialvfl.methods`: no cycle
        if info.name not in _NOT_METHOD_MODULES and not info.name.startswith("_"):
            name = f"{__package__}.{info.name}"
            try:
                importlib.import_module(name)
            except Exception as e:
                if not skip_broken:
                    raise
                logging.getLogger(__package__).warning("could not import %s: %s", name, e)
                failed.append(name)
    return failed


def method_names() -> list[str]:
    load_all()
    return sorted(METHODS)


def get_method(name: str) -> type[VFLMethod]:
    load_all()
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}") from None


@dataclass(frozen=True)
class IndexInfo:
    """What a fitted model remembers of its federation: task, parties, feature sizes, who holds the labels."""

    task: Task
    party_names: tuple[str, ...]
    feature_dims: tuple[int, ...]
    feature_shapes: tuple[tuple[int, ...], ...]
    active_party: int

    @property
    def n_parties(self) -> int:
        return len(self.party_names)

    @classmethod
    def of(cls, view: CoordinatorView) -> IndexInfo:
        return cls(view.task, tuple(view.party_names), tuple(view.feature_dims),
                   tuple(tuple(s) for s in view.feature_shapes), view.active_party)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["task"] = self.task.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IndexInfo:
        return cls(Task.from_dict(d["task"]), tuple(d["party_names"]), tuple(d["feature_dims"]),
                   tuple(tuple(s) for s in d["feature_shapes"]), int(d["active_party"]))


class VFLMethod(ABC):
    """Base class of every method: parameters, presets, the estimator API, save/load."""

    name: ClassVar[str] = ""
    party_program: ClassVar[str] = ""
    presets: ClassVar[tuple[str, ...]] = ("fast", "paper")

    def __init__(self, preset: str = "fast", *, seed: int = 0, progress: bool = False, **params: Any) -> None:
        if preset not in self.presets:
            raise ValueError(f"{self.name}: unknown preset {preset!r}; choose one of {', '.join(self.presets)}")
        unknown = set(params) - set(self.default_params())
        if unknown:
            raise ValueError(
                f"{self.name}: unknown parameter(s) {', '.join(sorted(unknown))}; known: "
                f"{', '.join(sorted(self.default_params()))}"
            )
        self.preset = preset
        self.seed = int(seed)
        self.progress = progress
        self.overrides = dict(params)
        self.history_: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ parameters
    @classmethod
    @abstractmethod
    def default_params(cls) -> dict[str, Any]:
        """Every tunable of the method with its default."""

    @classmethod
    def preset_params(cls, preset: str, dataset: str | None) -> dict[str, Any]:
        """Overrides the preset applies on top of the defaults (may depend on the dataset)."""
        return {}

    @classmethod
    def epoch_param_names(cls) -> list[str]:
        """The parameters that count training epochs (what the CLI's ``--epochs N`` sets, all of them)."""
        return [k for k in cls.default_params()
                if k in ("epochs", "pretrain_epochs") or k.startswith("epochs_")]

    def resolve_params(self, dataset: str | None) -> dict[str, Any]:
        params = dict(self.default_params())
        params.update(self.preset_params(self.preset, dataset))
        params.update(self.overrides)
        return params

    def get_params(self) -> dict[str, Any]:
        return {"preset": self.preset, "seed": self.seed, **self.overrides}

    # ------------------------------------------------------------------ subclass hooks
    @abstractmethod
    def _party_config(self, party: int) -> dict[str, Any]:
        """JSON-able configuration sent to party ``party`` at setup."""

    @abstractmethod
    def _fit(self, view: CoordinatorView, handle: str) -> None:
        """Train, with the training data attached at every party under ``handle``."""

    @abstractmethod
    def _predict(self, view: CoordinatorView, handle: str, rows: np.ndarray) -> np.ndarray:
        """Probabilities (classification) or values (regression) for ``rows`` (each with >= 1 observed party)."""

    def _coordinator_state(self) -> dict[str, Any]:
        return {}

    def _load_coordinator_state(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional
        pass

    # ------------------------------------------------------------------ helpers for subclasses
    @property
    def transport(self):  # noqa: ANN201 - Transport
        return self.federation_.transport

    def _report(self, stage: str, epoch: int, **metrics: float) -> None:
        """Record one progress line (and print it when ``progress`` is on)."""
        row = {"stage": stage, "epoch": epoch, **{k: float(v) for k, v in metrics.items()}}
        self.history_.append(row)
        parts = " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
        report_line(f"[{self.name}] {stage} epoch {epoch}: {parts}", self.progress)

    # ------------------------------------------------------------------ estimator API
    def fit(self, train: VerticalDataset, *, federation: Federation | None = None,
            log: MessageLog | None = None) -> Self:
        """Fit on ``train`` (labelled and unlabelled samples, any per-sample observed mask), in process by default."""
        fed = federation or LocalFederation.for_dataset(train, log=log)
        handle = fed.attach(train, "train")
        dataset_name = train.info.get("dataset") or train.info.get("protocol", {}).get("dataset") or train.name or None
        self.fit_federated(fed, train.coordinator_view(), handle, dataset=dataset_name, data_info=train.info)
        fed.release(handle)
        return self

    def fit_federated(self, federation: Federation, view: CoordinatorView, handle: str, *,
                      dataset: str | None = None, data_info: dict[str, Any] | None = None) -> Self:
        """Fit with the training data already attached at the parties under ``handle`` (any deployment)."""
        if view.n_parties != federation.n_parties:
            raise ValueError(f"the data has {view.n_parties} parties, the federation {federation.n_parties}")
        if not view.labeled.any():
            raise ValueError(f"{self.name}: the training data has no labelled sample")
        self.federation_ = federation
        self.index_ = IndexInfo.of(view)
        self.params_ = self.resolve_params(dataset)
        self.data_info_ = dict(data_info or {})
        self.label_prior_ = _label_prior(view)
        self.history_ = []
        federation.setup(self.party_program, [self._party_config(k) for k in range(view.n_parties)], self.seed)
        t0 = time.perf_counter()
        self._fit(view, handle)
        self.fit_seconds_ = time.perf_counter() - t0
        return self

    def _check_fitted(self) -> None:
        if not hasattr(self, "federation_"):
            raise RuntimeError(f"{self.name}: call fit (or load) before predicting")

    def predict_output(self, data: VerticalDataset) -> np.ndarray:
        """Probabilities (classification, ``(N, C)``) or predicted values (regression, ``(N,)``) for ``data``."""
        self._check_fitted()
        if data.feature_dims != self.index_.feature_dims:
            raise ValueError(f"data has feature widths {data.feature_dims}, the model {self.index_.feature_dims}")
        handle = self.federation_.attach(data)
        try:
            return self.predict_output_federated(data.coordinator_view(), handle)
        finally:
            self.federation_.release(handle)

    def predict_output_federated(self, view: CoordinatorView, handle: str) -> np.ndarray:
        self._check_fitted()
        n = view.n_samples
        some = view.observed.any(axis=1)
        if self.index_.task.is_classification:
            out = np.tile(self.label_prior_, (n, 1)).astype(np.float64)
        else:
            out = np.full(n, float(self.label_prior_[0]))
        rows = np.flatnonzero(some)
        if rows.size:
            t0 = time.perf_counter()
            out[rows] = self._predict(view, handle, rows)
            self.predict_seconds_ = time.perf_counter() - t0
        return out

    def predict_proba(self, data: VerticalDataset) -> np.ndarray:
        self._check_fitted()
        if not self.index_.task.is_classification:
            raise ValueError(f"{self.name}: predict_proba is for classification; use predict for regression")
        return self.predict_output(data)

    def predict(self, data: VerticalDataset) -> np.ndarray:
        out = self.predict_output(data)
        return out.argmax(axis=1) if self.index_.task.is_classification else out

    def score(self, data: VerticalDataset) -> float:
        """Accuracy (classification) or RMSE (regression) over the labelled samples of ``data``."""
        from partialvfl.methods.evaluation import evaluate

        res = evaluate(self, data)
        return res["accuracy"] if self.index_.task.is_classification else res["rmse"]

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | Path) -> Path:
        """Write ``model.json`` and ``coordinator.pt`` here, and have each party write its ``party-<k>.pt``."""
        self._check_fitted()
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": FORMAT_VERSION,
            "method": self.name,
            "preset": self.preset,
            "seed": self.seed,
            "overrides": self.overrides,
            "params": self.params_,
            "index": self.index_.to_dict(),
            "label_prior": [float(v) for v in self.label_prior_],
            "data_info": self.data_info_,
            "fit_seconds": getattr(self, "fit_seconds_", None),
            "history": self.history_,
        }
        (d / "model.json").write_text(json.dumps(meta, indent=2, default=json_default))
        torch.save(self._coordinator_state(), d / "coordinator.pt")
        self.federation_.save(d)
        return d

    @classmethod
    def load(cls, directory: str | Path, *, federation: Federation | None = None,
             log: MessageLog | None = None) -> VFLMethod:
        """Restore a saved model (any method when called on ``VFLMethod``) with its parties' states."""
        d = Path(directory)
        meta_path = d / "model.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"{d} holds no saved model (no model.json)")
        meta = json.loads(meta_path.read_text())
        klass = get_method(meta["method"]) if cls is VFLMethod or not cls.name else cls
        if klass.name != meta["method"]:
            raise ValueError(f"{d} holds a {meta['method']!r} model, not {klass.name!r}")
        obj = klass(meta["preset"], seed=meta["seed"], **meta["overrides"])
        obj.index_ = IndexInfo.from_dict(meta["index"])
        obj.params_ = meta["params"]
        obj.label_prior_ = np.asarray(meta["label_prior"], dtype=np.float64)
        obj.data_info_ = meta.get("data_info", {})
        obj.history_ = meta.get("history", [])
        obj.fit_seconds_ = meta.get("fit_seconds")
        fed = federation or LocalFederation(obj.index_.party_names, obj.index_.active_party, log=log)
        obj.federation_ = fed
        fed.setup(obj.party_program, [obj._party_config(k) for k in range(obj.index_.n_parties)], obj.seed)
        fed.load(d)
        obj._load_coordinator_state(torch.load(d / "coordinator.pt", weights_only=True))
        return obj


def _label_prior(view: CoordinatorView) -> np.ndarray:
    y = view.y[view.labeled]
    if view.task.is_classification:
        counts = np.bincount(y.astype(np.int64), minlength=view.task.n_classes).astype(np.float64)
        return counts / counts.sum()
    return np.array([float(np.mean(y))])
