"""Grid files: reading a TOML (or YAML) grid and checking every entry, with errors that name the file, the entry
and the key at fault.  What a grid means (cells, rows, validation, tuning): :mod:`partialvfl.bench.grid`.

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

A grid given by a bare name (``smoke``, ``cpu``, ``paper``) is one of the grids shipped in ``bench/grids``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from partialvfl.bench.grid import DatasetSpec, Grid, GridError, MethodSpec, expand
from partialvfl.bench.tuning import TUNING_KEYS, Tuning

__all__ = ["check_methods", "grid_path", "load_grid", "parse_grid", "parse_tuning", "shipped_grids"]

GRIDS_DIR = Path(__file__).with_name("grids")

_GRID_KEYS = {"name", "description", "seeds", "train_mechanisms", "test_mechanisms", "imports", "datasets", "methods",
              "validation", "validation_fraction", "tuning"}
_DATASET_KEYS = {
    "name", "parties", "labels", "aligned", "max_train", "max_test", "splitter", "test_fraction", "active_party",
    "data_dir", "label", "options", "seeds",
}
_METHOD_KEYS = {"name", "preset", "label", "overrides", "dataset_overrides"}



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
