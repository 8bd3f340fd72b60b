"""``cifar10`` / ``cifar100``: CIFAR from the "python version" pickled batches in a user-given directory.

Name the directory with ``data_dir`` or ``PARTIALVFL_CIFAR10_DIR`` / ``PARTIALVFL_CIFAR100_DIR``: either the
unpacked ``cifar-10-batches-py`` / ``cifar-100-python`` folder or the folder that contains it.  Images are returned as
``(n, 3, 32, 32)`` float32 in [0, 1]; CIFAR-100 uses the 100 fine labels.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.data.dataset import Task
from partialvfl.data.sources._common import availability_of, require_files, resolve_dir
from partialvfl.data.sources.base import RawSource, SourceInfo, register_source

__all__ = ["CIFAR10_CLASSES", "CIFAR10_FILES", "CIFAR100_FILES", "load_cifar10", "load_cifar100", "read_batch"]

CIFAR10_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
CIFAR100_FILES = ("train", "test")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
_HOW = "Download the 'CIFAR-{v} python version' from https://www.cs.toronto.edu/~kriz/cifar.html and unpack it."


def _numpy_reconstruct() -> Any:
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


def _numpy_frombuffer() -> Any:
    try:
        from numpy._core.numeric import _frombuffer  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.numeric import _frombuffer
    return _frombuffer


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """Unpickles dicts/lists/bytes/numbers plus numpy arrays, and nothing else.

    The CIFAR batches are pickles (of plain dicts holding a uint8 array, a list of labels and byte strings), and a
    pickle can name any importable callable; this unpickler only resolves the few numpy names needed to rebuild an
    ndarray (its reconstructor, ``ndarray``, ``dtype``, the protocol-5 buffer helper) and ``_codecs.encode``, which
    protocol-2 pickles written by Python 3 use for raw bytes.  Any other global is refused, so a tampered file cannot
    run code.
    """

    def find_class(self, module: str, name: str) -> Any:
        if name == "_reconstruct" and module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            return _numpy_reconstruct()
        if name == "_frombuffer" and module in ("numpy.core.numeric", "numpy._core.numeric"):
            return _numpy_frombuffer()
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        if (module, name) == ("_codecs", "encode"):
            import codecs

            return codecs.encode
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only numpy arrays may appear in a CIFAR batch")


def read_batch(path: str | Path) -> dict[str, Any]:
    """One CIFAR batch file as a dict with ``str`` keys (the originals are Python 2 pickles with byte-string keys)."""
    with open(path, "rb") as f:
        obj = _ArraysOnlyUnpickler(f, encoding="bytes").load()
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    return {k.decode("latin-1") if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


def _images_and_labels(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    batch = read_batch(path)
    for key in ("data", label_key):
        if key not in batch:
            raise ValueError(f"{path}: batch has no {key!r} entry (keys: {sorted(batch)})")
    data = np.asarray(batch["data"])
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.shape[0] != labels.shape[0]:
        raise ValueError(f"{path}: expected (n, 3072) pixels and n labels, got {data.shape} and {labels.shape}")
    images = data.reshape(-1, 3, 32, 32).astype(np.float32) / np.float32(255.0)
    return images, labels


def _cifar_dir(name: str, subdir: str, data_dir: str | Path | None) -> Path | None:
    directory = resolve_dir(name, data_dir)
    if directory is not None and (directory / subdir).is_dir():
        return directory / subdir
    return directory


def _class_names(directory: Path, meta_file: str, key: str, n: int, fallback: tuple[str, ...] | None) -> tuple:
    path = directory / meta_file
    if path.is_file():
        names = read_batch(path).get(key)
        if names is not None and len(names) == n:
            return tuple(v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in names)
    return fallback if fallback is not None else tuple(f"class{i}" for i in range(n))


def _check_labels(path: Path, labels: np.ndarray, n_classes: int) -> None:
    if labels.size and (labels.min() < 0 or labels.max() >= n_classes):
        raise ValueError(f"{path}: labels must lie in 0..{n_classes - 1}, found {labels.min()}..{labels.max()}")


def load_cifar10(data_dir: str | Path | None = None) -> RawSource:
    """CIFAR-10: 50,000 training images (data_batch_1..5) and 10,000 test images (test_batch), 10 classes."""
    directory = require_files("cifar10", _cifar_dir("cifar10", "cifar-10-batches-py", data_dir), CIFAR10_FILES,
                              _HOW.format(v="10"))
    parts = [_images_and_labels(directory / f, "labels") for f in CIFAR10_FILES]
    X_train = np.concatenate([p[0] for p in parts[:5]])
    y_train = np.concatenate([p[1] for p in parts[:5]])
    X_test, y_test = parts[5]
    for f, labels in ((CIFAR10_FILES[0], y_train), (CIFAR10_FILES[5], y_test)):
        _check_labels(directory / f, labels, 10)
    return RawSource(
        name="cifar10",
        X_train=X_train,
        y_train=y_train,
        X_test=X_test,
        y_test=y_test,
        task=Task.classification(_class_names(directory, "batches.meta", "label_names", 10, CIFAR10_CLASSES)),
        origin=str(directory),
        kind="image",
    )


def load_cifar100(data_dir: str | Path | None = None) -> RawSource:
    """CIFAR-100 with its 100 fine labels: 50,000 training (``train``) and 10,000 test (``test``) images."""
    directory = require_files("cifar100", _cifar_dir("cifar100", "cifar-100-python", data_dir), CIFAR100_FILES,
                              _HOW.format(v="100"))
    X_train, y_train = _images_and_labels(directory / "train", "fine_labels")
    X_test, y_test = _images_and_labels(directory / "test", "fine_labels")
    _check_labels(directory / "train", y_train, 100)
    _check_labels(directory / "test", y_test, 100)
    return RawSource(
        name="cifar100",
        X_train=X_train,
        y_train=y_train,
        X_test=X_test,
        y_test=y_test,
        task=Task.classification(_class_names(directory, "meta", "fine_label_names", 100, None)),
        origin=str(directory),
        kind="image",
    )


def _cifar10_available(data_dir: str | Path | None = None) -> tuple[bool, str]:
    return availability_of("cifar10", _cifar_dir("cifar10", "cifar-10-batches-py", data_dir), CIFAR10_FILES)


def _cifar100_available(data_dir: str | Path | None = None) -> tuple[bool, str]:
    return availability_of("cifar100", _cifar_dir("cifar100", "cifar-100-python", data_dir), CIFAR100_FILES)


register_source(
    SourceInfo(
        name="cifar10",
        description="CIFAR-10, 3x32x32 colour images, 10 classes, python-version batches (user-given dir)",
        loader=load_cifar10,
        availability=_cifar10_available,
        train_shape=(50000, 3, 32, 32),
        test_shape=(10000, 3, 32, 32),
        n_classes=10,
    )
)
register_source(
    SourceInfo(
        name="cifar100",
        description="CIFAR-100 (fine labels), 3x32x32 colour images, 100 classes, python-version (user-given dir)",
        loader=load_cifar100,
        availability=_cifar100_available,
        train_shape=(50000, 3, 32, 32),
        test_shape=(10000, 3, 32, 32),
        n_classes=100,
    )
)
