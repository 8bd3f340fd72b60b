"""Coordinator-side checkpoints every N steps, so that training resumes after any process crashed.

A :class:`Checkpointer` is driven by a method's training loop (in process or over gRPC alike).  At a checkpoint it

1. has every party save its program state (``Federation.save``: over gRPC each party writes to its *own* state
   directory; nothing crosses but the directory's relative name),
2. writes the coordinator's state (whatever the method hands it: modules, optimisers, RNG states, loop counters),
3. and only then moves the ``LATEST`` marker (atomic rename).

A crash at any point leaves ``LATEST`` on the previous complete checkpoint.  Only the last ``keep`` checkpoints are
kept: older ones are deleted at the coordinator and, through a ``forget`` message, at every reachable party.
:meth:`Checkpointer.restore` loads the parties' states and returns the coordinator's, so the loop continues from
exactly that step: steps done after the checkpoint are redone once from the same state (party states are rolled
back too), never applied twice.

Every method's training goes through :class:`~partialvfl.methods.training.TrainingLoop`, which takes the
checkpointer as an argument (``method.fit(data, checkpointer=Checkpointer(dir, every=N))``, or
``fit --checkpoint-every N`` / ``--resume`` on the command line): it calls :meth:`Checkpointer.restore` once the
parties' programs are set up, and :meth:`Checkpointer.maybe_save` after every step.

Party programs must return their optimiser state (and any generator) from ``state_dict`` for an exact resume.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from partialvfl.federation.coordinator import Federation
from partialvfl.federation.transport import PartyUnavailable

__all__ = ["Checkpoint", "Checkpointer", "rng_state", "set_rng_state"]

LATEST = "LATEST"
log = logging.getLogger("partialvfl.checkpoint")


@dataclass(frozen=True)
class Checkpoint:
    """A restored checkpoint: the step it was taken after, and the coordinator's state."""

    step: int
    state: dict[str, Any]
    directory: Path


def rng_state(gen: torch.Generator | np.random.Generator) -> Any:
    """A generator's state in a form ``torch.save`` stores and ``torch.load(weights_only=True)`` reads back."""
    if isinstance(gen, torch.Generator):
        return gen.get_state()
    if isinstance(gen, np.random.Generator):
        return gen.bit_generator.state
    raise TypeError(f"not a torch or numpy generator: {type(gen).__name__}")


def set_rng_state(gen: torch.Generator | np.random.Generator, state: Any) -> None:
    if isinstance(gen, torch.Generator):
        gen.set_state(state)
    elif isinstance(gen, np.random.Generator):
        gen.bit_generator.state = state
    else:
        raise TypeError(f"not a torch or numpy generator: {type(gen).__name__}")


class Checkpointer:
    """Checkpoints of a training run in ``directory`` (coordinator side), every ``every`` steps.

    ``federation`` is the one whose parties save their halves; a fit binds it (:meth:`bind`) when none was given.
    """

    def __init__(self, directory: str | Path, federation: Federation | None = None, every: int = 100, *,
                 keep: int = 2) -> None:
        if every < 1:
            raise ValueError(f"checkpoint interval must be at least 1 step, got {every}")
        if keep < 1:
            raise ValueError(f"keep at least 1 checkpoint, got {keep}")
        self.directory = Path(directory)
        self.federation = federation
        self.every = int(every)
        self.keep = int(keep)
        self.saved_steps: list[int] = []
        self.skipped_steps: list[int] = []
        self.restore_called = False  # whether the training loop asked for a resume (methods that support it do)
        self.restored_step: int | None = None  # the step of the checkpoint restore() loaded, if any

    def bind(self, federation: Federation) -> None:
        """Use ``federation``'s parties (a fit calls this); refuses a checkpointer bound to another federation."""
        if self.federation is not None and self.federation is not federation:
            raise ValueError("this checkpointer belongs to another federation: make one per fit")
        self.federation = federation

    @property
    def _fed(self) -> Federation:
        if self.federation is None:
            raise RuntimeError("the checkpointer is not bound to a federation (pass it to fit, or bind it)")
        return self.federation

    def _step_dir(self, step: int) -> Path:
        return self.directory / f"step-{step:09d}"

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Checkpoint now, after ``step`` steps, with the coordinator's ``state``."""
        d = self._step_dir(step)
        d.mkdir(parents=True, exist_ok=True)
        self._fed.save(d)
        tmp = d / "coordinator.pt.tmp"
        torch.save({"step": int(step), "state": state}, tmp)
        os.replace(tmp, d / "coordinator.pt")
        marker = self.directory / (LATEST + ".tmp")
        marker.write_text(json.dumps({"step": int(step), "dir": d.name}))
        os.replace(marker, self.directory / LATEST)
        self.saved_steps.append(int(step))
        self._prune(keep_dir=d.name)
        return d

    def maybe_save(self, step: int, state: Callable[[], dict[str, Any]] | dict[str, Any]) -> bool:
        """Checkpoint if ``step`` is a multiple of the interval; ``state`` may be a callable (built only then).

        A party that is unavailable at that moment makes the checkpoint be skipped (logged), not the run fail.
        """
        if step <= 0 or step % self.every:
            return False
        try:
            self.save(step, state() if callable(state) else state)
        except PartyUnavailable as e:  # a checkpoint needs every party: skip this one, keep training
            log.warning("checkpoint at step %d skipped: %s", step, e)
            self.skipped_steps.append(int(step))
            return False
        return True

    def _prune(self, keep_dir: str) -> None:
        dirs = sorted(p for p in self.directory.glob("step-*") if p.is_dir())
        for p in dirs[: max(0, len(dirs) - self.keep)]:
            if p.name != keep_dir:
                try:  # the parties delete their halves first (over gRPC they live on the parties' disks)
                    self._fed.forget(p)
                except Exception as e:  # noqa: BLE001 - a party that cannot delete keeps a stale file, no more
                    log.warning("parties could not delete their state of %s: %s", p, e)
                shutil.rmtree(p, ignore_errors=True)

    def latest(self) -> Checkpoint | None:
        """The last complete checkpoint (coordinator side only), or ``None``."""
        marker = self.directory / LATEST
        if not marker.exists():
            return None
        info = json.loads(marker.read_text())
        d = self.directory / info["dir"]
        saved = torch.load(d / "coordinator.pt", weights_only=True)
        return Checkpoint(int(saved["step"]), saved["state"], d)

    def restore(self) -> Checkpoint | None:
        """Load the last complete checkpoint into the parties and return it (``None``: start from scratch).

        Call it after the parties' programs were set up (``Federation.setup``) and the data attached.
        """
        self.restore_called = True
        ckpt = self.latest()
        if ckpt is not None:
            self._fed.load(ckpt.directory)
            self.restored_step = ckpt.step
        return ckpt
