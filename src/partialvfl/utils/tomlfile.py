"""Reading TOML configuration files with plain errors."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

__all__ = ["read_toml"]


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """The parsed TOML file at ``path``; ``what`` names it in errors (e.g. "federation file")."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} not found: {p}")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{p} is not valid TOML: {e}") from None
