"""``isolet``: UCI ISOLET (spoken letters) from the original ``.data`` files in a user-given directory.

A FALSE-VFL paper dataset that no package registry carries: download it from the UCI repository and name its
directory with ``data_dir`` or ``PARTIALVFL_ISOLET_DIR``.  Each line holds 617 comma-separated features and the
class 1..26 (the letters a..z; stored here as 0..25).  ``isolet1+2+3+4.data`` (6,238 samples, speakers of groups
1-4) is the official training set and ``isolet5.data`` (1,559 samples) the official test set.
"""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np

from partialvfl.data.dataset import Task
from partialvfl.data.sources._common import availability_of, require_files, resolve_dir
from partialvfl.data.sources.base import RawSource, SourceInfo, register_source

__all__ = ["ISOLET_FILES", "load_isolet", "read_isolet_file"]

ISOLET_FILES = ("isolet1+2+3+4.data", "isolet5.data")
N_FEATURES = 617
_HOW = ("Download ISOLET from the UCI Machine Learning Repository (https://archive.ics.uci.edu/dataset/54/isolet) "
        "and uncompress the two .data files (they are distributed as .data.Z: `uncompress` or `gzip -d`).")


def read_isolet_file(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """One ISOLET ``.data`` file: ``(X (n, 617) float32, y (n,) int64 in 0..25)``."""
    table = np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2)
    if table.shape[1] != N_FEATURES + 1:
        raise ValueError(f"{path}: expected {N_FEATURES} features and a class per line, got {table.shape[1]} values")
    labels = table[:, -1]
    bad = (labels != np.round(labels)) | (labels < 1) | (labels > 26)
    if bad.any():
        line = int(np.flatnonzero(bad)[0]) + 1
        raise ValueError(f"{path}, line {line}: class {labels[line - 1]!r} is not an integer 1..26")
    return table[:, :-1].astype(np.float32), labels.astype(np.int64) - 1


def load_isolet(data_dir: str | Path | None = None) -> RawSource:
    """The official split: 6,238 training and 1,559 test samples, 617 features, 26 classes."""
    directory = require_files("isolet", resolve_dir("isolet", data_dir), ISOLET_FILES, _HOW)
    X_train, y_train = read_isolet_file(directory / ISOLET_FILES[0])
    X_test, y_test = read_isolet_file(directory / ISOLET_FILES[1])
    return RawSource(
        name="isolet",
        X_train=X_train,
        y_train=y_train,
        X_test=X_test,
        y_test=y_test,
        task=Task.classification(tuple(string.ascii_lowercase)),
        origin=str(directory),
        kind="tabular",
    )


def _isolet_available(data_dir: str | Path | None = None) -> tuple[bool, str]:
    return availability_of("isolet", resolve_dir("isolet", data_dir), ISOLET_FILES)


register_source(
    SourceInfo(
        name="isolet",
        description="UCI ISOLET spoken letters, 617 features, 26 classes, official train/test files (user-given dir)",
        loader=load_isolet,
        availability=_isolet_available,
        paper_dataset=True,
        train_shape=(6238, 617),
        test_shape=(1559, 617),
        n_classes=26,
    )
)
