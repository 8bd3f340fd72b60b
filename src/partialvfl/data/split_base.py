"""What every party splitter shares: the column group a party gets, the splitter protocol, the split error."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["ColumnGroup", "Splitter", "SplitterError", "check_parties"]


class SplitterError(ValueError):
    """A splitter cannot cut the given sample shape into the requested parties; the message says why."""


@dataclass(frozen=True)
class ColumnGroup:
    """One party's share of a sample: flat column indices (row-major) and the shape the piece keeps."""

    columns: np.ndarray
    feature_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if int(np.prod(self.feature_shape)) != len(self.columns):
            raise SplitterError(f"feature shape {self.feature_shape} does not hold {len(self.columns)} columns")


@runtime_checkable
class Splitter(Protocol):
    """Maps a sample shape and a party count to one :class:`ColumnGroup` per party."""

    @property
    def name(self) -> str:
        """The canonical form, as :func:`parse_splitter` reads it back."""

    def groups(
        self, sample_shape: Sequence[int], n_parties: int, feature_names: Sequence[str] | None = None
    ) -> list[ColumnGroup]:
        """One column group per party for samples of ``sample_shape``; an impossible cut is a ``SplitterError``."""


def check_parties(n_parties: int, n_features: int) -> None:
    """Refuse a party count that is not a positive integer or exceeds the number of features."""
    if not isinstance(n_parties, (int, np.integer)) or n_parties < 1:
        raise SplitterError(f"the number of parties must be a positive integer, got {n_parties!r}")
    if n_parties > n_features:
        raise SplitterError(f"cannot give {n_parties} parties at least one feature each out of {n_features} features")
