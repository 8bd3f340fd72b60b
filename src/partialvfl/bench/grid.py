"""Experiment grids: a TOML (or YAML) file in, the list of fits (cells) to run out.

A grid names datasets (with their protocol: parties, labels, aligned samples, optional caps), methods (with a
preset, overrides and an optional display ``label``), training mechanisms, test mechanisms and seeds.  One *cell*
is one fit, ``(dataset, method, training mechanism, seed)``, evaluated on every test mechanism; one *row* of the
results store is one ``(cell, test mechanism)``.

The file's layout and its checks: :mod:`partialvfl.bench.grid_file`.

Nothing in a report is chosen on test data: the grid adds one *validation cell* per method entry, dataset and
training mechanism (at the dataset's first seed): the entry is fitted with ``validation_fraction`` (default 0.2) of
the labelled training samples held out (they stay in training, unlabelled) and scored on them.  The report shows,
per (dataset, training mechanism), the variant of each label with the best validation score (e.g. with or without
SimSiam), and its gap summary compares the FALSE-VFL variant and the other method chosen the same way.
``validation = false`` leaves the validation cells out (a quick run); its report then says it chose on test data.

A ``[tuning]`` table gives every method entry the same small search (learning rate, training length), chosen on
those validation cells before any test cell runs (:mod:`.tuning`): :meth:`Grid.cells` then lists the candidates'
validation cells, and, once ``choices`` are known, the chosen candidates' other cells.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from partialvfl.bench.tuning import Tuning, candidate_overrides, choice_key

__all__ = [
    "Cell",
    "DatasetSpec",
    "Grid",
    "GridError",
    "MethodSpec",
    "expand",
    "tuned_cells",
    "tuning_candidates",
    "stable_hash",
    "validation_cells",
]


class GridError(ValueError):
    """A grid file is malformed; the message names the file, the entry and the key at fault."""


def stable_hash(obj: Any) -> str:
    """A short hash of a JSON-able object that does not depend on key order (16 hex digits of SHA-256)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset of a grid and its protocol (see :class:`partialvfl.data.protocol.ProtocolConfig`)."""

    name: str
    parties: int = 8
    labels: int = 500
    aligned: int = 100
    max_train: int | None = None
    max_test: int | None = None
    splitter: str | None = None
    test_fraction: float = 0.2
    active_party: int | None = None
    data_dir: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    seeds: tuple[int, ...] | None = None  # this dataset's seeds, instead of the grid's
    label: str | None = None  # display name in reports (default: the source name)

    @property
    def display(self) -> str:
        """The dataset's name in reports (its label if it has one)."""
        return self.label or self.name

    def key(self) -> dict[str, Any]:
        """What identifies the data (``data_dir`` is where it is read from, not what it is: left out; nor the
        display label)."""
        d = asdict(self)
        for k in ("data_dir", "seeds", "label"):
            d.pop(k)
        return d

    def protocol_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``ProtocolConfig`` (without mechanisms and seed)."""
        return dict(
            dataset=self.name, parties=self.parties, n_labels=self.labels, n_aligned=self.aligned,
            max_train=self.max_train, max_test=self.max_test, splitter=self.splitter,
            test_fraction=self.test_fraction, active_party=self.active_party, data_dir=self.data_dir,
        )

    def source_key(self) -> tuple[str, str | None, str]:
        """What identifies the loaded source: name, directory and loader options (hashable, for caching)."""
        return self.name, self.data_dir, stable_hash(self.options)


@dataclass(frozen=True)
class MethodSpec:
    """One method entry: registry name, preset, overrides (global and per dataset) and display label."""

    name: str
    preset: str = "fast"
    label: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    dataset_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def display(self) -> str:
        """The entry's name in reports (its label if it has one)."""
        return self.label or self.name

    def overrides_for(self, dataset: str, label: str | None = None) -> dict[str, Any]:
        """The overrides, then those for the dataset's source name, then those for its display label."""
        out = dict(self.overrides)
        out.update(self.dataset_overrides.get(dataset, {}))
        if label is not None and label != dataset:
            out.update(self.dataset_overrides.get(label, {}))
        return out


@dataclass(frozen=True)
class Cell:
    """One fit of the grid, evaluated on every test mechanism."""

    dataset: DatasetSpec
    method: MethodSpec
    train_mechanism: str
    seed: int
    test_mechanisms: tuple[str, ...]
    role: str = "test"  # or "validation": a selection fit scored on held-out labelled training rows
    validation_fraction: float = 0.2
    #: a tuned grid's candidate: the entry's index and the tuned values (kept in the rows, not part of the key)
    tuning: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def overrides(self) -> dict[str, Any]:
        """The method parameters this cell sets for its dataset."""
        return self.method.overrides_for(self.dataset.name, self.dataset.label)

    def fit_config(self) -> dict[str, Any]:
        """Everything that determines the fitted model (the basis of the cell and row hashes)."""
        config = {
            "dataset": self.dataset.key(),
            "method": self.method.name,
            "preset": self.method.preset,
            "overrides": self.overrides,
            "train_mechanism": self.train_mechanism,
            "seed": self.seed,
        }
        if self.role != "test":
            config.update(role=self.role, validation_fraction=self.validation_fraction)
        return config

    @property
    def key(self) -> str:
        """The cell's stable hash: what the results store keys its rows by."""
        return stable_hash(self.fit_config())

    def row_key(self, test_mechanism: str) -> str:
        """The store's unique key of this cell's result on one test mechanism (its config hash)."""
        return stable_hash({**self.fit_config(), "test_mechanism": test_mechanism})

    def describe(self) -> str:
        """A short human-readable name: dataset/method/training mechanism/seed (and role)."""
        role = "" if self.role == "test" else f"/{self.role}"
        return f"{self.dataset.display}/{self.method.display}/{self.train_mechanism}/seed{self.seed}{role}"


@dataclass(frozen=True)
class Grid:
    """A parsed grid: its axes; :meth:`cells` expands them."""

    name: str
    datasets: tuple[DatasetSpec, ...]
    methods: tuple[MethodSpec, ...]
    train_mechanisms: tuple[str, ...]
    test_mechanisms: tuple[str, ...]
    seeds: tuple[int, ...]
    imports: tuple[str, ...] = ()
    description: str = ""
    source: str = ""
    validation: bool = True
    validation_fraction: float = 0.2
    tuning: Tuning | None = None

    def cells(self, choices: dict[tuple[str, int, str], int] | None = None) -> list[Cell]:
        """Every fit; in a tuned grid the candidates' validation cells, plus the cells of the candidates in
        ``choices`` (:func:`~partialvfl.bench.tuning.choose`; :func:`tuned_cells`)."""
        return expand(self, choices)

    @property
    def n_rows(self) -> int:
        """How many result rows the grid produces (one per cell and test mechanism)."""
        return sum(len(c.test_mechanisms) for c in self.cells())

    def seeds_of(self, dataset: DatasetSpec) -> tuple[int, ...]:
        """The seeds run on ``dataset`` (its own, else the grid's)."""
        return dataset.seeds or self.seeds


def expand(grid: Grid, choices: dict[tuple[str, int, str], int] | None = None) -> list[Cell]:
    """All cells, seed-major, then dataset, method, mechanism.

    Seed-major so that a grid stopped part-way (or still running) already holds every configuration for its
    first seeds: the report on it is a complete table with fewer seeds, not a table with holes.  A tuned grid's
    cells: :func:`tuned_cells`.
    """
    if grid.tuning is not None:
        return _unique(grid, tuned_cells(grid, choices or {}))
    all_seeds = sorted({s for d in grid.datasets for s in grid.seeds_of(d)})
    cells = (validation_cells(grid) if grid.validation else []) + [
        Cell(d, m, t, s, grid.test_mechanisms)
        for s in all_seeds
        for d in grid.datasets
        if s in grid.seeds_of(d)
        for m, t in itertools.product(grid.methods, grid.train_mechanisms)
    ]
    return _unique(grid, cells)


def _unique(grid: Grid, cells: list[Cell]) -> list[Cell]:
    seen: dict[str, Cell] = {}
    for c in cells:
        if c.key in seen:
            raise GridError(
                f"grid {grid.name!r}: {c.describe()} and {seen[c.key].describe()} are the same fit "
                "(same method, preset and overrides); remove one entry"
            )
        seen[c.key] = c
    return cells


def validation_cells(grid: Grid) -> list[Cell]:
    """The selection fits: one per method entry, dataset and training mechanism, at the dataset's first seed, scored
    on held-out labelled training rows (first in the run order, so a partial run can already select)."""
    return [Cell(d, m, t, grid.seeds_of(d)[0], ("validation",), "validation", grid.validation_fraction)
            for d in grid.datasets for m in grid.methods for t in grid.train_mechanisms]


# ---------------------------------------------------------------------- a tuned grid's cells (bench.tuning)
def tuning_candidates(grid: Grid) -> dict[tuple[str, int, str], list[Cell]]:
    """A tuned grid's candidate validation cells per (dataset, entry index, tuned training mechanism)."""
    assert grid.tuning is not None
    out: dict[tuple[str, int, str], list[Cell]] = {}
    for d in grid.datasets:
        for i, m in enumerate(grid.methods):
            cands = _candidate_specs(grid, d, i, m)
            for t in grid.train_mechanisms:
                if grid.tuning.tunes(t):
                    out[choice_key(d.display, i, t)] = [
                        Cell(d, spec, t, grid.seeds_of(d)[0], ("validation",), "validation", grid.validation_fraction,
                             tuning) for spec, tuning in cands]
    return out


def _candidate_specs(grid: Grid, d: DatasetSpec, i: int, m: MethodSpec) -> list[tuple[MethodSpec, dict[str, Any]]]:
    """Entry ``m``'s candidates on dataset ``d``: a method spec with the merged overrides, and the tuned values."""
    from partialvfl.methods.registry import get_method, get_spec

    assert grid.tuning is not None
    spec = get_spec(m.name)
    space = spec.params if spec is not None else get_method(m.name).param_space()
    out = []
    for cand in candidate_overrides(grid.tuning, m.name, m.preset, d.name, m.overrides_for(d.name, d.label)):
        resolved = space.resolve(m.preset, d.name, cand, owner=m.name)
        values = {"lr": resolved.get("lr"), "min_steps": cand.get("min_steps")}
        out.append((MethodSpec(m.name, m.preset, m.label or m.name, cand), {"entry": i, "values": values}))
    return out


def tuned_cells(grid: Grid, choices: dict[tuple[str, int, str], int]) -> list[Cell]:
    """A tuned grid: every candidate's validation cell (first), then for each (dataset, entry, mechanism) with a
    choice its chosen candidate's validation cell (mechanisms that do not tune) and test cells, seed-major."""
    cands = tuning_candidates(grid)
    cells = [c for group in cands.values() for c in group]
    all_seeds = sorted({s for d in grid.datasets for s in grid.seeds_of(d)})
    chosen: dict[tuple[str, int, str], tuple[MethodSpec, dict[str, Any]]] = {}
    for d in grid.datasets:
        for i, m in enumerate(grid.methods):
            specs = None
            for t in grid.train_mechanisms:
                key = choice_key(d.display, i, t)
                if key in choices:
                    specs = specs or _candidate_specs(grid, d, i, m)
                    chosen[key] = specs[choices[key]]
    assert grid.tuning is not None
    labels = [m.display for m in grid.methods]
    variants = len(set(labels)) < len(labels)  # validation cells choose between entries of one label: needed?
    for (dname, _, t), (spec, tuning) in chosen.items():
        if variants and not grid.tuning.tunes(t):
            d = next(x for x in grid.datasets if x.display == dname)
            cells.append(Cell(d, spec, t, grid.seeds_of(d)[0], ("validation",), "validation", grid.validation_fraction,
                              tuning))
    for s in all_seeds:
        for d in grid.datasets:
            if s not in grid.seeds_of(d):
                continue
            for i, t in itertools.product(range(len(grid.methods)), grid.train_mechanisms):
                if (key := choice_key(d.display, i, t)) in chosen:
                    spec, tuning = chosen[key]
                    cells.append(Cell(d, spec, t, s, grid.test_mechanisms, tuning=tuning))
    return cells
