"""What a dataset loader returns, and the registry of loaders."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.data.dataset import Task

__all__ = ["DatasetUnavailable", "RawSource", "SourceInfo", "register_source", "SOURCES"]


class DatasetUnavailable(FileNotFoundError):
    """The files of a dataset are not on this machine; the message lists the expected files and the install line."""


@dataclass(frozen=True)
class RawSource:
    """A whole dataset before any party split: features, labels, and an official test split if it has one.

    ``X_train``/``X_test`` are ``(n, *sample_shape)`` float arrays (images keep their 2-D or 3-D shape so that
    grid splitters can cut them); labels are class indices ``0..C-1`` (classification) or floats (regression).
    """

    name: str
    X_train: np.ndarray
    y_train: np.ndarray
    task: Task
    X_test: np.ndarray | None = None
    y_test: np.ndarray | None = None
    feature_names: tuple[str, ...] | None = None
    origin: str = ""
    kind: str = "tabular"  # "tabular" or "image": chooses the default party splitter
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The shape of one sample (without the sample axis)."""
        return tuple(int(s) for s in self.X_train.shape[1:])


@dataclass(frozen=True)
class SourceInfo:
    """A registered dataset: its name, a one-line description, and its loader."""

    name: str
    description: str
    loader: Callable[..., RawSource]
    availability: Callable[[str | Path | None], tuple[bool, str]]
    paper_dataset: bool = False
    # Nominal sizes for listings (from the dataset's documentation; no loading needed): sample counts with the
    # per-sample shape, e.g. (60000, 28, 28); test_shape None when there is no official test split.
    train_shape: tuple[int, ...] | None = None
    test_shape: tuple[int, ...] | None = None
    n_classes: int | None = None


SOURCES: dict[str, SourceInfo] = {}


def register_source(info: SourceInfo) -> SourceInfo:
    """Register a dataset source under its name (a name registered twice is an error)."""
    if info.name in SOURCES:
        raise ValueError(f"dataset {info.name!r} registered twice")
    SOURCES[info.name] = info
    return info
