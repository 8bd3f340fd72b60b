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

The cells are built by :func:`partialvfl.bench.grid.tuned_cells`; :func:`choose` reads the choices from a store's
validation rows; the report names the chosen values
(:func:`partialvfl.bench.tables.tuning_markdown`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["TUNING_KEYS", "Tuning", "candidate_overrides", "choice_key", "choose"]

#: the keys of a grid's ``[tuning]`` table (parsed by :mod:`partialvfl.bench.grid_file`)
TUNING_KEYS = {"lr", "min_steps", "tune_on"}


@dataclass(frozen=True)
class Tuning:
    """The search every entry gets: learning-rate multipliers x training lengths."""

    lr: tuple[float, ...] = (1.0,)
    min_steps: tuple[int | None, ...] = (None,)
    tune_on: tuple[str, ...] | None = None

    @property
    def size(self) -> int:
        """How many candidate settings the search tries."""
        return len(self.lr) * len(self.min_steps)

    @property
    def values(self) -> list[tuple[float, int | None]]:
        """Every candidate's (learning-rate multiplier, ``min_steps``), in the candidates' order."""
        return [(m, steps) for m in self.lr for steps in self.min_steps]

    @property
    def own_index(self) -> int | None:
        """The index of the candidate that is the entry itself (multiplier 1, no ``min_steps``), if searched."""
        return self.values.index((1.0, None)) if (1.0, None) in self.values else None

    def tunes(self, mechanism: str) -> bool:
        """Whether the search runs under training mechanism ``mechanism``."""
        return self.tune_on is None or mechanism in self.tune_on

    def to_dict(self) -> dict[str, Any]:
        """The search as plain values (what a grid file and the store record)."""
        return {"lr": list(self.lr), "min_steps": list(self.min_steps),
                "tune_on": None if self.tune_on is None else list(self.tune_on)}


def candidate_overrides(tuning: Tuning, method: str, preset: str, dataset: str, overrides: Mapping[str, Any]
                        ) -> list[dict[str, Any]]:
    """The overrides of every candidate of an entry (its own ``overrides`` plus the tuned values), in a fixed order;
    the learning rate is the entry's resolved ``lr`` for ``dataset`` times the multiplier (6 significant digits)."""
    from partialvfl.methods.registry import get_method, get_spec

    spec = get_spec(method)
    space = spec.params if spec is not None else get_method(method).param_space()
    base_lr = space.resolve(preset, dataset, overrides, owner=method).get("lr")
    out = []
    for m, steps in tuning.values:
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


def _score(rows: Iterable[dict[str, Any]]) -> float | None:
    vals = [100.0 * float(r["accuracy"]) if r.get("metric", "accuracy") == "accuracy" else -float(r["rmse"])
            for r in rows if r.get("status", "done") == "done"
            and (r.get("accuracy") is not None or r.get("rmse") is not None)]
    return statistics.fmean(vals) if vals else None


def choose(candidates: Mapping[tuple[str, int, str], Sequence[str]], rows_by_cell: Mapping[str, list[dict[str, Any]]],
           tuning: Tuning, mechanisms: Sequence[str]) -> dict[tuple[str, int, str], int]:
    """The chosen candidate (its index) per (dataset, entry, mechanism): ``candidates`` maps a tuned key to the cell
    keys of its candidates' validation fits, ``rows_by_cell`` a cell key to its validation rows.  Ties go to the
    entry's own settings (:attr:`Tuning.own_index`: a change needs a better score, and a small validation split
    ties often: 20 rows score in steps of 5 points), else to the first tied candidate; a key whose candidates all
    lack a result is left out (its cells cannot run yet)."""
    own = tuning.own_index

    def rank(s: Sequence[float | None], i: int) -> tuple[bool, float, bool, int]:
        return s[i] is not None, s[i] if s[i] is not None else -math.inf, i == own, -i

    scores: dict[tuple[str, int, str], list[float | None]] = {
        key: [_score(rows_by_cell.get(c, [])) for c in cells] for key, cells in candidates.items()}
    out: dict[tuple[str, int, str], int] = {}
    for key, s in scores.items():
        if any(v is not None for v in s):
            out[key] = max(range(len(s)), key=lambda i: rank(s, i))
    pairs = {(d, e) for d, e, _ in candidates}
    for d, e in pairs:
        tuned = [scores[(d, e, t)] for t in mechanisms if (d, e, t) in scores]
        if not tuned:
            continue
        mean = [statistics.fmean(v) if all(x is not None for x in v) else None
                for v in zip(*tuned)]
        if all(v is None for v in mean):
            continue
        best = max(range(len(mean)), key=lambda i: rank(mean, i))
        for t in mechanisms:
            if not tuning.tunes(t):
                out[(d, e, t)] = best
    return out

