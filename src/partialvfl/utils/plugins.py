"""Plug-ins: the modules an entry point group names, imported so that they declare themselves (methods, privacy
mechanisms)."""

from __future__ import annotations

from importlib.metadata import entry_points

__all__ = ["import_entry_points"]


def import_entry_points(group: str, what: str) -> None:
    """Import every module the entry point group ``group`` names; one that does not import is an error naming it as a
    ``what`` plug-in (e.g. "method", "privacy mechanism")."""
    for point in entry_points(group=group):
        try:
            point.load()
        except Exception as e:
            raise ValueError(f"{what} plugin {point.name!r} ({point.value}, entry point group {group}) does not "
                             f"import: {e}") from e
