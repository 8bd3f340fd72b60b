"""JSON encoding of the values our metadata carries (numpy scalars and arrays, paths, sets)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["json_default"]


def json_default(o: Any) -> Any:
    """``default=`` hook for :func:`json.dumps`: numpy values, paths and sets become plain JSON."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, set | frozenset):
        return sorted(o)
    raise TypeError(f"not JSON-serialisable: a {type(o).__name__}")
