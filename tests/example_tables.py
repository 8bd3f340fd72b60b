"""The worked example's tables (scripts/make_example_tables.py) for tests, written into a directory."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the example's three parties, the label holder first
PARTIES = ("bank", "shop", "telco")


def write_example(directory: Path, *, seed: int, n_train: int, n_new: int) -> Path:
    """Run the script's ``write`` into ``directory`` (train/, new/, outcomes/) and return ``directory``."""
    spec = importlib.util.spec_from_file_location("make_example_tables", ROOT / "scripts" / "make_example_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(directory, seed=seed, n_train=n_train, n_new=n_new)
    return directory


def table_paths(directory: Path, folder: str = "train", parties: Iterable[str] = PARTIES) -> dict[str, Path]:
    """Each party's table of one of the example's folders (train/, new/, outcomes/): ``{party: path}``."""
    return {p: Path(directory) / folder / f"{p}.csv" for p in parties}
