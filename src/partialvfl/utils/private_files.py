"""Small state files only their owner reads: a party's lookup ledger, kept alignment nonces and kept session, a
coordinator's session secrets and alignment tickets."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["write_private", "write_private_json"]


def write_private(path: str | Path, write: Callable[[IO[Any]], Any], binary: bool = False) -> None:
    """``write(file)`` into ``path`` (its folders made), readable by its owner only, written atomically: a reader
    sees the old file or the new one, never half of one."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb" if binary else "w") as f:
        write(f)
    os.replace(tmp, p)


def write_private_json(path: str | Path, content: Any) -> None:
    """``content`` as JSON in ``path``, as :func:`write_private` writes."""
    write_private(path, lambda f: json.dump(content, f))
