"""Schedules that follow the data: a minimum number of optimiser steps, and early stopping on held-out labels.

Every built-in method has one *supervised stage* (the stage that learns from labels: split learning, FALSE-VFL's
stage 2, X-VFL's training, FedHSSL's fine-tuning) and declares the parameters of :data:`SCHEDULE_PARAMS`:

* ``min_steps``: the supervised stage runs at least this many optimiser steps: ``epochs`` is raised to
  ``ceil(min_steps / steps per epoch)`` when it gives fewer.  With 100 labels and batch 128 one epoch is one step,
  so 100 epochs are 100 steps; ``min_steps = 1000`` makes them 1,000.  ``null`` (the default) resolves when the
  parameters are resolved, to ``ceil(MIN_DISTANCE / lr)`` (:func:`floor_steps`), or to 0 when the caller gave
  ``epochs`` explicitly (an explicit epoch count pins the schedule: exactly that many epochs, as before this rule
  existed; give ``min_steps`` too to keep a floor).  Adam moves each weight by about ``lr`` per step at most, so
  ``lr x steps`` is how far training can take a weight from its initialisation; the floor asks every method for the
  same distance, :data:`MIN_DISTANCE` = 0.2.  At FALSE-VFL's stage-2 rate of 2e-4 that is 1,000 steps (its 100
  steps at 100 labels travel 0.02: issue 28 measured +12 to +15 points from the floor, 3 seeds); at the split-network
  baselines' 3e-3 it is 67 steps, which their epochs give at every label count but the smallest (more steps did not
  help them: docs/results.md).
* ``early_stopping`` (``auto`` | ``on`` | ``off``): a seeded ``stopping_fraction`` of the labelled rows (those with
  at least one observed party) is held out of training (the rows stay, unlabelled) and scored while the supervised
  stage runs; after ``patience`` checks without improvement the stage stops, and the best checked state (the
  coordinator's modules and, where the stage trains them, every party's own state) is restored.  ``auto`` is on
  when the schedule follows the data (``min_steps > 0``) and the split holds at least :data:`MIN_VALIDATION_ROWS`
  rows, i.e. from 2,000 labelled rows at the default fraction 0.2: at 100 and 1,000 labels the held-out fifth cost
  FALSE-VFL-I, LASER-VFL and X-VFL 0.3-3.4 points in every cell of issue 28's table (3 seeds; Vanilla VFL -1.9 to
  +1.5, within its seed noise), more than stopping at the best check gained.
* Checks come at the end of an epoch, every ``ceil(epochs / CHECKS_PER_STAGE)`` epochs and after the last one, so a
  stage has at most about :data:`CHECKS_PER_STAGE` checks whatever its length.  The score is the validation
  accuracy, ties broken by the lower log-loss (regression: the lower RMSE); a check improves only on a strictly
  better score.

Early stopping runs inside the one training loop (:class:`~partialvfl.methods.training.TrainingLoop`): its state
(best score, the best coordinator state, the counters) is part of every checkpoint and the parties keep their best
state on their own disks (``save``/``load`` of a directory beside the checkpoints), so a resumed fit stops where an
uninterrupted one does and ends in the same parameters.

:func:`schedule_rows` says what a method's defaults do at a given number of labels (``scripts/schedule_table.py``
writes the table of ``docs/schedules.md`` from it).  Torch-free.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from partialvfl.methods.params import Param

if TYPE_CHECKING:
    from partialvfl.data.dataset import CoordinatorView
    from partialvfl.federation.runtime.coordinator import Federation

__all__ = ["CHECKS_PER_STAGE", "EarlyStopping", "MIN_DISTANCE", "MIN_VALIDATION_ROWS", "SCHEDULE_PARAMS",
           "SchedulePlan", "check_interval", "floor_steps", "plan_schedule", "resolve_min_steps", "schedule_rows",
           "supervised_epochs", "validation_score"]

#: The learning distance ``lr x steps`` every supervised stage whose length follows the data gets at least.
MIN_DISTANCE = 0.2
#: ``early_stopping = auto`` holds out labels only when the split gives at least this many validation rows.
MIN_VALIDATION_ROWS = 400
#: At most about this many validation checks per supervised stage.
CHECKS_PER_STAGE = 50
EARLY_STOPPING = ("auto", "on", "off")

SCHEDULE_PARAMS = (
    Param("min_steps", None, "int", "the supervised stage runs at least this many optimiser steps (its epochs are "
          f"raised to reach them); null: ceil({MIN_DISTANCE} / lr) (1,000 at lr 2e-4, 67 at 3e-3), or 0 when "
          "epochs is given explicitly (exactly that many epochs)", low=0, optional=True),
    Param("early_stopping", "auto", "str", "hold out stopping_fraction of the labelled rows, check them during the "
          "supervised stage, stop after patience checks without improvement and restore the best state; auto: on "
          f"when min_steps > 0 and the split holds >= {MIN_VALIDATION_ROWS} rows", choices=EARLY_STOPPING),
    Param("stopping_fraction", 0.2, "float", "share of the labelled rows held out for early stopping", low=0.01,
          high=0.9),
    Param("patience", 10, "int", "early stopping: validation checks without improvement before the stage stops",
          low=1),
)


#: the largest default step floor: a learning rate so small that ``MIN_DISTANCE / lr`` exceeds it (below about
#: 2e-10) would never train in any number of steps; the floor stays a finite count instead of overflowing
MAX_FLOOR_STEPS = 10**9


def floor_steps(lr: float | None) -> int:
    """The default step floor of a stage with learning rate ``lr``: ``ceil(MIN_DISTANCE / lr)`` (0 without one),
    at most :data:`MAX_FLOOR_STEPS`."""
    if lr is None or not lr > 0:
        return 0
    steps = MIN_DISTANCE / float(lr)
    return MAX_FLOOR_STEPS if not steps < MAX_FLOOR_STEPS else math.ceil(round(steps, 9))


def resolve_min_steps(params: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with ``min_steps`` resolved: an explicit value stays; ``null`` becomes 0 when the caller gave
    ``epochs`` (the supervised stage's epochs) explicitly, else :func:`floor_steps` of the stage's ``lr``."""
    out = dict(params)
    if "min_steps" in out and out["min_steps"] is None:
        out["min_steps"] = 0 if "epochs" in overrides else floor_steps(out.get("lr"))
    return out


def supervised_epochs(epochs: int, steps_per_epoch: int, min_steps: int) -> int:
    """The epochs a supervised stage runs: ``epochs``, raised so that they hold at least ``min_steps`` steps."""
    if steps_per_epoch <= 0 or min_steps <= 0:
        return int(epochs)
    return max(int(epochs), math.ceil(min_steps / steps_per_epoch))


def check_interval(epochs: int) -> int:
    """Epochs between two validation checks: at most about :data:`CHECKS_PER_STAGE` checks per stage."""
    return max(1, math.ceil(epochs / CHECKS_PER_STAGE))


def validation_score(probs: np.ndarray, y: np.ndarray, classification: bool) -> tuple[float, float]:
    """``(accuracy, -log-loss)`` of class probabilities (regression: ``(-RMSE, 0)``): higher is better, compared as
    a tuple (accuracy first, the log-loss breaks ties)."""
    if not classification:
        return -float(np.sqrt(np.mean((np.asarray(probs, dtype=np.float64) - y) ** 2))), 0.0
    p = np.asarray(probs, dtype=np.float64)
    y = np.asarray(y, dtype=np.int64)
    acc = float((p.argmax(axis=1) == y).mean())
    nll = float(-np.log(np.clip(p[np.arange(len(y)), y], 1e-12, None)).mean())
    return acc, -nll


@dataclass
class SchedulePlan:
    """What a fit decided about its schedule (kept in ``model.schedule_`` and ``model.json``)."""

    min_steps: int
    early_stopping: bool
    requested: str = "auto"
    validation_rows: int = 0
    stopping_fraction: float = 0.2
    patience: int = 10
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: what early stopping did: checks, best epoch, the epoch it stopped at (``None``: ran to the end)
    result: dict[str, Any] | None = None
    #: the held-out rows (positions in the training order); not part of :meth:`to_dict`
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False)

    def stage(self, name: str, epochs: int, steps_per_epoch: int) -> int:
        """Record a supervised stage and return the epochs it runs (``epochs`` raised to ``min_steps``)."""
        run = supervised_epochs(epochs, steps_per_epoch, self.min_steps)
        self.stages[name] = {"epochs": int(epochs), "steps_per_epoch": int(steps_per_epoch), "max_epochs": run,
                             "max_steps": run * int(steps_per_epoch), "check_every": check_interval(run)
                             if self.early_stopping else None}
        return run

    def to_dict(self) -> dict[str, Any]:
        """The plan and its outcome as plain values (what ``model.schedule_`` holds)."""
        return {"min_steps": self.min_steps, "early_stopping": self.early_stopping, "requested": self.requested,
                "validation_rows": self.validation_rows, "stopping_fraction": self.stopping_fraction,
                "patience": self.patience, "stages": {k: dict(v) for k, v in self.stages.items()},
                "result": None if self.result is None else dict(self.result)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SchedulePlan:
        """A plan as ``model.json`` keeps it (without the held-out rows)."""
        return cls(int(d["min_steps"]), bool(d["early_stopping"]), str(d.get("requested", "auto")),
                   int(d.get("validation_rows", 0)), float(d.get("stopping_fraction", 0.2)), int(d.get("patience", 10)),
                   {k: dict(v) for k, v in d.get("stages", {}).items()}, d.get("result"))


def plan_schedule(settings: Any, view: CoordinatorView, seed: int) -> SchedulePlan:
    """The schedule of a fit: ``min_steps`` as resolved, early stopping on or off (``auto``: see the module), and
    the seeded validation rows when it is on."""
    min_steps = int(settings.min_steps or 0)
    usable = np.flatnonzero(view.labeled & view.observed.any(axis=1))
    fraction = float(settings.stopping_fraction)
    n_val = int(round(fraction * len(usable)))
    mode = settings.early_stopping
    on = mode == "on" or (mode == "auto" and min_steps > 0 and n_val >= MIN_VALIDATION_ROWS)
    if on and not 1 <= n_val < len(usable):
        raise ValueError(f"early stopping holds out {fraction} of {len(usable)} labelled rows: that leaves no "
                         "validation or no training label; set early_stopping=off or another stopping_fraction")
    from partialvfl.utils.seeding import numpy_rng  # torch: not at import (the specs import this module)

    rows = np.sort(numpy_rng(seed, "early-stopping").choice(usable, size=n_val, replace=False)) if on else \
        np.zeros(0, dtype=np.int64)
    return SchedulePlan(min_steps, on, mode, len(rows), fraction, int(settings.patience), rows=rows)


class EarlyStopping:
    """The training loop's early stopping of one supervised stage (see the module docstring).

    ``validate()`` scores the current model on the held-out rows (a tuple, higher is better); ``federation`` and
    ``directory`` keep the parties' best state (each party on its own disk; ``None``: a temporary directory, removed
    at the end); the coordinator's best state is held here (and in checkpoints).
    """

    def __init__(self, validate: Callable[[], tuple[float, float]], patience: int, federation: Federation,
                 directory: str | Path | None = None) -> None:
        self.validate = validate
        self.patience = int(patience)
        self.federation = federation
        self._own_dir = directory is None
        self.directory = Path(directory) if directory is not None else None
        self.every = 1
        self.parties = True
        self.reset()

    def reset(self) -> None:
        """Forget the best state and the epochs since it (a new stage starts)."""
        self.best: tuple[float, ...] | None = None
        self.best_epoch = 0
        self.best_state: dict[str, Any] | None = None
        self.since = 0
        self.checks = 0
        self.stopped_epoch: int | None = None

    # ------------------------------------------------------------------ the stage
    def begin(self, epochs: int, parties_train: bool) -> None:
        """A supervised stage of ``epochs`` epochs starts (or resumes: the tracker state comes from the checkpoint)."""
        self.every = check_interval(epochs)
        self.epochs = int(epochs)
        self.parties = bool(parties_train)
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="partialvfl-best-"))

    def due(self, epoch: int) -> bool:
        """Whether the end of ``epoch`` (0-based) is a check."""
        return (epoch + 1) % self.every == 0 or epoch + 1 == self.epochs

    def check(self, epoch: int, save_coordinator: Callable[[], dict[str, Any]]) -> dict[str, float]:
        """Score the model after ``epoch``; keep its state if it is the best so far.  Returns the metrics to report."""
        score = tuple(float(v) for v in self.validate())
        self.checks += 1
        if self.best is None or score > self.best:
            self.best, self.best_epoch, self.since = score, epoch + 1, 0
            self.best_state = save_coordinator()
            if self.parties:
                assert self.directory is not None
                self.federation.save(self.directory)
        else:
            self.since += 1
            if self.since >= self.patience:
                self.stopped_epoch = epoch + 1
        return {"val_score": score[0], "val_loss": -score[1]}

    @property
    def stopped(self) -> bool:
        """Whether the patience ran out."""
        return self.stopped_epoch is not None

    def finish(self, load_coordinator: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Restore the best checked state; returns what happened (for ``model.schedule_``)."""
        if self.best_state is not None:
            load_coordinator(self.best_state)
            if self.parties:
                assert self.directory is not None
                self.federation.load(self.directory)
        out = {"checks": self.checks, "best_epoch": self.best_epoch, "stopped_epoch": self.stopped_epoch,
               "best_validation": None if self.best is None else self.best[0], "check_every": self.every}
        self.close()
        return out

    def close(self) -> None:
        """Remove a temporary directory of best states (at the parties too, those that answer); the one beside a
        checkpoint stays (a resume needs it)."""
        if self._own_dir and self.directory is not None:
            directory, self.directory = self.directory, None
            if self.parties and self.best_state is not None:
                with contextlib.suppress(Exception):  # a party lost mid-fit keeps its file: the fit fails anyway
                    self.federation.forget(directory)
            shutil.rmtree(directory, ignore_errors=True)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The state to save: what :meth:`load_state_dict` restores."""
        return {"best": None if self.best is None else list(self.best), "best_epoch": self.best_epoch,
                "best_state": self.best_state, "since": self.since, "checks": self.checks,
                "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.best = None if state["best"] is None else tuple(float(v) for v in state["best"])
        self.best_epoch = int(state["best_epoch"])
        self.best_state = state["best_state"]
        self.since = int(state["since"])
        self.checks = int(state["checks"])
        self.stopped_epoch = None if state["stopped_epoch"] is None else int(state["stopped_epoch"])


# ---------------------------------------------------------------------- what the defaults do
def schedule_rows(method: str, preset: str, n_labels: int, aligned_share: float = 0.2,
                  overrides: Mapping[str, Any] | None = None, dataset: str | None = None) -> dict[str, Any]:
    """What ``method``'s parameters (``preset``, ``overrides``) do with ``n_labels`` labels of which
    ``aligned_share`` are observed by every party (the benchmarks' protocol): the supervised stage's rows, steps per
    epoch (mixed batches; LASER-VFL's pattern batching makes more, smaller batches, so it reaches ``min_steps`` in
    fewer epochs), epochs, the step budget, early stopping and its validation rows."""
    from partialvfl.methods.registry import get_spec

    spec = get_spec(method)
    if spec is None:
        raise ValueError(f"{method!r} is not a declared method")
    space = spec.params
    given = dict(overrides or {})
    p = resolve_min_steps(space.resolve(preset, dataset, given, owner=method), space.validate(given))
    min_steps = int(p["min_steps"] or 0)
    n_val = int(round(p["stopping_fraction"] * n_labels))
    es = p["early_stopping"] == "on" or (p["early_stopping"] == "auto" and min_steps > 0
                                        and n_val >= MIN_VALIDATION_ROWS)
    train = n_labels - (n_val if es else 0)
    aligned_only = spec.aligned_only
    rows = int(round(train * aligned_share)) if aligned_only else train
    bs = p.get("batch_size") or spec.unset_batch_size
    spe = max(1, math.ceil(rows / int(bs))) if rows else 0
    run = supervised_epochs(int(p["epochs"]), spe, min_steps)
    return {"method": method, "labels": n_labels, "rows": rows, "rows_are": "aligned" if aligned_only else "labelled",
            "batch_size": int(bs), "steps_per_epoch": spe, "epochs": int(p["epochs"]), "min_steps": min_steps,
            "max_epochs": run, "max_steps": run * spe, "early_stopping": es, "validation_rows": n_val if es else 0,
            "check_every": check_interval(run) if es else None, "patience": int(p["patience"])}
