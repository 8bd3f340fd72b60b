"""The FALSE-VFL paper's experimental protocol as one function: a source in, a (train, test) pair of datasets out.

:func:`make_protocol` follows section 5 and Appendix D of the paper:

1. load the source; if it has no official test split, hold out ``test_fraction`` of it (seeded, stratified by
   class for classification);
2. optionally cap the training / test sets at ``max_train`` / ``max_test`` samples (seeded; for quick runs);
3. split the columns into K parties (by default ``grid`` for image sources, ``views`` for multi-view sources
   (``RawSource.kind == "multiview"``), ``contiguous`` for tabular ones);
4. standardise every party's columns with a :class:`~partialvfl.data.preprocessing.Standardizer` fitted on the
   (at this point fully observed) training set and applied to the test set: the paper normalises before the
   mechanisms, and MAR / MNAR read the standardised values.  The datasets say so (``info["standardized"]``), and
   the methods' own per-party standardisation (parameter ``standardize``) leaves them as they are;
5. choose ``n_labels`` labelled training samples at random; the other training labels are erased;
6. keep ``n_aligned`` of the labelled samples fully observed (the aligned reserve) and apply the training mechanism
   to every other training sample (the other labelled ones and all unlabelled ones);
7. apply the test mechanism to every test sample; all test labels are kept, for evaluation.

Randomness: each stage draws from its own generator, seeded by ``numpy.random.SeedSequence([seed, stage])`` with a
fixed stage number (:data:`STAGES`).  So the stages do not consume each other's random numbers: the test set's mask
depends only on (seed, test mechanism, the test samples), never on the training mechanism or the label counts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.data.dataset import DataValidationError, VerticalDataset
from partialvfl.data.importance_split import ImportanceSplitter
from partialvfl.data.mechanisms import Mechanism, parse_mechanism
from partialvfl.data.preprocessing import Standardizer
from partialvfl.data.sources.base import RawSource
from partialvfl.data.splitters import Splitter, parse_splitter, split_source_array

__all__ = ["STAGES", "ProtocolConfig", "describe", "make_protocol", "stage_rng", "validation_set",
           "with_test_mechanism"]

#: The stage number of each random stage; the generator of a stage is seeded by SeedSequence([seed, number]).
STAGES = {
    "test_split": 0,
    "max_train": 1,
    "max_test": 2,
    "labels": 3,
    "aligned": 4,
    "train_mechanism": 5,
    "test_mechanism": 6,
    "validation_mechanism": 7,
}


#: What ``info["standardized"]`` says of protocol data: methods do not standardise it again (``standardize``).
STANDARDIZED = "per party, on the fully observed training set before the mechanisms (the paper's protocol)"


def stage_rng(seed: int, stage: str) -> np.random.Generator:
    """The generator of one protocol stage (see :data:`STAGES`)."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), STAGES[stage]]))


@dataclass(frozen=True)
class ProtocolConfig:
    """One experiment's data: which source, how many parties, labels, aligned samples, mechanisms and seed.

    The defaults are the paper's tabular setting (8 parties, 500 labels, 100 aligned); images use 1000 / 200.
    ``splitter`` ``None`` means ``grid`` for image sources and ``contiguous`` for tabular ones; ``active_party``
    ``None`` means the last party (K - 1).
    """

    dataset: str
    parties: int = 8
    n_labels: int = 500
    n_aligned: int = 100
    train_missing: str = "mcar2"
    test_missing: str = "mcar0"
    seed: int = 0
    splitter: str | None = None
    test_fraction: float = 0.2
    active_party: int | None = None
    max_train: int | None = None
    max_test: int | None = None
    data_dir: str | Path | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str) or not self.dataset:
            raise DataValidationError(f"dataset must be a dataset name, got {self.dataset!r}")
        if not isinstance(self.parties, (int, np.integer)) or isinstance(self.parties, bool) or self.parties < 1:
            raise DataValidationError(f"parties must be a positive integer, got {self.parties!r}")
        for f in ("n_labels", "n_aligned"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise DataValidationError(f"{f} must be a non-negative integer, got {v!r}")
        if self.n_aligned > self.n_labels:
            raise DataValidationError(
                f"n_aligned ({self.n_aligned}) cannot exceed n_labels ({self.n_labels}): the aligned reserve is "
                "taken from the labelled samples"
            )
        if not 0.0 < float(self.test_fraction) < 1.0:
            raise DataValidationError(f"test_fraction must lie in (0, 1), got {self.test_fraction}")
        for f in ("max_train", "max_test"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, (int, np.integer)) or v < 1):
                raise DataValidationError(f"{f} must be a positive integer or None, got {v!r}")
        if self.active_party is not None and not -self.parties <= self.active_party < self.parties:
            raise DataValidationError(
                f"active_party {self.active_party} is out of range for {self.parties} parties (0..{self.parties - 1})"
            )
        if not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise DataValidationError(f"seed must be a non-negative integer, got {self.seed!r}")
        # parse early so a typo fails before any data is loaded
        object.__setattr__(self, "train_missing", parse_mechanism(self.train_missing).name)
        object.__setattr__(self, "test_missing", parse_mechanism(self.test_missing).name)
        if self.splitter is not None:
            object.__setattr__(self, "splitter", parse_splitter(self.splitter).name)
        if self.data_dir is not None:
            object.__setattr__(self, "data_dir", str(self.data_dir))

    def to_dict(self) -> dict[str, Any]:
        """The configuration as a plain dictionary (what a model file records)."""
        return asdict(self)


def _default_splitter(source: RawSource) -> Splitter:
    """``grid`` for image sources, ``views`` for multi-view sources, ``contiguous`` otherwise."""
    return parse_splitter({"image": "grid", "multiview": "views"}.get(source.kind, "contiguous"))


def _holdout(y: np.ndarray, fraction: float, stratify: bool, rng: np.random.Generator) -> np.ndarray:
    """Boolean test mask: ``fraction`` of the samples, per class when ``stratify``."""
    n = len(y)
    test = np.zeros(n, dtype=bool)
    groups = [np.arange(n)] if not stratify else [np.flatnonzero(y == c) for c in np.unique(y)]
    for idx in groups:
        idx = rng.permutation(idx)
        test[idx[: int(round(fraction * len(idx)))]] = True
    if test.all() or not test.any():
        raise DataValidationError(
            f"a test fraction of {fraction} of {n} samples leaves an empty training or test set"
        )
    return test


def _cap(n: int, cap: int | None, rng: np.random.Generator) -> np.ndarray:
    if cap is None or cap >= n:
        return np.arange(n)
    return np.sort(rng.choice(n, size=cap, replace=False))


def make_protocol(
    config: ProtocolConfig, source: RawSource | None = None
) -> tuple[VerticalDataset, VerticalDataset]:
    """Build the (train, test) pair of one experiment; see the module docstring for the stages."""
    if source is None:
        from partialvfl.data.sources import load_source  # lazy: loaders are optional and heavy

        source = load_source(config.dataset, config.data_dir)
    seed = int(config.seed)

    X_train, y_train = np.asarray(source.X_train), np.asarray(source.y_train)
    if X_train.ndim < 2 or X_train.shape[0] != y_train.shape[0]:
        raise DataValidationError(
            f"source {source.name!r}: X_train {X_train.shape} and y_train {y_train.shape} do not match"
        )
    if source.X_test is not None:
        if source.y_test is None:
            raise DataValidationError(f"source {source.name!r} has test features but no test labels")
        X_test, y_test = np.asarray(source.X_test), np.asarray(source.y_test)
        train_ids, test_ids = np.arange(len(X_train)), np.arange(len(X_test))
        split = "official"
    else:
        test_mask = _holdout(
            y_train, config.test_fraction, source.task.is_classification, stage_rng(seed, "test_split")
        )
        X_test, y_test = X_train[test_mask], y_train[test_mask]
        X_train, y_train = X_train[~test_mask], y_train[~test_mask]
        train_ids, test_ids = np.flatnonzero(~test_mask), np.flatnonzero(test_mask)
        how = "stratified" if source.task.is_classification else "random"
        split = f"held out {config.test_fraction} (seeded, {how})"

    keep = _cap(len(X_train), config.max_train, stage_rng(seed, "max_train"))
    X_train, y_train, train_ids = X_train[keep], y_train[keep], train_ids[keep]
    keep = _cap(len(X_test), config.max_test, stage_rng(seed, "max_test"))
    X_test, y_test, test_ids = X_test[keep], y_test[keep], test_ids[keep]

    n_train = len(X_train)
    if config.n_labels > n_train:
        raise DataValidationError(
            f"n_labels ({config.n_labels}) exceeds the {n_train} training samples of {source.name!r}"
        )
    if len(X_test) == 0:
        raise DataValidationError(f"source {source.name!r} has no test samples")

    splitter = parse_splitter(config.splitter) if config.splitter is not None else _default_splitter(source)
    k = config.parties
    split_report: dict[str, Any] = {}
    if isinstance(splitter, ImportanceSplitter):  # data-dependent: fitted on the training rows only
        splitter = splitter.fitted(X_train, y_train, k, seed, source.task.is_classification)
        split_report = splitter.report()
    blocks_tr, names, shapes = split_source_array(X_train, splitter, k, source.feature_names)
    blocks_te, _, _ = split_source_array(X_test, splitter, k, source.feature_names)
    active = k - 1 if config.active_party is None else config.active_party % k
    common: dict[str, Any] = dict(
        task=source.task,
        active_party=active,
        feature_names=names,
        feature_shapes=shapes,
    )
    train = VerticalDataset(
        blocks=blocks_tr, observed=np.ones((n_train, k), bool), ids=train_ids, y=y_train,
        labeled=np.ones(n_train, bool), name=f"{source.name}:train", **common,
    )
    test = VerticalDataset(
        blocks=blocks_te, observed=np.ones((len(X_test), k), bool), ids=test_ids, y=y_test,
        labeled=np.ones(len(X_test), bool), name=f"{source.name}:test", **common,
    )
    scaler = Standardizer.fit(train)
    train, test = scaler.transform(train), scaler.transform(test)

    labeled_rows = stage_rng(seed, "labels").choice(n_train, size=config.n_labels, replace=False)
    aligned_rows = stage_rng(seed, "aligned").choice(labeled_rows, size=config.n_aligned, replace=False)
    labeled = np.zeros(n_train, bool)
    labeled[labeled_rows] = True
    aligned = np.zeros(n_train, bool)
    aligned[aligned_rows] = True

    train_mech: Mechanism = parse_mechanism(config.train_missing)
    test_mech: Mechanism = parse_mechanism(config.test_missing)
    observed_tr = np.ones((n_train, k), bool)
    rest = np.flatnonzero(~aligned)
    if rest.size:
        observed_tr[rest] = train_mech.sample([b[rest] for b in train.blocks], stage_rng(seed, "train_mechanism"))
    observed_te = test_mech.sample(test.blocks, stage_rng(seed, "test_mechanism"))

    info = {"protocol": config.to_dict(), "splitter": splitter.name, "test_split": split,
            "standardized": STANDARDIZED}
    if split_report:
        info["split"] = split_report
    train = train.with_observed(observed_tr).with_labels(labeled)
    train.info.update(
        info, role="train", mechanism=train_mech.name, aligned_ids=[int(i) for i in train.ids[aligned]]
    )
    test = test.with_observed(observed_te)
    test.info.update(info, role="test", mechanism=test_mech.name)
    return train, test


def with_test_mechanism(config: ProtocolConfig, mechanism: str, source: RawSource | None = None) -> VerticalDataset:
    """The test set of ``config`` under test mechanism ``mechanism``, the same rows and values as ``make_protocol``'s.

    The test mask comes from its own seeded stage, so it depends only on (seed, test mechanism, test samples): the
    training side is rebuilt under the cheap ``mcar0`` and thrown away.  Pass ``source`` to avoid reloading it.
    """
    return make_protocol(replace(config, train_missing="mcar0", test_missing=mechanism), source)[1]


def validation_set(config: ProtocolConfig, mechanism: str, source: RawSource | None = None) -> VerticalDataset:
    """The protocol's validation set: the training samples whose labels the protocol erased (step 5), with their
    labels, under ``mechanism`` (its own seeded stage).  No method trains on those labels (some see the samples'
    features without them: FALSE-VFL's stage 1, SimSiam pretraining), and the test set is left alone, so a model's
    post-hoc calibration can be fitted here and scored on the test set."""
    if source is None:
        from partialvfl.data.sources import load_source

        source = load_source(config.dataset, config.data_dir)
    train = make_protocol(replace(config, train_missing="mcar0", test_missing="mcar0"), source)[0]
    rows = np.flatnonzero(~train.labeled)
    if rows.size == 0:
        raise DataValidationError(f"the protocol labels all {train.n_samples} training samples of "
                                  f"{source.name!r}: none is left to validate on")
    y_source = np.asarray(source.y_train)  # the training rows' IDs are their rows in the source's training split
    held = train.subset(rows)
    full = VerticalDataset(blocks=list(held.blocks), observed=np.ones_like(held.observed), ids=held.ids,
                           y=y_source[np.asarray(held.ids, dtype=np.int64)], labeled=np.ones(len(rows), bool),
                           task=source.task, active_party=held.active_party, feature_names=held.feature_names,
                           party_names=held.party_names, feature_shapes=held.feature_shapes,
                           name=f"{source.name}:validation")
    mech = parse_mechanism(mechanism)
    observed = mech.sample(full.blocks, stage_rng(config.seed, "validation_mechanism"))
    out = full.with_observed(observed)
    out.info.update({k: v for k, v in train.info.items() if k not in ("role", "mechanism", "aligned_ids")},
                    role="validation", mechanism=mech.name)
    return out


def describe(train: VerticalDataset, test: VerticalDataset) -> dict[str, Any]:
    """The summaries of a protocol's training and test sets."""
    return {"train": train.summary(), "test": test.summary()}

