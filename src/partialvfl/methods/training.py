"""The one training loop every method runs its epochs through.

A method describes each training stage as a :class:`Stage`: how many epochs, which items (mini-batches, or
whole-party actions such as one SimSiam epoch) make up epoch ``e``, and the step that processes one item.  The
:class:`TrainingLoop` does the rest, identically for every method and deployment:

* one transport step per item (``transport.new_step()``), a global step count over all stages;
* seeded order: each stage owns one numpy generator, handed to the item iterator and to the step, whose state is
  part of every checkpoint;
* running sums per epoch: a step returns ``{metric: (value_sum, weight)}``; at the end of the epoch the loop
  reports ``value_sum / weight`` (a weight of 0 marks a plain total, reported as the sum);
* every metric a step returns (its loss) must be finite: a NaN or infinite loss stops training with a
  :class:`NonFiniteError` naming the step and the likely cause, for every method alike;
* progress (a bar over epochs) and a report per epoch to the method and to the caller's ``on_epoch`` callback;
* a party that fails during a step stops the fit at the end of that step
  (:class:`~partialvfl.federation.runtime.checkpoint.PartyLost`; the step's partial effects are discarded with the
  process
  state, the last checkpoint is intact), and a stop requested by a signal checkpoints at the next step boundary
  (:class:`~partialvfl.federation.runtime.checkpoint.FitInterrupted`);
* early stopping of the method's supervised stage (``Stage.supervised``), when the fit has it on
  (:class:`~partialvfl.methods.schedule.EarlyStopping`): validation checks at epoch ends (reported with the epoch's
  metrics as ``val_score`` / ``val_loss``), a stop after ``patience`` checks without improvement, and the best
  checked state restored at the stage's end; its state is part of every checkpoint;
* checkpoints every N steps through a :class:`~partialvfl.federation.runtime.checkpoint.Checkpointer` and an exact
  resume:
  parties are rolled back by ``Checkpointer.restore``; the loop skips the stages and epochs before the checkpoint,
  replays the checkpointed epoch's item iterator from the generator state saved at that epoch's start (so lazily
  drawn items come out the same), then restores the generator, the running sums, the history, the coordinator's
  modules and the stage's own state (optimisers) and continues with the next item;
* a look ahead (:meth:`TrainingLoop.peek`): a step may ask for the item that follows it (drawn then, after the step's
  own draws, and kept for the next step), so that its last round can carry the next step's first request (one round
  trip per step instead of two); an epoch's end is crossed unless a validation check comes between, and a checkpoint
  keeps the generator as it was before the look ahead, so the order of every draw, and a resume, are unchanged.

A resumed fit therefore ends in the same parameters as an uninterrupted one (tested for every method family, in
process and over gRPC).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from partialvfl.data.ids import show_id
from partialvfl.federation.runtime.checkpoint import PartyLost, rng_state, set_rng_state
from partialvfl.federation.wire.transport import PartyUnavailable
from partialvfl.utils.progress import progress

if TYPE_CHECKING:
    from partialvfl.federation.runtime.checkpoint import Checkpointer
    from partialvfl.federation.wire.transport import Transport
    from partialvfl.methods.schedule import EarlyStopping

__all__ = ["EpochCallback", "Metrics", "NonFiniteError", "Stage", "TrainingLoop", "check_finite_output"]

#: What usually makes a loss or a probability non-finite, for the error message.
LIKELY_CAUSES = ("features on very different scales or very large values (keep the default standardize=true, or "
                 "rescale them), a learning rate too high for this data, or a diverging optimiser")


class NonFiniteError(ValueError):
    """A loss or an output that is NaN or infinite: training or prediction stops, naming the step and likely cause."""


def check_finite_output(method: str, output: np.ndarray, ids: np.ndarray) -> None:
    """Refuse predictions that are not finite, naming how many and the first sample's ID."""
    bad = ~np.isfinite(output)
    if bad.any():
        rows = np.flatnonzero(bad.reshape(len(output), -1).any(axis=1))
        raise NonFiniteError(
            f"{method}: the prediction for {rows.size} sample(s) (first: ID {show_id(ids[rows[0]])}) is not finite; "
            f"likely cause: {LIKELY_CAUSES}")

#: What a step returns: per metric, (sum of values, weight); weight 0 marks a total.
Metrics = Mapping[str, tuple[float, float]]
#: ``on_epoch(stage, epoch, metrics)``: called after every epoch (epochs count from 1).
EpochCallback = Callable[[str, int, dict[str, float]], None]


@dataclass
class _Peeked:
    """The next item, drawn ahead by :meth:`TrainingLoop.peek`: the generator's state before the draw and, when the
    item opens the next epoch, that epoch's iterator."""

    item: Any
    rng_before: Any
    next_epoch: Iterator[Any] | None = None


@dataclass
class Stage:
    """One training stage of a method.

    ``items(epoch, rng)`` yields what one epoch processes (its iteration may draw from ``rng``, eagerly or lazily);
    ``step(item, rng)`` processes one item through the transport and returns its :data:`Metrics` (or ``None``).
    ``state``/``load_state`` save and restore what the stage keeps besides the coordinator's modules (optimisers,
    flags); ``on_epoch_start(epoch)`` runs before each epoch, also the one a resume lands in (e.g. learning-rate
    schedules: it must be idempotent).  ``supervised`` marks the stage that learns from labels (the one early
    stopping applies to); ``parties_train`` whether its steps change the parties' states (then early stopping keeps
    and restores them too).
    """

    name: str
    epochs: int
    items: Callable[[int, np.random.Generator], Iterable[Any]]
    step: Callable[[Any, np.random.Generator], Metrics | None]
    rng: np.random.Generator
    state: Callable[[], dict[str, Any]] | None = None
    load_state: Callable[[dict[str, Any]], None] | None = None
    on_epoch_start: Callable[[int], None] | None = None
    supervised: bool = False
    parties_train: bool = True


class TrainingLoop:
    """Runs a method's stages through its transport, reporting, checkpointing and resuming.

    ``save_coordinator``/``load_coordinator`` give and restore the coordinator's modules; ``history`` is the
    method's list of epoch reports (kept in checkpoints); ``report(stage, epoch, metrics)`` records one epoch;
    ``stopping`` early-stops the supervised stage (``None``: it runs all its epochs).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        name: str,
        history: list[dict[str, Any]],
        report: EpochCallback,
        save_coordinator: Callable[[], dict[str, Any]],
        load_coordinator: Callable[[dict[str, Any]], None],
        checkpointer: Checkpointer | None = None,
        fingerprint: dict[str, Any] | None = None,
        show_progress: bool = False,
        stopping: EarlyStopping | None = None,
    ) -> None:
        self.transport = transport
        self.stopping = stopping
        self.stopping_result: dict[str, Any] | None = None
        self.name = name
        self.history = history
        self.report = report
        self.save_coordinator = save_coordinator
        self.load_coordinator = load_coordinator
        self.checkpointer = checkpointer
        self.show_progress = show_progress
        self.step_count = 0
        self.stages_run: list[str] = []
        self.fingerprint = dict(fingerprint or {})
        self.resume: dict[str, Any] | None = None
        self.resumed_step: int | None = None
        # the epoch being run (stage, epoch, its iterator, early stopping) and the item drawn ahead (peek)
        self._current: tuple[Stage, int, Iterator[Any], EarlyStopping | None] | None = None
        self._peeked: _Peeked | None = None
        if checkpointer is not None and (latest := checkpointer.latest()) is not None:
            self._check_fingerprint(latest.state.get("fingerprint", {}), latest.directory)
            saved = checkpointer.restore()
            assert saved is not None
            self.resume = saved.state
            self.resumed_step = saved.step

    def _check_fingerprint(self, saved: dict[str, Any], where: Any) -> None:
        """Refuse a checkpoint of another run (other method, parameters, seed or data), naming what differs."""
        for key in sorted(set(saved) | set(self.fingerprint)):
            if saved.get(key) != self.fingerprint.get(key):
                raise ValueError(
                    f"{self.name}: the checkpoint in {where} was made with {key} = {_short(saved.get(key))}, this "
                    f"run has {_short(self.fingerprint.get(key))}: resume with the parameters and data of the "
                    "checkpointed run (or start from an empty checkpoint directory)"
                )

    # ------------------------------------------------------------------ running
    def run(self, stage: Stage) -> None:
        """Run every epoch of ``stage`` (or what is left of it after a checkpoint)."""
        if stage.name in self.stages_run:
            raise ValueError(f"{self.name}: stage {stage.name!r} run twice in one fit")
        self.stages_run.append(stage.name)
        self._peeked = None
        if self.resume is not None and self.resume["stage"] != stage.name:
            return  # the whole stage lies before the checkpoint: its effects are in the restored states
        first_epoch = int(self.resume["epoch"]) if self.resume is not None else 0
        stopper = self.stopping if stage.supervised else None
        if stopper is not None:
            stopper.begin(stage.epochs, stage.parties_train)
        for epoch in progress(range(first_epoch, stage.epochs), f"{self.name} {stage.name}", self.show_progress):
            self._run_epoch(stage, epoch, stopper)
            if stopper is not None and stopper.stopped:
                break
        if stopper is not None:
            self.stopping_result = self._guarded(lambda: stopper.finish(self.load_coordinator))

    def _guarded(self, action: Callable[[], Any]) -> Any:
        """Run a between-steps action that talks to the parties; a party that fails stops the fit there."""
        try:
            return action()
        except PartyUnavailable as e:
            raise PartyLost(e.party, e.reason, self.step_count) from None

    def peek(self) -> Any | None:
        """The item the running stage processes next, drawn now (after the calling step's own draws) and kept for
        that step; ``None`` when none follows the current one without something in between: the stage's end, or an
        epoch's end followed by a validation check (early stopping).  Called again before the next step, the same
        item."""
        if self._current is None:
            return None
        if self._peeked is not None:
            return self._peeked.item
        stage, epoch, items, stopper = self._current
        before = rng_state(stage.rng)
        item = next(items, _END)
        if item is not _END:
            self._peeked = _Peeked(item, before)
            return item
        if epoch + 1 >= stage.epochs or (stopper is not None and stopper.due(epoch)):
            return None
        following = iter(stage.items(epoch + 1, stage.rng))
        item = next(following, _END)
        if item is _END:  # an empty epoch: as if nothing had been drawn
            set_rng_state(stage.rng, before)
            return None
        self._peeked = _Peeked(item, before, following)
        return item

    def _next_item(self, items: Iterator[Any]) -> Any:
        """The next item of this epoch: the one drawn ahead, if any (an item of the next epoch waits for it)."""
        peeked = self._peeked
        if peeked is None:
            return next(items, _END)
        if peeked.next_epoch is not None:
            return _END
        self._peeked = None
        return peeked.item

    def _run_epoch(self, stage: Stage, epoch: int, stopper: EarlyStopping | None = None) -> None:
        if stage.on_epoch_start is not None:
            stage.on_epoch_start(epoch)
        peeked = self._peeked
        if self.resume is not None:
            index, sums, epoch_rng, items = self._fast_forward(stage, stopper)
        elif peeked is not None and peeked.next_epoch is not None:  # its first item was drawn ahead
            index, sums, epoch_rng = 0, {}, peeked.rng_before
            items = peeked.next_epoch
            self._peeked = _Peeked(peeked.item, peeked.rng_before)
        else:
            index, sums, epoch_rng = 0, {}, rng_state(stage.rng)
            items = iter(stage.items(epoch, stage.rng))
        self._current = (stage, epoch, items, stopper)
        try:
            self._run_items(stage, epoch, stopper, items, index, sums, epoch_rng)
        finally:
            self._current = None

    def _run_items(self, stage: Stage, epoch: int, stopper: EarlyStopping | None, items: Iterator[Any], index: int,
                   sums: dict[str, list[float]], epoch_rng: Any) -> None:
        while (item := self._next_item(items)) is not _END:
            self.transport.new_step()
            self.step_count += 1
            failures = len(self.transport.failures)
            try:
                metrics = stage.step(item, stage.rng) or {}
            except PartyUnavailable as e:
                raise PartyLost(e.party, e.reason, self.step_count) from None
            if len(self.transport.failures) > failures:  # a party missed part of this training step: stop here
                _, party, reason = self.transport.failures[failures]
                raise PartyLost(party, reason, self.step_count)
            for key, (value, weight) in metrics.items():
                self._check_finite(stage, epoch, key, value)
                acc = sums.setdefault(key, [0.0, 0.0])
                acc[0] += float(value)
                acc[1] += float(weight)
            index += 1
            self._maybe_checkpoint(stage, epoch, index, epoch_rng, sums, stopper)
        metrics = {k: s / w if w else s for k, (s, w) in sums.items()}
        if stopper is not None and stopper.due(epoch):
            metrics.update(self._guarded(lambda: stopper.check(epoch, self.save_coordinator)))
        self.report(stage.name, epoch + 1, metrics)

    def _check_finite(self, stage: Stage, epoch: int, key: str, value: float) -> None:
        if not math.isfinite(float(value)):
            raise NonFiniteError(
                f"{self.name}: the {key} is {float(value)} at step {self.step_count} (stage {stage.name!r}, epoch "
                f"{epoch + 1}); training stopped. Likely cause: {LIKELY_CAUSES}")

    def _fast_forward(self, stage: Stage, stopper: EarlyStopping | None = None
                      ) -> tuple[int, dict[str, list[float]], Any, Iterator[Any]]:
        """Land on the checkpointed position of this epoch: replay the items before it, restore every state.

        Returns the position, the running sums, the generator state at the epoch's start and the iterator that
        continues with the first item after the checkpoint.
        """
        saved = self.resume
        assert saved is not None
        set_rng_state(stage.rng, saved["rng_epoch"])
        items = iter(stage.items(int(saved["epoch"]), stage.rng))
        index = int(saved["index"])
        for done in range(index):
            if next(items, _END) is _END:
                raise ValueError(
                    f"{self.name}: the checkpoint is after item {index} of {stage.name!r} epoch "
                    f"{int(saved['epoch']) + 1}, but that epoch has only {done} items: resume with the parameters "
                    "and data of the checkpointed run"
                )
        set_rng_state(stage.rng, saved["rng"])  # before the next item is drawn: lazy iterators continue exactly
        self.history[:] = [dict(row) for row in saved["history"]]
        self.load_coordinator(saved["coordinator"])
        if stage.load_state is not None:
            stage.load_state(saved["stage_state"])
        if stopper is not None:
            stopper.load_state_dict(saved["stopping"])
        self.step_count = int(saved["step"])
        self.resume = None
        sums = {k: [float(v[0]), float(v[1])] for k, v in saved["sums"].items()}
        return index, sums, saved["rng_epoch"], items

    def _maybe_checkpoint(self, stage: Stage, epoch: int, index: int, epoch_rng: Any,
                          sums: dict[str, list[float]], stopper: EarlyStopping | None = None) -> None:
        if self.checkpointer is None:
            return

        # drawn ahead: the checkpoint keeps the generator before that draw (a resume draws the item again)
        rng = self._peeked.rng_before if self._peeked is not None else rng_state(stage.rng)

        def state() -> dict[str, Any]:
            return {
                "fingerprint": self.fingerprint, "step": self.step_count, "stage": stage.name, "epoch": epoch,
                "index": index,
                "rng_epoch": epoch_rng, "rng": rng,
                "sums": {k: [float(s), float(w)] for k, (s, w) in sums.items()},
                "history": [dict(row) for row in self.history],
                "coordinator": self.save_coordinator(),
                "stage_state": stage.state() if stage.state is not None else {},
                **({"stopping": stopper.state_dict()} if stopper is not None else {}),
            }

        self.checkpointer.after_step(self.step_count, state)

    def finish(self) -> None:
        """Refuse a checkpoint this run never reached (it came from other parameters or data)."""
        if self.resume is not None:
            raise ValueError(
                f"{self.name}: the checkpoint (after step {self.resumed_step}, stage {self.resume['stage']!r}) "
                f"was never reached; this run's stages are {self.stages_run}: resume with the parameters and data "
                "of the checkpointed run"
            )


_END = object()


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
