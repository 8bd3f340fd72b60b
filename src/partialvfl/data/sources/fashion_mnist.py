"""``fashion-mnist``: Zalando's FashionMNIST from the original gzipped IDX files (a FALSE-VFL paper dataset).

Read from the ``data_dir`` argument, else ``PARTIALVFL_FASHION_MNIST_DIR``, else ``/usr/share/datasets/fashion-mnist``
(Debian's ``dataset-fashion-mnist`` package).  The IDX format: a big-endian 4-byte magic ``0x00 0x00 <type> <ndim>``
(type ``0x08`` = unsigned byte), ``ndim`` big-endian uint32 sizes, then the values in C order.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from partialvfl.data.dataset import Task
from partialvfl.data.sources._common import availability_of, require_files, resolve_dir
from partialvfl.data.sources.base import RawSource, SourceInfo, register_source

__all__ = ["FASHION_MNIST_CLASSES", "FASHION_MNIST_FILES", "load_fashion_mnist", "read_idx"]

DEFAULT_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
_HOW = "On Debian/Ubuntu: apt-get install dataset-fashion-mnist (files land in /usr/share/datasets/fashion-mnist)."


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (gzipped if the name ends in ``.gz``) as a uint8 array of the shape its header declares."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an IDX file (the magic number must start with two zero bytes)")
    if data[2] != 0x08:
        raise ValueError(f"{path}: IDX element type 0x{data[2]:02x} is not unsigned byte (0x08)")
    ndim = data[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(data) < header:
        raise ValueError(f"{path}: truncated IDX header")
    dims = tuple(int(v) for v in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(dims))
    if len(data) - header != expected:
        raise ValueError(f"{path}: header declares shape {dims} ({expected} bytes) but {len(data) - header} follow")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _fashion_dir(data_dir: str | Path | None) -> Path | None:
    return resolve_dir("fashion-mnist", data_dir, DEFAULT_DIR)


def load_fashion_mnist(data_dir: str | Path | None = None) -> RawSource:
    """The official 60,000 / 10,000 split as (n, 28, 28) float32 images scaled to [0, 1], 10 classes."""
    directory = require_files("fashion-mnist", _fashion_dir(data_dir), FASHION_MNIST_FILES, _HOW)
    arrays = [read_idx(directory / f) for f in FASHION_MNIST_FILES]
    x_tr, y_tr, x_te, y_te = arrays
    for images, labels, part in ((x_tr, y_tr, "train"), (x_te, y_te, "t10k")):
        if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
            raise ValueError(
                f"{directory}: {part} images {images.shape} and labels {labels.shape} do not match "
                "(expected (n, rows, cols) images and n labels)"
            )
        if labels.size and labels.max() >= len(FASHION_MNIST_CLASSES):
            raise ValueError(f"{directory}: {part} labels go up to {labels.max()}, FashionMNIST has 10 classes")
    return RawSource(
        name="fashion-mnist",
        X_train=x_tr.astype(np.float32) / np.float32(255.0),
        y_train=y_tr.astype(np.int64),
        X_test=x_te.astype(np.float32) / np.float32(255.0),
        y_test=y_te.astype(np.int64),
        task=Task.classification(FASHION_MNIST_CLASSES),
        origin=str(directory),
        kind="image",
    )


def _fashion_available(data_dir: str | Path | None = None) -> tuple[bool, str]:
    return availability_of("fashion-mnist", _fashion_dir(data_dir), FASHION_MNIST_FILES)


register_source(
    SourceInfo(
        name="fashion-mnist",
        description="FashionMNIST, 28x28 grey images, 10 classes, official 60k/10k split (gzipped IDX files)",
        loader=load_fashion_mnist,
        availability=_fashion_available,
        paper_dataset=True,
        train_shape=(60000, 28, 28),
        test_shape=(10000, 28, 28),
        n_classes=10,
    )
)
