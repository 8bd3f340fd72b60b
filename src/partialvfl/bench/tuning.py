"""Equal tuning in the harness: the same small search for every method entry, chosen on validation cells.

A grid's ``[tuning]`` table names the search; every method entry gets the same candidates (the same budget)::

    [tuning]
    lr = [0.3, 1.0, 3.0]          # multipliers of the entry's resolved learning rate (its supervised stage's ``lr``)
    min_steps = [1000, 3000]      # training length: the supervised stage's step floor (schedules.md); 0 = the
                                  # entry's own epochs, pinned
    tune_on = ["mcar2"]           # optional: the training mechanisms whose validation cells fit every candidate

Each candidate is the entry with those overrides (the candidate of multiplier 1 and no ``min_steps`` is the entry
itself).  For every (dataset, entry) and tuned training mechanism, the grid's validation cell (at the dataset's first
seed: the entry fitted on 80 % of the labels, scored on the other 20 %) is fitted once per candidate; the candidate
with the best validation score is chosen, and only it runs the test cells (and the validation cells of the training
mechanisms that do not tune, which choose between variants of a label as before; a grid whose labels each have one
entry has no variant to choose and skips them).  A mechanism that does not tune takes the candidate with the best
mean validation score over the tuned ones.  Nothing is chosen on test data.

:func:`choose` reads the choices from a store's validation rows; the report names the chosen values
(:func:`tuning_markdown`).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from partialvfl.bench.grid import Cell, DatasetSpec, Grid, MethodSpec

__all__ = ["Tuning", "candidate_overrides", "candidates", "choice_key", "choose", "parse_tuning", "tuned_cells",
           "tuning_markdown"]

_KEYS = {"lr", "min_steps", "tune_on"}


@dataclass(frozen=True)
class Tuning:
    """The search every entry gets: learning-rate multipliers x training lengths."""

    lr: tuple[float, ...] = (1.0,)
    min_steps: tuple[int | None, ...] = (None,)
    tune_on: tuple[str, ...] | None = None

    @property
    def size(self) -> int:
        return len(self.lr) * len(self.min_steps)

    def tunes(self, mechanism: str) -> bool:
        return self.tune_on is None or mechanism in self.tune_on

    def to_dict(self) -> dict[str, Any]:
        return {"lr": list(self.lr), "min_steps": list(self.min_steps),
                "tune_on": None if self.tune_on is None else list(self.tune_on)}


def parse_tuning(raw: Any, where: str, mechanisms: Sequence[str]) -> Tuning:
    """A ``[tuning]`` table checked (``GridError`` naming the key at fault)."""
    from partialvfl.bench.grid import GridError, _mechanisms

    if not isinstance(raw, dict):
        raise GridError(f"{where} must be a table, got {raw!r}")
    unknown = set(raw) - _KEYS
    if unknown:
        raise GridError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(_KEYS))}")
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


def candidate_overrides(tuning: Tuning, method: str, preset: str, dataset: str, overrides: Mapping[str, Any]
                        ) -> list[dict[str, Any]]:
    """The overrides of every candidate of an entry (its own ``overrides`` plus the tuned values), in a fixed order;
    the learning rate is the entry's resolved ``lr`` for ``dataset`` times the multiplier (6 significant digits)."""
    from partialvfl.methods.registry import get_method, get_spec

    spec = get_spec(method)
    space = spec.params if spec is not None else get_method(method).param_space()
    base_lr = space.resolve(preset, dataset, overrides, owner=method).get("lr")
    out = []
    for m in tuning.lr:
        for steps in tuning.min_steps:
            cand = dict(overrides)
            if m != 1.0:
                if base_lr is None:
                    raise ValueError(f"method {method!r} has no 'lr' to tune")
                cand["lr"] = float(f"{float(base_lr) * m:.6g}")
            if steps is not None:
                cand["min_steps"] = int(steps)
            out.append(cand)
    return out


def choice_key(dataset: str, entry: int, mechanism: str) -> tuple[str, int, str]:
    """What a choice is made for: (dataset display label, index of the entry in the grid, training mechanism)."""
    return dataset, entry, mechanism


def candidates(grid: Grid) -> dict[tuple[str, int, str], list[Cell]]:
    """A tuned grid's candidate validation cells per (dataset, entry index, tuned training mechanism)."""
    from partialvfl.bench.grid import Cell

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
    from partialvfl.bench.grid import MethodSpec
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
    from partialvfl.bench.grid import Cell

    cands = candidates(grid)
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


def _score(rows: Iterable[dict[str, Any]]) -> float | None:
    vals = [100.0 * float(r["accuracy"]) if r.get("metric", "accuracy") == "accuracy" else -float(r["rmse"])
            for r in rows if r.get("status", "done") == "done"
            and (r.get("accuracy") is not None or r.get("rmse") is not None)]
    return statistics.fmean(vals) if vals else None


def choose(candidates: Mapping[tuple[str, int, str], Sequence[str]], rows_by_cell: Mapping[str, list[dict[str, Any]]],
           tuning: Tuning, mechanisms: Sequence[str]) -> dict[tuple[str, int, str], int]:
    """The chosen candidate (its index) per (dataset, entry, mechanism): ``candidates`` maps a tuned key to the cell
    keys of its candidates' validation fits, ``rows_by_cell`` a cell key to its validation rows.  Ties go to the
    first candidate; a key whose candidates all lack a result is left out (its cells cannot run yet)."""
    scores: dict[tuple[str, int, str], list[float | None]] = {
        key: [_score(rows_by_cell.get(c, [])) for c in cells] for key, cells in candidates.items()}
    out: dict[tuple[str, int, str], int] = {}
    for key, s in scores.items():
        if any(v is not None for v in s):
            out[key] = max(range(len(s)), key=lambda i: (s[i] is not None, s[i] if s[i] is not None else -math.inf,
                                                         -i))
    pairs = {(d, e) for d, e, _ in candidates}
    for d, e in pairs:
        tuned = [scores[(d, e, t)] for t in mechanisms if (d, e, t) in scores]
        if not tuned:
            continue
        mean = [statistics.fmean(v) if all(x is not None for x in v) else None
                for v in zip(*tuned)]
        if all(v is None for v in mean):
            continue
        best = max(range(len(mean)), key=lambda i: (mean[i] is not None, mean[i] or -math.inf, -i))
        for t in mechanisms:
            if not tuning.tunes(t):
                out[(d, e, t)] = best
    return out


def tuning_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The report's tuning section: per (dataset, training mechanism, label, entry) every candidate's tuned values and
    validation score, the chosen one in bold (rows carry ``tuning``: the entry, its candidate values, chosen or not)."""
    from partialvfl.bench.naming import dataset_key, mech_key
    from partialvfl.bench.tables import md_table

    seen: dict[tuple[str, str, str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        t = r.get("tuning")
        if not t or r.get("role") != "validation" or r.get("accuracy") is None:
            continue
        key = (r["dataset"], r["train_mechanism"], r.get("label") or r["method"], str(t["entry"]))
        seen[key][r["cell_hash"]] = {"values": t["values"], "score": 100.0 * float(r["accuracy"])}
    if not seen:
        return ""
    chosen = {(r["dataset"], r["train_mechanism"], str((r.get("tuning") or {}).get("entry"))):
              (r.get("tuning") or {}).get("values") for r in rows if r.get("role") == "test" and r.get("tuning")}
    body = []
    for key in sorted(seen, key=lambda k: (dataset_key(k[0]), mech_key(k[1]), k[2], k[3])):
        dataset, train, label, entry = key
        pick = chosen.get((dataset, train, entry))
        cands = sorted(seen[key].values(), key=lambda c: (c["values"].get("lr") or 0, c["values"].get("min_steps")
                                                          or 0))
        text = []
        for c in cands:
            item = f"{_values_text(c['values'])}: {c['score']:.1f}"
            text.append(f"**{item}**" if pick is not None and c["values"] == pick else item)
        body.append([dataset, train, label, "; ".join(text)])
    return ("Every entry was tuned with the same search; each candidate's validation accuracy (%, the validation "
            "cell: 80 % of the labels for fitting, 20 % scored), the one chosen for the test fits in bold:\n\n"
            + md_table(["Dataset", "Train", "Method", "candidates (lr, min_steps): validation accuracy"], body))


def _values_text(values: Mapping[str, Any]) -> str:
    lr = values.get("lr")
    steps = values.get("min_steps")
    return f"lr {lr:.3g}, " + ("min_steps " + str(steps) if steps is not None else "min_steps as entry")
