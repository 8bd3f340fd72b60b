"""Experiment grids: a TOML (or YAML) file in, the list of fits (cells) to run out.

A grid names datasets (with their protocol: parties, labels, aligned samples, optional caps), methods (with a
preset, overrides and an optional display ``label``), training mechanisms, test mechanisms and seeds.  One *cell*
is one fit, ``(dataset, method, training mechanism, seed)``, evaluated on every test mechanism; one *row* of the
results store is one ``(cell, test mechanism)``.

Layout (``grids/smoke.toml`` is a complete example)::

    name = "smoke"
    seeds = [0, 1]
    train_mechanisms = ["mcar2", "mcar5"]
    test_mechanisms = ["mcar0", "mcar2", "mcar5"]
    imports = []                 # modules to import first (they may register extra methods or datasets)

    [[datasets]]
    name = "digits"              # a registered data source
    label = "digits K=4"         # optional display name; entries of one source with other protocols need one
    parties = 4
    labels = 200                 # labelled training samples
    aligned = 50                 # of which fully observed
    max_train = 800              # optional caps, splitter, test_fraction, active_party, data_dir
    options = { n_samples = 2000 }  # optional keyword arguments of the source's loader
    seeds = [0]                  # optional: this dataset's seeds instead of the grid's

    [[methods]]
    name = "false-vfl-1"
    preset = "fast"
    label = "FALSE-VFL-I"        # optional; entries sharing a label are variants of one method: the report shows
    overrides = { epochs = 2 }   # the one chosen on validation data (and marks a labelled-only winner with *)
    [methods.dataset_overrides.digits]
    epochs = 3                   # optional per-dataset overrides, applied on top of ``overrides``

Nothing in a report is chosen on test data: the grid adds one *validation cell* per method entry, dataset and
training mechanism (at the dataset's first seed): the entry is fitted with ``validation_fraction`` (default 0.2) of
the labelled training samples held out (they stay in training, unlabelled) and scored on them.  The report shows,
per (dataset, training mechanism), the variant of each label with the best validation score (e.g. with or without
SimSiam), and its gap summary compares the FALSE-VFL variant and the other method chosen the same way.
``validation = false`` leaves the validation cells out (a quick run); its report then says it chose on test data.

A ``[tuning]`` table gives every method entry the same small search (learning rate, training length), chosen on
those validation cells before any test cell runs (:mod:`.tuning`): :meth:`Grid.cells` then lists the candidates'
validation cells, and, once ``choices`` are known, the chosen candidates' other cells.

A grid given by a bare name (``smoke``, ``cpu``, ``paper``) is one of the grids shipped in ``bench/grids``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from partialvfl.bench.tuning import TUNING_KEYS, Tuning, candidate_overrides, choice_key

__all__ = [
    "Cell",
    "validation_cells",
    "check_methods",
    "DatasetSpec",
    "Grid",
    "GridError",
    "MethodSpec",
    "expand",
    "grid_path",
    "load_grid",
    "parse_grid",
    "parse_tuning",
    "shipped_grids",
    "tuned_cells",
    "tuning_candidates",
    "stable_hash",
]

GRIDS_DIR = Path(__file__).with_name("grids")

_GRID_KEYS = {"name", "description", "seeds", "train_mechanisms", "test_mechanisms", "imports", "datasets", "methods",
              "validation", "validation_fraction", "tuning"}
_DATASET_KEYS = {
    "name", "parties", "labels", "aligned", "max_train", "max_test", "splitter", "test_fraction", "active_party",
    "data_dir", "label", "options", "seeds",
}
_METHOD_KEYS = {"name", "preset", "label", "overrides", "dataset_overrides"}


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
        return stable_hash(self.fit_config())

    def row_key(self, test_mechanism: str) -> str:
        """The store's unique key of this cell's result on one test mechanism (its config hash)."""
        return stable_hash({**self.fit_config(), "test_mechanism": test_mechanism})

    def describe(self) -> str:
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
        return sum(len(c.test_mechanisms) for c in self.cells())

    def seeds_of(self, dataset: DatasetSpec) -> tuple[int, ...]:
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


def shipped_grids() -> list[str]:
    """Names of the grids shipped with the package."""
    return sorted(p.stem for p in GRIDS_DIR.glob("*.toml"))


def grid_path(name_or_path: str | Path) -> Path:
    """A grid file: an existing path, or the name of a shipped grid (``smoke``, ``cpu``, ``paper``)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    shipped = GRIDS_DIR / f"{name_or_path}.toml"
    if shipped.exists():
        return shipped
    raise GridError(
        f"grid {str(name_or_path)!r} is neither a file nor a shipped grid; shipped: {', '.join(shipped_grids())}"
    )


def load_grid(name_or_path: str | Path) -> Grid:
    """Read and check a grid file (TOML; YAML if the file ends in .yaml/.yml and PyYAML is installed)."""
    path = grid_path(name_or_path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise GridError(f"{path}: reading YAML grids needs PyYAML (pip install pyyaml), or use TOML") from None
        raw = yaml.safe_load(text)
    else:
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise GridError(f"{path}: not valid TOML: {e}") from None
    return parse_grid(raw, source=str(path), default_name=path.stem)


def _int_list(raw: Any, where: str) -> tuple[int, ...]:
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = [raw]
    if not isinstance(raw, list) or not raw or not all(isinstance(v, int) and not isinstance(v, bool) for v in raw):
        raise GridError(f"{where} must be a non-empty list of integers, got {raw!r}")
    if any(v < 0 for v in raw) or len(set(raw)) != len(raw):
        raise GridError(f"{where} must hold distinct non-negative integers, got {raw!r}")
    return tuple(raw)


def _mechanisms(raw: Any, where: str) -> tuple[str, ...]:
    from partialvfl.data.mechanisms import parse_mechanism

    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise GridError(f"{where} must be a non-empty list of mechanism names, got {raw!r}")
    names = []
    for v in raw:
        try:
            names.append(parse_mechanism(str(v)).name)
        except ValueError as e:
            raise GridError(f"{where}: {e}") from None
    if len(set(names)) != len(names):
        raise GridError(f"{where} lists a mechanism twice: {raw!r}")
    return tuple(names)


def _check_keys(entry: Any, allowed: set[str], where: str) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise GridError(f"{where} must be a table, got {entry!r}")
    unknown = set(entry) - allowed
    if unknown:
        raise GridError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(allowed))}")
    if "name" not in entry and allowed is not _GRID_KEYS:
        raise GridError(f"{where} has no 'name'")
    return entry


def _dataset(entry: Any, where: str) -> DatasetSpec:
    e = dict(_check_keys(entry, _DATASET_KEYS, where))
    if "label" in e and not isinstance(e["label"], str):
        raise GridError(f"{where} ({e['name']}): label must be text, got {e['label']!r}")
    if "seeds" in e:
        e["seeds"] = _int_list(e["seeds"], f"{where} ({e['name']}): seeds")
    try:
        spec = DatasetSpec(**e)
    except TypeError as err:
        raise GridError(f"{where}: {err}") from None
    for f in ("parties", "labels", "aligned"):
        v = getattr(spec, f)
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if f == "parties" else 0):
            raise GridError(f"{where} ({spec.name}): {f} must be a {'positive' if f == 'parties' else 'non-negative'} "
                            f"integer, got {v!r}")
    if not isinstance(spec.options, dict):
        raise GridError(f"{where} ({spec.name}): options must be a table, got {spec.options!r}")
    if spec.aligned > spec.labels:
        raise GridError(f"{where} ({spec.name}): aligned ({spec.aligned}) cannot exceed labels ({spec.labels})")
    return spec


def _method(entry: Any, where: str) -> MethodSpec:
    e = _check_keys(entry, _METHOD_KEYS, where)
    overrides = e.get("overrides", {})
    per_dataset = e.get("dataset_overrides", {})
    if not isinstance(overrides, dict):
        raise GridError(f"{where} ({e['name']}): overrides must be a table, got {overrides!r}")
    if not isinstance(per_dataset, dict) or not all(isinstance(v, dict) for v in per_dataset.values()):
        raise GridError(f"{where} ({e['name']}): dataset_overrides must be a table of tables")
    return MethodSpec(str(e["name"]), str(e.get("preset", "fast")), e.get("label"), dict(overrides),
                      {str(k): dict(v) for k, v in per_dataset.items()})


def parse_tuning(raw: Any, where: str, mechanisms: tuple[str, ...]) -> Tuning:
    """A ``[tuning]`` table checked (``GridError`` naming the key at fault)."""
    if not isinstance(raw, dict):
        raise GridError(f"{where} must be a table, got {raw!r}")
    unknown = set(raw) - TUNING_KEYS
    if unknown:
        raise GridError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; "
                        f"known: {', '.join(sorted(TUNING_KEYS))}")
    lr = raw.get("lr", [1.0])
    if not isinstance(lr, list) or not lr or not all(isinstance(v, int | float) and not isinstance(v, bool)
                                                     and v > 0 for v in lr) or len(set(lr)) != len(lr):
        raise GridError(f"{where}: lr must be a list of distinct positive multipliers, got {lr!r}")
    steps = raw.get("min_steps", [None])
    if not isinstance(steps, list) or not steps or not all(
            v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in steps) \
            or len(set(steps)) != len(steps):
        raise GridError(f"{where}: min_steps must be a list of distinct non-negative integers, got {steps!r}")
    tune_on = None
    if "tune_on" in raw:
        tune_on = _mechanisms(raw["tune_on"], f"{where}: tune_on")
        missing = [m for m in tune_on if m not in mechanisms]
        if missing:
            raise GridError(f"{where}: tune_on names {missing}, which the grid does not train on")
    return Tuning(tuple(float(v) for v in lr), tuple(steps), tune_on)


def parse_grid(raw: dict[str, Any], *, source: str = "<dict>", default_name: str = "grid") -> Grid:
    """Check a grid given as a dict (the parsed file) and build it."""
    raw = _check_keys(raw, _GRID_KEYS, source)
    for key in ("datasets", "methods", "seeds", "train_mechanisms", "test_mechanisms"):
        if key not in raw:
            raise GridError(f"{source}: the grid has no {key!r}")
    if not isinstance(raw["datasets"], list) or not raw["datasets"]:
        raise GridError(f"{source}: 'datasets' must be a non-empty list of [[datasets]] tables")
    if not isinstance(raw["methods"], list) or not raw["methods"]:
        raise GridError(f"{source}: 'methods' must be a non-empty list of [[methods]] tables")
    datasets = tuple(_dataset(d, f"{source}: datasets[{i}]") for i, d in enumerate(raw["datasets"]))
    names = [d.display for d in datasets]
    if len(set(names)) != len(names):
        raise GridError(f"{source}: a dataset is listed twice: {names} (give entries of one source a 'label')")
    validation = raw.get("validation", True)
    if not isinstance(validation, bool):
        raise GridError(f"{source}: validation must be true or false, got {validation!r}")
    fraction = raw.get("validation_fraction", 0.2)
    if not isinstance(fraction, int | float) or isinstance(fraction, bool) or not 0.0 < float(fraction) < 1.0:
        raise GridError(f"{source}: validation_fraction must lie in (0, 1), got {fraction!r}")
    methods = tuple(_method(m, f"{source}: methods[{i}]") for i, m in enumerate(raw["methods"]))
    train_mechanisms = _mechanisms(raw["train_mechanisms"], f"{source}: train_mechanisms")
    tuning = parse_tuning(raw["tuning"], f"{source}: tuning", train_mechanisms) if "tuning" in raw else None
    if tuning is not None and not validation:
        raise GridError(f"{source}: tuning chooses on validation cells; it needs validation = true")
    imports = raw.get("imports", [])
    if not isinstance(imports, list) or not all(isinstance(v, str) for v in imports):
        raise GridError(f"{source}: imports must be a list of module names, got {imports!r}")
    grid = Grid(
        name=str(raw.get("name", default_name)),
        datasets=datasets,
        methods=methods,
        train_mechanisms=train_mechanisms,
        test_mechanisms=_mechanisms(raw["test_mechanisms"], f"{source}: test_mechanisms"),
        seeds=_int_list(raw["seeds"], f"{source}: seeds"),
        imports=tuple(imports),
        description=str(raw.get("description", "")),
        source=source,
        validation=validation,
        validation_fraction=float(fraction),
        tuning=tuning,
    )
    if tuning is None:
        expand(grid)  # duplicate fits fail here, at load time (a tuned grid's candidates resolve methods: later)
    return grid


def check_methods(grid: Grid) -> None:
    """Fail early, naming the entry, when a method or preset or override is unknown (imports ``grid.imports``)."""
    import importlib

    from partialvfl.methods.registry import get_method, get_spec

    for module in grid.imports:
        importlib.import_module(module)
    for m in grid.methods:
        try:
            spec = get_spec(m.name)  # declared methods are checked without importing them (or torch)
            space = spec.params if spec is not None else get_method(m.name).param_space()
        except ValueError as e:
            raise GridError(f"{grid.source}: {e}") from None
        if m.preset not in space.preset_names:
            raise GridError(f"{grid.source}: method {m.name!r}: unknown preset {m.preset!r}; "
                            f"choose one of {', '.join(space.preset_names)}")
        for d in grid.datasets:
            try:
                space.validate(m.overrides_for(d.name, d.label), owner=f"method {m.name!r}")
            except ValueError as e:
                raise GridError(f"{grid.source}: {e}") from None


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
