"""``digits``: scikit-learn's bundled 8x8 handwritten digits, the default dataset everywhere (no download)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from partialvfl.data.dataset import Task
from partialvfl.data.sources.base import RawSource, SourceInfo, register_source

__all__ = ["load_digits"]


def load_digits(data_dir: str | Path | None = None) -> RawSource:
    """The 1,797 x 64 digits of ``sklearn.datasets.load_digits`` (pixel counts 0..16), 10 classes, no test split.

    Kept tabular (64 columns, row-major over the 8x8 image), so the default contiguous splitter gives each party
    whole image rows.  ``data_dir`` is accepted for a uniform loader signature and ignored.
    """
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    X = np.asarray(bunch.data, dtype=np.float32)
    y = np.asarray(bunch.target, dtype=np.int64)
    return RawSource(
        name="digits",
        X_train=X,
        y_train=y,
        task=Task.classification([str(c) for c in bunch.target_names]),
        feature_names=tuple(str(f) for f in bunch.feature_names),
        origin="sklearn.datasets.load_digits",
        kind="tabular",
        extra={"image_shape": (8, 8)},
    )


def _digits_available(data_dir: str | Path | None = None) -> tuple[bool, str]:
    return True, "sklearn.datasets.load_digits (bundled with scikit-learn)"


register_source(
    SourceInfo(
        name="digits",
        description="scikit-learn 8x8 handwritten digits, 64 features, 10 classes (bundled; the default)",
        loader=load_digits,
        availability=_digits_available,
        train_shape=(1797, 64),
        n_classes=10,
    )
)
