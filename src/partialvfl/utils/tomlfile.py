"""Reading TOML configuration files with plain errors."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

__all__ = ["check_keys", "read_toml"]


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """The parsed TOML file at ``path``; ``what`` names it in errors (e.g. "federation file")."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} not found: {p}")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{p} is not valid TOML: {e}") from None


def check_keys(raw: dict[str, Any], schema: dict[str, tuple[str, ...] | None], path: str | Path) -> None:
    """Refuse keys a configuration file does not know: ``schema`` maps each section to its keys (``""`` for the
    top level's plain keys; ``None``: a section of named sub-tables its reader checks); a section given as a list of
    tables (``[[parties]]``) is checked per entry."""
    p = Path(path)
    for key, value in raw.items():
        if key not in schema:
            if isinstance(value, dict | list):
                raise ValueError(f"{p}: unknown section [{key}]; known sections: "
                                 f"{', '.join(f'[{s}]' for s in schema if s)}")
            raise ValueError(f"{p}: unknown key {key!r} at the top level; known sections: "
                             f"{', '.join(f'[{s}]' for s in schema if s)}")
        known = schema[key]
        if known is None:
            if not isinstance(value, dict):
                raise ValueError(f"{p}: [{key}] must be a table of tables")
            continue
        entries = value if isinstance(value, list) else [value]
        for entry in entries:
            if not isinstance(entry, dict):
                raise ValueError(f"{p}: [{key}] must be a table of keys")
            unknown = sorted(set(entry) - set(known))
            if unknown:
                raise ValueError(f"{p}: unknown key(s) {unknown} in [{key}]; known: {', '.join(known)}")
