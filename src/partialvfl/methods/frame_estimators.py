"""scikit-learn estimators over a simulated federation: a table whose column groups are the parties.

:class:`VFLClassifier` and :class:`VFLRegressor` take what scikit-learn's tools pass around (a pandas DataFrame or
an array ``X`` and labels ``y``), cut ``X`` into party blocks, run any registered method in one process, and answer
as scikit-learn estimators do, so ``cross_val_score``, ``GridSearchCV`` and ``Pipeline`` work on a simulated
federation::

    from sklearn.model_selection import cross_val_score
    from partialvfl.methods import VFLClassifier

    model = VFLClassifier("laser-vfl", parties={"bank": ["income", "debt"], "shop": ["visits", "basket"]})
    cross_val_score(model, frame, frame_labels, cv=3)

* Parties: ``parties`` maps each party's name to its columns (names of a DataFrame's columns, or positions of an
  array's), or is a number K (K contiguous blocks of columns, named ``party0``...); by default a DataFrame's columns
  must be a two-level MultiIndex whose first level names the party.
* Missing parties: a row whose columns of one party are all NaN lacks that party (the party does not hold that user);
  a row with some but not all of a party's columns NaN is an error naming the party, column and row.
* Labels: a missing label (NaN or None) marks an unlabelled row, which methods that learn from unlabelled rows
  (FALSE-VFL, LASER-VFL's pretraining) use; ``score`` scores the labelled rows only.
* Rows are identified by the DataFrame's index (an array's by position): a method whose predictions draw Monte Carlo
  samples seeds them per row from the model's seed and that ID.
* Method parameters: ``params`` (a dict of the method's declared parameters, :meth:`~partialvfl.methods.base.
  VFLMethod.param_space`); a grid searches one as ``params__NAME`` (``GridSearchCV(model, {"params__lr": [...]})``).

The fitted method is ``model_`` (save it with ``model_.save(directory)``); the same method runs across institutions
with ``partialvfl fit --federation``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Self

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.metrics import accuracy_score, r2_score
from sklearn.utils.validation import check_array, check_is_fitted, column_or_1d

from partialvfl.data.builders import from_blocks
from partialvfl.data.dataset import DataValidationError, Task, VerticalDataset
from partialvfl.methods.registry import DEFAULT_METHOD

__all__ = ["VFLClassifier", "VFLRegressor"]

#: ``set_params``/``get_params`` name a method parameter ``params__NAME``
_NESTED = "params__"

PartiesSpec = Mapping[str, Sequence[Any]] | int | None


class _VFLEstimator(BaseEstimator):
    """What :class:`VFLClassifier` and :class:`VFLRegressor` share: the parties, the method and its parameters."""

    _classification: ClassVar[bool]

    def __init__(self, method: str = DEFAULT_METHOD, parties: PartiesSpec = None, *, active_party: str | None = None,
                 preset: str = "fast", seed: int = 0, params: Mapping[str, Any] | None = None, device: str = "cpu",
                 precision: str = "fp32") -> None:
        """Store the settings as given (scikit-learn's rule: they are checked by ``fit``).

        Args:
            method: a registered method's name (``partialvfl methods`` lists them).
            parties: each party's columns by party name, a number of contiguous column blocks, or ``None`` (a
                DataFrame whose columns are a two-level MultiIndex, party first).
            active_party: the party that holds the labels (default: the first party).
            preset: the method's preset (``fast`` or ``paper``, or one the method declares).
            seed: the seed of everything the fit and the predictions draw at random.
            params: the method's declared parameters by name (``{"epochs": 5, "lr": 1e-3}``).
            device: where the in-process parties and the coordinator compute (``cpu``, ``cuda``, ``auto``...).
            precision: ``fp32`` or ``bf16`` (autocast).
        """
        self.method = method
        self.parties = parties
        self.active_party = active_party
        self.preset = preset
        self.seed = seed
        self.params = params
        self.device = device
        self.precision = precision

    # ------------------------------------------------------------------ parameters
    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor's arguments; with ``deep``, each method parameter of ``params`` as ``params__NAME`` too.

        Args:
            deep: also list the entries of ``params`` under ``params__NAME`` (what ``GridSearchCV`` searches).

        Returns:
            The parameters by name, as given.
        """
        out = super().get_params(deep=False)
        if deep and isinstance(self.params, Mapping):
            out.update({f"{_NESTED}{k}": v for k, v in self.params.items()})
        return out

    def set_params(self, **params: Any) -> Self:
        """Set constructor arguments, and method parameters as ``params__NAME`` (a new ``params`` dict; the one given
        to the constructor is not changed).

        Returns:
            ``self``.

        Raises:
            ValueError: an unknown argument.
        """
        nested = {k[len(_NESTED):]: v for k, v in params.items() if k.startswith(_NESTED)}
        plain = {k: v for k, v in params.items() if not k.startswith(_NESTED)}
        if plain:
            super().set_params(**plain)
        if nested:
            self.params = {**dict(self.params or {}), **nested}
        return self

    def __sklearn_tags__(self) -> Any:
        """scikit-learn's tags: NaN is allowed (a missing party), ``y`` is required (unlabelled rows: NaN)."""
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = True
        tags.target_tags.required = True
        return tags

    # ------------------------------------------------------------------ the estimator API
    def fit(self, X: Any, y: Any) -> Self:
        """Fit the method on ``X`` (rows, party column groups) and ``y`` (NaN or None: unlabelled).

        Args:
            X: a DataFrame or a 2-D array; NaN over all of a party's columns marks the party missing for that row.
            y: one label (classification) or value (regression) per row; a missing one marks the row unlabelled.

        Returns:
            ``self``, fitted: ``model_`` (the method), ``parties_`` (each party's columns), ``n_features_in_`` and,
            for a classifier, ``classes_``.

        Raises:
            ValueError: bad settings or data (``DataValidationError`` names the party, column or row at fault).
        """
        from partialvfl.methods.registry import get_method

        if y is None:
            raise ValueError(f"{type(self).__name__} requires y to be passed, but the target y is None")
        frame, ids = _frame(X)
        if len(frame) < 2:
            raise DataValidationError(f"a fit needs at least 2 samples; X has n_samples={len(frame)}")
        y = column_or_1d(y, warn=True)
        self.parties_ = _resolve_parties(self.parties, frame)
        names = list(self.parties_)
        active = names[0] if self.active_party is None else str(self.active_party)
        if active not in names:
            raise DataValidationError(f"active_party {active!r} is not one of the parties {names}")
        self.active_party_ = active
        data = _dataset(frame, ids, self.parties_, active, y, classification=self._classification)
        if not data.labeled.any():
            raise DataValidationError("y has no label (every entry is missing)")
        model = get_method(self.method)(self.preset, seed=self.seed, device=self.device, precision=self.precision,
                                        **dict(self.params or {}))
        self.model_ = model.fit(data)
        self.n_features_in_ = frame.shape[1]
        if all(isinstance(c, str) for c in frame.columns):
            self.feature_names_in_ = np.asarray(frame.columns, dtype=object)
        return self

    def _predict_output(self, X: Any) -> np.ndarray:
        check_is_fitted(self, "model_")
        frame, ids = _frame(X)
        if frame.shape[1] != self.n_features_in_:
            raise ValueError(f"X has {frame.shape[1]} features, but {type(self).__name__} is expecting "
                             f"{self.n_features_in_} features as input")
        data = _dataset(frame, ids, self.parties_, self.active_party_, None, classification=self._classification)
        return self.model_.predict_output(data)

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle`` keeps: the settings and, once fitted, the model's files (:meth:`VFLMethod.save`)."""
        state = dict(super().__getstate__())  # a copy: object.__getstate__ gives the instance's own __dict__
        model = state.pop("model_", None)
        if model is not None:
            with tempfile.TemporaryDirectory() as tmp:
                model.save(tmp)
                state["_model_files"] = {p.relative_to(tmp).as_posix(): p.read_bytes()
                                         for p in sorted(Path(tmp).rglob("*")) if p.is_file()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore :meth:`__getstate__`: a fitted model is loaded back from its files, its parties in this process."""
        from partialvfl.methods.base import VFLMethod

        state = dict(state)
        files = state.pop("_model_files", None)
        super().__setstate__(state)
        if files is not None:
            with tempfile.TemporaryDirectory() as tmp:
                for name, content in files.items():
                    (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
                    (Path(tmp) / name).write_bytes(content)
                self.model_ = VFLMethod.load(tmp, device=self.device, precision=self.precision)

    def _labeled(self, y: Any, sample_weight: Any) -> tuple[np.ndarray, np.ndarray, Any]:
        """The labelled rows of ``y`` (a mask), their labels and their weights."""
        labels = np.asarray(y, dtype=object if self._classification else np.float64)
        if labels.ndim != 1:
            raise DataValidationError(f"y must be 1-D (one label per row), got shape {labels.shape}")
        keep = ~pd.isna(labels)
        weights = None if sample_weight is None else np.asarray(sample_weight)[keep]
        return keep, labels[keep], weights


class VFLClassifier(ClassifierMixin, _VFLEstimator):
    """A registered VFL method as a scikit-learn classifier over a table whose column groups are the parties."""

    _classification = True

    def predict_proba(self, X: Any) -> np.ndarray:
        """Class probabilities.

        Args:
            X: rows as in :meth:`fit` (the same columns; a party's all-NaN block: that party is missing).

        Returns:
            ``(n_rows, n_classes)`` probabilities, columns in the order of ``classes_``.
        """
        return self._predict_output(X)

    def predict(self, X: Any) -> np.ndarray:
        """Predicted class labels (values of ``classes_``), one per row of ``X``."""
        return self.classes_[self.predict_proba(X).argmax(axis=1)]

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """Accuracy over the labelled rows of ``X`` (rows whose ``y`` is missing are not scored)."""
        keep, labels, weights = self._labeled(y, sample_weight)
        predicted = self.predict(_rows(X, keep))
        return float(accuracy_score(labels.astype(self.classes_.dtype, copy=False), predicted, sample_weight=weights))

    @property
    def classes_(self) -> np.ndarray:
        """The class labels seen in training, sorted (scikit-learn's ``classes_``)."""
        check_is_fitted(self, "model_")
        return self.model_.classes_


class VFLRegressor(RegressorMixin, _VFLEstimator):
    """A registered VFL method as a scikit-learn regressor over a table whose column groups are the parties."""

    _classification = False

    def predict(self, X: Any) -> np.ndarray:
        """Predicted values, one per row of ``X`` (rows as in :meth:`fit`)."""
        return self._predict_output(X)

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """The coefficient of determination R^2 over the labelled rows of ``X`` (higher is better)."""
        keep, values, weights = self._labeled(y, sample_weight)
        return float(r2_score(values, self.predict(_rows(X, keep)), sample_weight=weights))


# ---------------------------------------------------------------------- tables to a vertical dataset
def _frame(X: Any) -> tuple[pd.DataFrame, np.ndarray]:
    """``X`` as a DataFrame of floats (its column labels kept), and the rows' IDs (a DataFrame's index, an array's
    positions); scikit-learn's ``check_array`` refuses what it refuses (sparse, complex, text, 1-D, empty)."""
    values = check_array(X, dtype=np.float64, ensure_all_finite="allow-nan")
    if isinstance(X, pd.DataFrame):
        frame = pd.DataFrame(values, index=X.index, columns=X.columns)
        ids = np.asarray(X.index)
        if not X.index.is_unique:
            raise DataValidationError(f"X's index identifies the rows and must be unique; "
                                      f"{X.index[X.index.duplicated()][0]!r} appears twice")
    else:
        frame = pd.DataFrame(values)
        ids = np.arange(len(values))
    return frame, ids


def _rows(X: Any, keep: np.ndarray) -> Any:
    """The rows of ``X`` where ``keep`` holds (a DataFrame keeps its index: the rows' IDs)."""
    if keep.all():
        return X
    return X.loc[keep] if isinstance(X, pd.DataFrame) else np.asarray(X)[keep]


def _resolve_parties(parties: PartiesSpec, frame: pd.DataFrame) -> dict[str, list[Any]]:
    """Each party's columns of ``frame``, in the order given; every column belongs to exactly one party."""
    columns = list(frame.columns)
    if parties is None:
        if not isinstance(frame.columns, pd.MultiIndex) or frame.columns.nlevels != 2:
            raise DataValidationError("say which columns each party holds: parties={'name': [columns], ...} or "
                                      "parties=K (K contiguous blocks), or give X columns as a two-level MultiIndex "
                                      "(party, feature)")
        out: dict[str, list[Any]] = {}
        for column in columns:
            out.setdefault(str(column[0]), []).append(column)
        return out
    if isinstance(parties, (int, np.integer)) and not isinstance(parties, bool):
        if not 1 <= parties <= len(columns):
            raise DataValidationError(f"parties={parties} needs at least {max(int(parties), 1)} columns; X has "
                                      f"n_features={len(columns)}")
        blocks = np.array_split(np.arange(len(columns)), parties)
        return {f"party{k}": [columns[i] for i in block] for k, block in enumerate(blocks)}
    if not isinstance(parties, Mapping) or not parties:
        raise DataValidationError(f"parties must map party names to columns, or be a number; got {parties!r}")
    out = {}
    seen: dict[Any, str] = {}
    for name, cols in parties.items():
        if isinstance(cols, (str, bytes)) or not isinstance(cols, Sequence) or not len(cols):
            raise DataValidationError(f"party {name!r}: give a non-empty list of its columns, got {cols!r}")
        for c in cols:
            if c not in frame.columns:
                raise DataValidationError(f"party {name!r}: column {c!r} is not a column of X")
            if c in seen:
                raise DataValidationError(f"column {c!r} is given to two parties, {seen[c]!r} and {name!r}")
            seen[c] = str(name)
        out[str(name)] = list(cols)
    left = [c for c in columns if c not in seen]
    if left:
        raise DataValidationError(f"column {left[0]!r} of X belongs to no party ({len(left)} such columns); drop it "
                                  "or give it to a party")
    return out


def _dataset(frame: pd.DataFrame, ids: np.ndarray, parties: Mapping[str, Sequence[Any]], active: str, y: Any, *,
             classification: bool) -> VerticalDataset:
    """The vertical dataset of ``frame``: one block per party (its columns), the rows' IDs, the labels at ``active``."""
    names = list(parties)
    blocks = [frame.loc[:, list(cols)].to_numpy(dtype=np.float64) for cols in parties.values()]
    features = [[_feature_name(c) for c in cols] for cols in parties.values()]
    task = None if classification or y is None else Task.regression()
    labels = None
    if y is not None:
        labels = np.asarray(y, dtype=object if classification else np.float64)
        if labels.ndim != 1 or len(labels) != len(frame):
            raise DataValidationError(f"y must hold one label per row of X ({len(frame)}), got shape {labels.shape}")
        if classification:
            labels = np.array([None if pd.isna(v) else v for v in labels], dtype=object)
    return from_blocks(blocks, labels, task=task, ids=ids, active_party=names.index(active), party_names=names,
                       feature_names=features)


def _feature_name(column: Any) -> str:
    """A column's name as a feature name (a MultiIndex column ``(party, feature)``: the feature)."""
    return str(column[-1]) if isinstance(column, tuple) else str(column)
