"""Helpers shared by the loaders: where a dataset's directory is, which files are missing, installed package files."""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Sequence
from pathlib import Path

from partialvfl.data.sources.base import DatasetUnavailable

__all__ = ["availability_of", "dir_env_var", "find_package_file", "missing_files", "require_files", "resolve_dir"]


def dir_env_var(name: str) -> str:
    """The environment variable naming a dataset's directory: ``PARTIALVFL_<NAME>_DIR`` (``-`` becomes ``_``)."""
    return "PARTIALVFL_" + name.upper().replace("-", "_") + "_DIR"


def resolve_dir(name: str, data_dir: str | Path | None, default: str | Path | None = None) -> Path | None:
    """The directory to read ``name`` from: the ``data_dir`` argument, else its environment variable, else default."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    env = os.environ.get(dir_env_var(name))
    if env:
        return Path(env).expanduser()
    return None if default is None else Path(default)


def missing_files(directory: Path | None, files: Sequence[str]) -> list[str]:
    """The expected files that are not in ``directory`` (all of them when there is no directory)."""
    if directory is None:
        return list(files)
    return [f for f in files if not (directory / f).is_file()]


def require_files(name: str, directory: Path | None, files: Sequence[str], how_to_get: str) -> Path:
    """``directory`` if it holds every expected file; else :class:`DatasetUnavailable` naming what is missing."""
    missing = missing_files(directory, files)
    if directory is None:
        raise DatasetUnavailable(
            f"dataset {name!r}: no directory given. Pass data_dir=... (CLI: --data-dir) or set {dir_env_var(name)} "
            f"to a directory holding {', '.join(files)}. {how_to_get}"
        )
    if missing:
        raise DatasetUnavailable(
            f"dataset {name!r}: missing {', '.join(missing)} in {directory} (expected files: {', '.join(files)}). "
            f"Pass data_dir=... (CLI: --data-dir) or set {dir_env_var(name)}. {how_to_get}"
        )
    return directory


def availability_of(name: str, directory: Path | None, files: Sequence[str]) -> tuple[bool, str]:
    """``(True, directory)`` if every expected file is there, else ``(False, what is missing and how to say where)``."""
    if directory is None:
        return False, f"needs {dir_env_var(name)} or data_dir holding {', '.join(files)}"
    missing = missing_files(directory, files)
    if missing:
        return False, f"missing {', '.join(missing)} in {directory} (set {dir_env_var(name)} or data_dir)"
    return True, str(directory)


def find_package_file(distribution: str, relative_path: str) -> Path | None:
    """The installed file ``relative_path`` of a distribution, found from its metadata without importing it."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).replace("\\", "/") == relative_path:
            path = Path(str(f.locate()))
            return path if path.is_file() else None
    return None
