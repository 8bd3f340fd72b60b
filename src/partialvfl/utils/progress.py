"""Progress reporting for long work: tqdm bars and one-line stage/epoch reports.

A fit's progress (:class:`~partialvfl.methods.base.VFLMethod`'s ``progress``) is one or the other, never both: a bar
over the epochs when stderr is a terminal (nothing per epoch when it is not: a log file gets no bar redraws), or,
asked for explicitly, one line per epoch."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")

__all__ = ["PROGRESS_MODES", "progress", "progress_mode", "report_line", "stderr_is_terminal"]

#: a fit's ``progress``: ``True`` a bar on a terminal (nothing per epoch otherwise), ``"epochs"`` a line per epoch
PROGRESS_MODES = (False, True, "epochs")


def stderr_is_terminal() -> bool:
    """Whether stderr is an interactive terminal (where a redrawn bar belongs)."""
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def progress_mode(setting: bool | str) -> tuple[bool, bool]:
    """``(bar, epoch lines)`` for a fit's ``progress`` setting (one of :data:`PROGRESS_MODES`)."""
    if setting == "epochs":
        return False, True
    return bool(setting) and stderr_is_terminal(), False


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
