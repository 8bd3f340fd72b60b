"""Progress reporting for long work: tqdm bars and one-line stage/epoch reports."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")

__all__ = ["progress", "report_line"]


def progress(items: Iterable[T], desc: str, enabled: bool = True, total: int | None = None) -> Iterator[T]:
    """Iterate with a progress bar on stderr when ``enabled``."""
    if not enabled:
        yield from items
        return
    yield from tqdm(items, desc=desc, total=total, file=sys.stderr, leave=False, dynamic_ncols=True)


def report_line(text: str, enabled: bool = True) -> None:
    """One progress line (epoch, bound, loss...) on stderr, without breaking a running bar."""
    if enabled:
        tqdm.write(text, file=sys.stderr)
