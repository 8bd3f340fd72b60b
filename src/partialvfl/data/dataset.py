"""The vertical data model: K party blocks over one shared sample order.

A :class:`VerticalDataset` holds, for N samples (users) and K parties:

* one feature block per party, stored as an ``(N, d_k)`` float32 array whose rows are NaN exactly where the party
  does not hold the sample;
* the sample IDs (unique);
* ``observed``, an ``(N, K)`` boolean matrix (``True`` = party k holds sample i; the FALSE-VFL paper's ``m`` is its
  negation);
* labels ``y`` with a ``labeled`` mask (``True`` = label known), held by the active party;
* the task (classification with its classes, or regression); ``None`` for data without labels (new users to
  predict: the model knows its classes).

A party's block is reached only through :meth:`VerticalDataset.party`, which returns that party's
:class:`PartyView` (its own observed rows).  Code that plays the coordinator (the active party's label-side role)
uses :meth:`VerticalDataset.coordinator_view`, which carries the sample index, the observed matrix and the labels
but no features at all.

Samples with no observed party are kept (they are a fact of the data: a labelled user nobody holds features for),
counted by :meth:`VerticalDataset.summary` as ``all_missing``, skipped by training, and predicted from the
no-information fallback of each method (see ``docs/missing-data.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from partialvfl.data.checks import (
    UNLABELED,
    DataValidationError,
    check_block_values,
    check_labels,
    check_unique_ids,
    show_id,
)

__all__ = [
    "CoordinatorView",
    "DataValidationError",
    "PartyView",
    "Task",
    "VerticalDataset",
]

@dataclass(frozen=True)
class Task:
    """What is predicted: ``classification`` over ``classes`` (labels stored as indices) or ``regression``."""

    kind: Literal["classification", "regression"]
    classes: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("classification", "regression"):
            raise DataValidationError(f"task kind must be 'classification' or 'regression', got {self.kind!r}")
        if self.kind == "classification" and len(self.classes) < 2:
            raise DataValidationError(
                f"a classification task needs at least 2 classes, got {len(self.classes)}: {self.classes!r}"
            )
        if self.kind == "regression" and self.classes:
            raise DataValidationError("a regression task has no classes")
        if len(set(self.classes)) != len(self.classes):
            raise DataValidationError(f"duplicate class names in {self.classes!r}")

    @classmethod
    def classification(cls, classes: Sequence[Any]) -> Task:
        """A classification task over ``classes`` (the label values, in the order of the output columns)."""
        return cls("classification", tuple(classes))

    @classmethod
    def regression(cls) -> Task:
        """A regression task (one real-valued output)."""
        return cls("regression", ())

    @property
    def is_classification(self) -> bool:
        """Whether the task is classification."""
        return self.kind == "classification"

    @property
    def n_classes(self) -> int:
        """The number of classes (0 for regression)."""
        return len(self.classes)

    def to_dict(self) -> dict[str, Any]:
        """The task as JSON-ready values (for model files)."""
        return {"kind": self.kind, "classes": [_jsonable(c) for c in self.classes]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        """The task written by :meth:`to_dict`."""
        return cls(d["kind"], tuple(d.get("classes", ())))


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    return v


@dataclass(frozen=True)
class PartyView:
    """Everything one party holds of a dataset: its own observed rows, never another party's.

    ``rows`` are positions in the dataset's shared sample order; ``features[i]`` is the party's block for sample
    ``rows[i]``.  Only the active party's view carries ``labels``/``labeled`` (over the whole shared order: the
    active party knows the labels of labelled users whether or not it holds their features).
    """

    party: int
    name: str
    features: np.ndarray
    rows: np.ndarray
    ids: np.ndarray
    feature_names: tuple[str, ...]
    feature_shape: tuple[int, ...]
    n_samples: int
    labels: np.ndarray | None = None
    labeled: np.ndarray | None = None

    @property
    def n_features(self) -> int:
        """The number of the party's feature columns."""
        return int(self.features.shape[1])

    @property
    def n_observed(self) -> int:
        """The number of rows the party observes."""
        return int(self.rows.shape[0])

    def position_of_rows(self, rows: np.ndarray) -> np.ndarray:
        """Map shared-order row positions to indices into ``features``; raises if the party lacks any of them."""
        rows = np.asarray(rows, dtype=np.int64)
        pos = np.searchsorted(self.rows, rows)
        pos_c = np.clip(pos, 0, max(len(self.rows) - 1, 0))
        ok = (pos < len(self.rows)) & (self.rows[pos_c] == rows) if len(self.rows) else np.zeros(len(rows), bool)
        if not np.all(ok):
            bad = rows[~ok][:5].tolist()
            raise KeyError(f"party {self.party} ({self.name!r}) does not hold rows {bad}")
        return pos_c


@dataclass(frozen=True)
class CoordinatorView:
    """The sample index as the coordinator (the active party's label side) sees it: no features.

    Everything here is known to the federation after entity alignment (which party holds which ID) plus what the
    active party alone holds (labels); ``info`` is the dataset's description (e.g. a simulated partial setting).
    """

    ids: np.ndarray
    observed: np.ndarray
    y: np.ndarray
    labeled: np.ndarray
    task: Task | None
    active_party: int
    party_names: tuple[str, ...]
    feature_dims: tuple[int, ...]
    feature_shapes: tuple[tuple[int, ...], ...]
    info: dict[str, Any] = field(default_factory=dict)
    #: each party's column names, where the coordinator knows them (schema, not data: a fitted model keeps them)
    feature_names: tuple[tuple[str, ...], ...] | None = None

    @property
    def n_samples(self) -> int:
        """The number of samples (rows of ``observed``)."""
        return int(self.observed.shape[0])

    @property
    def n_parties(self) -> int:
        """The number of parties (columns of ``observed``)."""
        return int(self.observed.shape[1])


@dataclass
class VerticalDataset:
    """K party blocks over one sample order, with the observed matrix, labels and label mask.

    Construct it directly (all arrays over the same N samples, unobserved rows NaN) or with the builders in
    :mod:`partialvfl.data.builders`.  Every argument is validated; errors name the party, column or ID at fault and
    nothing is silently dropped or coerced.
    """

    blocks: Sequence[np.ndarray]
    observed: np.ndarray
    ids: np.ndarray | Sequence[Any] | None = None
    y: np.ndarray | Sequence[Any] | None = None
    labeled: np.ndarray | None = None
    task: Task | None = None
    active_party: int = -1
    feature_names: Sequence[Sequence[str]] | None = None
    party_names: Sequence[str] | None = None
    feature_shapes: Sequence[Sequence[int]] | None = None
    name: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        blocks = list(self.blocks)
        if not blocks:
            raise DataValidationError("a VerticalDataset needs at least one party block")
        k = len(blocks)
        names = [str(n) for n in self.party_names] if self.party_names is not None else [f"party{j}" for j in range(k)]
        if len(names) != k:
            raise DataValidationError(f"{len(names)} party names given for {k} party blocks")
        if len(set(names)) != k:
            raise DataValidationError(f"party names must be unique, got {names}")
        self.party_names = tuple(names)

        flat: list[np.ndarray] = []
        shapes: list[tuple[int, ...]] = []
        n = None
        for j, b in enumerate(blocks):
            arr = np.asarray(b)
            if arr.ndim < 2:
                raise DataValidationError(
                    f"party {j} ({names[j]!r}): block must be 2-D (samples x features), got shape {arr.shape}"
                )
            if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
                    or arr.dtype == bool):
                raise DataValidationError(
                    f"party {j} ({names[j]!r}): features must be numeric, got dtype {arr.dtype}"
                )
            shape = tuple(int(s) for s in arr.shape[1:])
            arr = arr.reshape(arr.shape[0], -1)
            if arr.shape[1] == 0:
                raise DataValidationError(f"party {j} ({names[j]!r}) has no feature columns")
            if n is None:
                n = arr.shape[0]
            elif arr.shape[0] != n:
                raise DataValidationError(
                    f"party {j} ({names[j]!r}) has {arr.shape[0]} rows but party 0 ({names[0]!r}) has {n}: "
                    "all blocks must share one sample order"
                )
            flat.append(np.ascontiguousarray(arr, dtype=np.float32))
            shapes.append(shape)
        assert n is not None
        if self.feature_shapes is not None:
            given = [tuple(int(s) for s in sh) for sh in self.feature_shapes]
            if len(given) != k:
                raise DataValidationError(f"{len(given)} feature shapes given for {k} parties")
            for j, (sh, b) in enumerate(zip(given, flat)):
                if int(np.prod(sh)) != b.shape[1]:
                    raise DataValidationError(
                        f"party {j} ({names[j]!r}): feature shape {sh} does not match its {b.shape[1]} columns"
                    )
            shapes = given
        self.feature_shapes = tuple(shapes)

        ids = np.arange(n) if self.ids is None else np.asarray(self.ids)
        if ids.ndim != 1 or ids.shape[0] != n:
            raise DataValidationError(f"ids must be a 1-D sequence of length {n}, got shape {ids.shape}")
        check_unique_ids(ids)
        self.ids = ids

        obs = np.asarray(self.observed)
        if obs.shape != (n, k):
            raise DataValidationError(f"observed must have shape ({n}, {k}) (samples x parties), got {obs.shape}")
        if obs.dtype != bool:
            if not np.all(np.isin(obs, (0, 1))):
                raise DataValidationError("observed must be boolean (or 0/1)")
            obs = obs.astype(bool)
        self.observed = obs.copy()
        self.observed.flags.writeable = False

        fnames: list[tuple[str, ...]] = []
        for j, b in enumerate(flat):
            if self.feature_names is None:
                fn = tuple(f"{names[j]}:{c}" for c in range(b.shape[1]))
            else:
                if len(self.feature_names) != k:
                    raise DataValidationError(f"feature names given for {len(self.feature_names)} parties, not {k}")
                fn = tuple(str(c) for c in self.feature_names[j])
                if len(fn) != b.shape[1]:
                    raise DataValidationError(
                        f"party {j} ({names[j]!r}): {len(fn)} feature names for {b.shape[1]} columns"
                    )
            fnames.append(fn)
        self.feature_names = tuple(fnames)

        for j, b in enumerate(flat):
            check_block_values(b, obs[:, j], j, names[j], self.feature_names[j], ids)
            b.flags.writeable = False
        self.blocks = tuple(flat)

        kk = int(self.active_party)
        if not -k <= kk < k:
            raise DataValidationError(f"active party index {self.active_party} is out of range for {k} parties")
        self.active_party = kk % k

        self.task, self.y, self.labeled = check_labels(self.task, self.y, self.labeled, n, ids)

    # ------------------------------------------------------------------ shape
    @property
    def n_samples(self) -> int:
        """The number of samples."""
        return int(self.observed.shape[0])

    @property
    def n_parties(self) -> int:
        """The number of parties."""
        return int(self.observed.shape[1])

    @property
    def feature_dims(self) -> tuple[int, ...]:
        """Each party's number of feature columns, in party order."""
        return tuple(int(b.shape[1]) for b in self.blocks)

    @property
    def n_labeled(self) -> int:
        """The number of labeled samples."""
        return int(self.labeled.sum())

    # ------------------------------------------------------------------ views
    def party(self, k: int) -> PartyView:
        """Party ``k``'s own view: its observed rows (and, for the active party, the labels)."""
        if not -self.n_parties <= k < self.n_parties:
            raise IndexError(f"party index {k} out of range for {self.n_parties} parties")
        k %= self.n_parties
        rows = np.flatnonzero(self.observed[:, k]).astype(np.int64)
        feats = self.blocks[k][rows]
        feats.flags.writeable = False
        is_active = k == self.active_party
        return PartyView(
            party=k,
            name=self.party_names[k],
            features=feats,
            rows=rows,
            ids=self.ids[rows],
            feature_names=self.feature_names[k],
            feature_shape=self.feature_shapes[k],
            n_samples=self.n_samples,
            labels=self.y.copy() if is_active else None,
            labeled=self.labeled.copy() if is_active else None,
        )

    def coordinator_view(self) -> CoordinatorView:
        """Sample index, observed matrix and labels without any feature."""
        return CoordinatorView(
            ids=self.ids.copy(),
            observed=self.observed.copy(),
            y=self.y.copy(),
            labeled=self.labeled.copy(),
            task=self.task,
            active_party=self.active_party,
            party_names=tuple(self.party_names),
            feature_dims=self.feature_dims,
            feature_shapes=tuple(self.feature_shapes),
            info=dict(self.info),
            feature_names=tuple(self.feature_names),
        )

    # ------------------------------------------------------------------ derived datasets
    def _replace(self, **changes: Any) -> VerticalDataset:
        kwargs: dict[str, Any] = dict(
            blocks=self.blocks,
            observed=self.observed,
            ids=self.ids,
            y=self.y,
            labeled=self.labeled,
            task=self.task,
            active_party=self.active_party,
            feature_names=self.feature_names,
            party_names=self.party_names,
            feature_shapes=self.feature_shapes,
            name=self.name,
            info=dict(self.info),
        )
        kwargs.update(changes)
        return VerticalDataset(**kwargs)

    def subset(self, rows: Sequence[int] | np.ndarray) -> VerticalDataset:
        """The samples at positions ``rows`` (in that order)."""
        rows = np.asarray(rows)
        if rows.dtype == bool:
            if rows.shape != (self.n_samples,):
                raise DataValidationError(f"boolean row mask must have length {self.n_samples}")
            rows = np.flatnonzero(rows)
        rows = rows.astype(np.int64)
        if rows.size and (rows.min() < -self.n_samples or rows.max() >= self.n_samples):
            raise IndexError(f"row index out of range for {self.n_samples} samples")
        return self._replace(
            blocks=[b[rows] for b in self.blocks],
            observed=self.observed[rows],
            ids=self.ids[rows],
            y=self.y[rows],
            labeled=self.labeled[rows],
        )

    def train_test_split(
        self, test_fraction: float = 0.2, seed: int = 0, stratify: bool = True
    ) -> tuple[VerticalDataset, VerticalDataset]:
        """Seeded split; stratified by class over labelled samples when the task is classification."""
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
        rng = np.random.default_rng(seed)
        n = self.n_samples
        test = np.zeros(n, dtype=bool)
        if stratify and self.task is not None and self.task.is_classification:
            groups = np.where(self.labeled, self.y, -1)
            for g in np.unique(groups):
                idx = np.flatnonzero(groups == g)
                rng.shuffle(idx)
                test[idx[: int(round(test_fraction * len(idx)))]] = True
        else:
            idx = rng.permutation(n)
            test[idx[: int(round(test_fraction * n))]] = True
        return self.subset(np.flatnonzero(~test)), self.subset(np.flatnonzero(test))

    def with_observed(self, observed: np.ndarray) -> VerticalDataset:
        """The same samples with fewer observed blocks: rows that become unobserved are blanked (NaN).

        ``observed`` may only remove observations (a block cannot be made up).
        """
        observed = np.asarray(observed, dtype=bool)
        if observed.shape != self.observed.shape:
            raise DataValidationError(f"observed must have shape {self.observed.shape}, got {observed.shape}")
        added = observed & ~self.observed
        if added.any():
            i, j = np.argwhere(added)[0]
            raise DataValidationError(
                f"cannot mark party {j} ({self.party_names[j]!r}) as observing ID {show_id(self.ids[i])}: it holds no "
                "features for it"
            )
        blocks = []
        for j, b in enumerate(self.blocks):
            nb = b.copy()
            nb[~observed[:, j]] = np.nan
            blocks.append(nb)
        return self._replace(blocks=blocks, observed=observed)

    def with_labels(self, labeled: np.ndarray) -> VerticalDataset:
        """The same samples with a (smaller) label mask; labels that become unknown are erased."""
        labeled = np.asarray(labeled, dtype=bool)
        if labeled.shape != (self.n_samples,):
            raise DataValidationError(f"label mask must have length {self.n_samples}")
        if (labeled & ~self.labeled).any():
            i = int(np.flatnonzero(labeled & ~self.labeled)[0])
            raise DataValidationError(f"sample ID {show_id(self.ids[i])} has no label to reveal")
        y = self.y.copy()
        y[~labeled] = UNLABELED if self.task is None or self.task.is_classification else np.nan
        return self._replace(y=y, labeled=labeled)

    # ------------------------------------------------------------------ summaries
    def n_observed_parties(self) -> np.ndarray:
        """Number of observed parties per sample."""
        return self.observed.sum(axis=1)

    def summary(self) -> dict[str, Any]:
        """Counts that matter for missing data: sizes, per-party observed fractions, histogram, all-missing."""
        counts = self.n_observed_parties()
        hist = np.bincount(counts, minlength=self.n_parties + 1)
        n = max(self.n_samples, 1)
        return {
            "n_samples": self.n_samples,
            "n_labeled": self.n_labeled,
            "n_parties": self.n_parties,
            "observed_fraction": [round(float(v), 6) for v in self.observed.sum(axis=0) / n],
            "observed_parties_histogram": [int(v) for v in hist],
            "all_missing": int(hist[0]),
            "fully_aligned": int(hist[self.n_parties]),
        }

    def __repr__(self) -> str:
        return (
            f"VerticalDataset(name={self.name!r}, n_samples={self.n_samples}, parties={list(self.party_names)}, "
            f"dims={list(self.feature_dims)}, labeled={self.n_labeled}, "
            f"task={self.task.kind if self.task is not None else None}, "
            f"active={self.active_party})"
        )
