"""A column of normalised ID texts held as Arrow strings: about 4 bytes per ID besides its text, instead of a Python
string object per ID (about 60 bytes for a ten-character ID) in an object array.

:class:`IdColumn` reads like the object array it replaces where a party keeps its table's IDs: ``len``, iteration
(``str`` values), an integer gives a ``str``, a slice an :class:`IdColumn`, an array of positions (or a boolean mask)
an object array of just those IDs, and ``numpy.asarray`` the whole column as an object array.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["IdColumn"]


class IdColumn(Sequence[str]):
    """Normalised ID texts in an Arrow (chunked) string array."""

    def __init__(self, data: pa.ChunkedArray | pa.Array | Sequence[str] | np.ndarray) -> None:
        if isinstance(data, pa.ChunkedArray):
            self.data = data
        elif isinstance(data, pa.Array):
            self.data = pa.chunked_array([data], type=data.type)
        else:
            self.data = pa.chunked_array([pa.array(list(data), type=pa.string())], type=pa.string())

    @classmethod
    def concat(cls, parts: Sequence[IdColumn]) -> IdColumn:
        """The columns one after the other."""
        chunks = [c for p in parts for c in p.data.chunks]
        return cls(pa.chunked_array(chunks, type=pa.string()))

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[str]:
        for chunk in self.data.chunks:
            yield from chunk.to_pylist()

    def tolist(self) -> list[str]:
        """The IDs as a list of strings."""
        return self.data.to_pylist()

    def take(self, positions: Any) -> IdColumn:
        """The IDs at ``positions`` (integers) as another column."""
        return IdColumn(self.data.take(pa.array(np.asarray(positions, dtype=np.int64))))

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int | np.integer):
            n = len(self)
            if not -n <= int(key) < n:
                raise IndexError(f"ID position {int(key)} out of range for {n} IDs")
            return self.data[int(key) % n].as_py()
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            return IdColumn(self.data.slice(start, max(0, stop - start)))
        where = np.asarray(key)
        if where.dtype == bool:
            where = np.flatnonzero(where)
        return np.array(self.data.take(pa.array(where.astype(np.int64, copy=False))).to_pylist(), dtype=object)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.array(self.tolist(), dtype=object)
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"IdColumn({len(self)} IDs)"
