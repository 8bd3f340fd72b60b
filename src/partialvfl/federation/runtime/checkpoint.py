"""Coordinator-side checkpoints every N steps, so that training resumes after any process crashed.

A :class:`Checkpointer` is driven by a method's training loop (in process or over gRPC alike).  At a checkpoint it

1. has every party save its program state (``Federation.save``: over gRPC each party writes to its *own* state
   directory; nothing crosses but the directory's relative name),
2. writes the coordinator's state (whatever the method hands it: modules, optimisers, RNG states, loop counters),
3. and only then moves the ``LATEST`` marker (atomic rename).

A crash at any point leaves ``LATEST`` on the previous complete checkpoint; a checkpoint a party could not save is
removed (at the coordinator and at the parties that saved their half) and the fit stops (:class:`PartyLost`).  Only
the last ``keep`` checkpoints are kept: older ones are deleted at the coordinator and, through a ``forget`` message,
at every party; where a party could not be reached, the checkpoint's record stays at the coordinator and the party
is asked again at the next prune (after the next checkpoint, or once it rejoined and the fit resumed).
:meth:`Checkpointer.restore` loads the parties' states and returns the coordinator's, so the loop continues from
exactly that step: steps done after the checkpoint are redone once from the same state (party states are rolled
back too), never applied twice.

A party that fails during a training step ends the step with :class:`PartyLost` (the training loop raises it), and
a stop requested by a signal (:meth:`Checkpointer.request_stop`) makes the loop checkpoint at the next step
boundary and raise :class:`FitInterrupted`: the caller says how to resume.

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

from partialvfl.federation.runtime.coordinator import Federation
from partialvfl.federation.wire.transport import PartyUnavailable

__all__ = ["Checkpoint", "CheckpointError", "Checkpointer", "FitInterrupted", "PartyLost", "rng_state",
           "set_rng_state"]

LATEST = "LATEST"
log = logging.getLogger("partialvfl.checkpoint")


class PartyLost(PartyUnavailable):
    """A party did not answer during a training step (or while a checkpoint was taken): the fit stops there."""

    def __init__(self, party: int, reason: str, step: int) -> None:
        super().__init__(party, f"{reason} (training step {step})")
        self.step = step


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read (corrupted, truncated, foreign): the message names the file."""


class FitInterrupted(Exception):
    """A fit stopped on request (SIGINT/SIGTERM) after checkpointing at ``step``."""

    def __init__(self, step: int, directory: Path, signum: int | None) -> None:
        super().__init__(f"fit interrupted after step {step}; checkpoint in {directory}")
        self.step = step
        self.directory = directory
        self.signum = signum


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
    """Restore a torch or NumPy generator's state saved in a checkpoint."""
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
        self.restore_called = False  # whether the training loop asked for a resume (methods that support it do)
        self.restored_step: int | None = None  # the step of the checkpoint restore() loaded, if any
        self.stop_signal: int | None = None  # set by request_stop (a signal handler): checkpoint and stop
        self.stop_requested = False

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

    def request_stop(self, signum: int | None = None) -> None:
        """Ask the training loop to checkpoint at the next step boundary and stop (safe in a signal handler)."""
        self.stop_signal = signum
        self.stop_requested = True

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Checkpoint now, after ``step`` steps, with the coordinator's ``state``.

        A party that cannot save raises :class:`PartyLost`; the incomplete checkpoint is removed first.
        """
        d = self._step_dir(step)
        d.mkdir(parents=True, exist_ok=True)
        try:
            self._fed.save(d)
        except PartyUnavailable as e:
            log.warning("checkpoint after step %d failed: %s", step, e)
            self._discard(d)
            raise PartyLost(e.party, e.reason, step) from None
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

        A party that cannot save its half stops the fit (:class:`PartyLost`): the last complete checkpoint stays.
        """
        if step <= 0 or step % self.every:
            return False
        self.save(step, state() if callable(state) else state)
        return True

    def after_step(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """What the training loop calls after every step: a checkpoint every N steps and, when a stop was
        requested, a checkpoint now and :class:`FitInterrupted`."""
        saved = self.maybe_save(step, state)
        if self.stop_requested:
            if not saved:
                self.save(step, state())
            raise FitInterrupted(step, self.directory, self.stop_signal)

    def _discard(self, d: Path) -> None:
        """Remove a checkpoint: at the parties first (reachable ones), then here if every party confirmed."""
        try:
            done = self._fed.forget(d)
        except Exception as e:  # a party that cannot delete keeps its file until the next prune
            log.warning("parties could not delete their state of %s: %s", d, e)
            done = False
        if not done:  # keep the record (party_states.json) so a later prune asks again
            (d / "coordinator.pt").unlink(missing_ok=True)
        else:
            shutil.rmtree(d, ignore_errors=True)

    def _prune(self, keep_dir: str) -> None:
        """Keep the last ``keep`` complete checkpoints; delete older ones, incomplete ones and those a party had
        not deleted yet (everywhere)."""
        dirs = sorted(p for p in self.directory.glob("step-*") if p.is_dir())
        complete = [p for p in dirs if (p / "coordinator.pt").exists()]
        keep = {p.name for p in complete[-self.keep:]} | {keep_dir}
        for p in dirs:
            if p.name not in keep:
                self._discard(p)

    def prune(self) -> None:
        """Delete everything but the last ``keep`` complete checkpoints, here and at the parties."""
        latest = self.latest()
        if latest is not None:
            self._prune(keep_dir=latest.directory.name)

    def latest(self) -> Checkpoint | None:
        """The last complete checkpoint (coordinator side only), or ``None``.

        A ``LATEST`` marker or a ``coordinator.pt`` that is corrupted, truncated or foreign raises
        :class:`CheckpointError` naming the file.
        """
        marker = self.directory / LATEST
        if not marker.exists():
            return None
        try:
            info = json.loads(marker.read_text())
            d = self.directory / str(info["dir"])
            int(info["step"])
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{marker} is not a readable checkpoint marker ({type(e).__name__}); remove "
                                  "the checkpoint directory to start again") from None
        path = d / "coordinator.pt"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the checkpoint {marker} points to is incomplete")
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            step, state = int(saved["step"]), saved["state"]
        except Exception as e:  # any unreadable file gets the same plain message
            raise CheckpointError(f"{path} is not a readable partialvfl checkpoint (corrupted, truncated or "
                                  f"foreign: {type(e).__name__})") from None
        if not isinstance(state, dict) or step != int(info["step"]):
            raise CheckpointError(f"{path} does not hold the checkpoint of step {info['step']} that {marker} names")
        return Checkpoint(step, state, d)

    def restore(self) -> Checkpoint | None:
        """Load the last complete checkpoint into the parties and return it (``None``: start from scratch).

        Call it after the parties' programs were set up (``Federation.setup``) and the data attached.
        """
        self.restore_called = True
        ckpt = self.latest()
        if ckpt is not None:
            self._fed.load(ckpt.directory)
            self.restored_step = ckpt.step
            self.prune()  # a party that was away when older checkpoints were pruned deletes them now
        return ckpt
