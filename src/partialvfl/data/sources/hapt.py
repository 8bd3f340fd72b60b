"""``hapt``: UCI HAPT's 561 engineered features from the original text files in a user-given directory.

"Smartphone-Based Recognition of Human Activities and Postural Transitions" (Reyes-Ortiz et al., 2016), a FALSE-VFL
paper dataset that no package registry carries: name its directory with ``data_dir`` or ``PARTIALVFL_HAPT_DIR``.
Expected files (whitespace separated): ``Train/X_train.txt`` (7,767 x 561), ``Train/y_train.txt`` (labels 1..12),
``Test/X_test.txt`` (3,162 x 561), ``Test/y_test.txt``; the official split is by volunteer.  ``features.txt`` is
used for feature names when present.  Labels 1..12 are stored as 0..11.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from partialvfl.data.dataset import Task
from partialvfl.data.sources._common import availability_of, require_files, resolve_dir
from partialvfl.data.sources.base import RawSource, SourceInfo, register_source

__all__ = ["HAPT_ACTIVITIES", "HAPT_FILES", "load_hapt"]

HAPT_FILES = ("Train/X_train.txt", "Train/y_train.txt", "Test/X_test.txt", "Test/y_test.txt")
HAPT_ACTIVITIES = (
    "WALKING", "WALKING_UPSTAIRS", "WALKING_DOWNSTAIRS", "SITTING", "STANDING", "LAYING",
    "STAND_TO_SIT", "SIT_TO_STAND", "SIT_TO_LIE", "LIE_TO_SIT", "STAND_TO_LIE", "LIE_TO_STAND",
)
N_FEATURES = 561
_HOW = ("Download 'Smartphone-Based Recognition of Human Activities and Postural Transitions' from the UCI Machine "
        "Learning Repository (https://archive.ics.uci.edu/dataset/341) and unzip it.")


def _read_split(directory: Path, x_file: str, y_file: str) -> tuple[np.ndarray, np.ndarray]:
    X = np.loadtxt(directory / x_file, dtype=np.float64, ndmin=2)
    y = np.loadtxt(directory / y_file, dtype=np.float64, ndmin=1)
    if X.shape[1] != N_FEATURES:
        raise ValueError(f"{directory / x_file}: expected {N_FEATURES} features per line, got {X.shape[1]}")
    if y.shape[0] != X.shape[0]:
        raise ValueError(f"{directory / y_file} has {y.shape[0]} labels for {X.shape[0]} rows of {x_file}")
    bad = (y != np.round(y)) | (y < 1) | (y > len(HAPT_ACTIVITIES))
    if bad.any():
        line = int(np.flatnonzero(bad)[0]) + 1
        raise ValueError(f"{directory / y_file}, line {line}: label {y[line - 1]!r} is not an integer 1..12")
    return X.astype(np.float32), y.astype(np.int64) - 1


def _feature_names(directory: Path) -> tuple[str, ...] | None:
    path = directory / "features.txt"
    if not path.is_file():
        return None
    names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if len(names) != N_FEATURES:
        return None
    # Some feature names repeat in the original list; the line number keeps them unique.
    return tuple(f"{i + 1}:{n}" for i, n in enumerate(names))


def load_hapt(data_dir: str | Path | None = None) -> RawSource:
    """The official split: 7,767 training and 3,162 test samples, 561 features, 12 classes."""
    directory = require_files("hapt", resolve_dir("hapt", data_dir), HAPT_FILES, _HOW)
    X_train, y_train = _read_split(directory, HAPT_FILES[0], HAPT_FILES[1])
    X_test, y_test = _read_split(directory, HAPT_FILES[2], HAPT_FILES[3])
    return RawSource(
        name="hapt",
        X_train=X_train,
        y_train=y_train,
        X_test=X_test,
        y_test=y_test,
        task=Task.classification(HAPT_ACTIVITIES),
        feature_names=_feature_names(directory),
        origin=str(directory),
        kind="tabular",
    )


def _hapt_available(data_dir: str | Path | None = None) -> tuple[bool, str]:
    return availability_of("hapt", resolve_dir("hapt", data_dir), HAPT_FILES)


register_source(
    SourceInfo(
        name="hapt",
        description="UCI HAPT, 561 engineered features, 12 classes, official split (user-given dir)",
        loader=load_hapt,
        availability=_hapt_available,
        paper_dataset=True,
        train_shape=(7767, 561),
        test_shape=(3162, 561),
        n_classes=12,
    )
)
