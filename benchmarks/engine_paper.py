"""The ``paper-step`` and ``paper-epochs`` sections of ``benchmarks/engine.py``: FALSE-VFL's FashionMNIST ``paper``
configuration, per step and over whole epochs.

The configuration of the paper's Table 10 and Appendix D (``--preset paper`` on ``fashion-mnist``, with the
ResNet-18 encoders of its Appendix D): 8 parties of 14 x 7 pixels with ResNet-18 encoders and transposed-CNN
decoders, d_h 196, d_z 32, kappa 10, stage 1 with batch 1,024 over the 60,000 training images (150 epochs), stage 2
with batch 128 over the 1,000 labelled ones (200 epochs).

* ``paper-step`` times a few steps of each stage with the real stage code (the training loop's items and steps, in
  process) and **extrapolates**: seconds per epoch = median step time x steps per epoch, and the whole fit = 150
  stage-1 epochs + 200 stage-2 epochs.  Every extrapolated figure says so, with the number of steps timed.
* ``paper-epochs`` (issue 36) runs a real fit of ``--paper-epochs E1 E2`` epochs (default 3 stage-1 epochs and 5
  stage-2 epochs) through the training loop, so that data loading, epoch boundaries, the prefetch across epochs and
  everything else a fit does count, and times every whole epoch (the wall clock at each epoch's end, which reads the
  epoch's loss back, so a GPU has finished it).  It prints the measured epochs and, beside them, the whole paper fit
  extrapolated from them (median stage-1 epoch x 150 + median stage-2 epoch x 200) and the step extrapolation's
  per-epoch figure for comparison.

On a CPU both run only as a dry run of the code path (``--quick``: 4,000 training images; ``--paper-batch``: a
smaller batch), which every figure then says.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import numpy as np

from partialvfl.data.protocol import ProtocolConfig, make_protocol

PAPER_CONFIG = dict(encoder="resnet18", decoder="deconv")
REFERENCE = "FALSE-VFL Table 11, RTX 3090: 60 + 30 minutes (FashionMNIST)"


#: ``--paper-train N`` (dry runs): the training images of the paper configuration (``None``: 60,000; quick: 4,000)
TRAIN_IMAGES: dict[str, int | None] = {"max_train": None}


def _paper_data(quick: bool, test_images: int = 0) -> Any:
    images = TRAIN_IMAGES["max_train"] or (4000 if quick else None)
    config = ProtocolConfig("fashion-mnist", parties=8, n_labels=min(1000, images or 1000),
                            n_aligned=min(200, (images or 1000) // 5), train_missing="mcar2", seed=0,
                            max_train=images, max_test=max(test_images, 100))
    train, test = make_protocol(config)
    return train if test_images <= 0 else (train, test)


def _configuration(model: Any, train: Any, small: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The paper preset's resolved parameters and the configuration as printed."""
    paper = type(model)("paper").resolve_params("fashion-mnist")
    shown = {"encoder": "resnet18", "decoder": "deconv", "parties": 8, "train_images": train.n_samples,
             **{k: paper[k] for k in ("d_h", "d_z", "importance_samples", "pretrain_batch_size", "batch_size",
                                      "pretrain_epochs", "epochs")}, **small}
    return paper, shown


def _small(batch: int | None) -> dict[str, Any]:
    return {} if batch is None else {"pretrain_batch_size": batch, "batch_size": batch}


def _note(quick: bool, batch: int | None) -> str:
    images = TRAIN_IMAGES["max_train"] or (4000 if quick else None)
    return ((f"; {images:,} training images, not the paper's 60,000 (a dry run)" if images else "")
            + (f"; --paper-batch {batch}: NOT the paper's batch sizes (a dry run)" if batch else ""))


def paper_steppers(quick: bool, method: Any, federation: Any, batch: int | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One step of each stage of the paper configuration as a function (cycling over epoch 0's batches, in the
    coordinator's computing context), with each stepper's ``steps_per_epoch``; and the configuration as printed."""
    train = _paper_data(quick)
    small = _small(batch)
    model = method("false-vfl-1", "paper", **PAPER_CONFIG, **small, pretrain_epochs=0, epochs=0)
    _, shown = _configuration(model, train, small)
    fed = federation(train, None)
    model.fit(train, federation=fed)  # no epoch: builds and sets up every module
    view = train.coordinator_view()
    handle = fed.attach(train, "engine")
    steppers = {}
    for name, build in (("stage1", model._pretrain_stage), ("stage2", model._train_stage)):
        with model._computing():  # built as a fit builds it (its optimiser, its own rounds)
            stage = build(view, handle)
        rounds, items = model._rounds, list(stage.items(0, stage.rng))

        def one(stage: Any = stage, rounds: Any = rounds, items: list = items, at: list = [0]) -> None:  # noqa: B006
            model._rounds = rounds  # this stage's rounds (and prefetch), also when the steppers take turns
            fed.transport.new_step()
            with model._computing():
                stage.step(items[at[0] % len(items)], stage.rng)
            at[0] += 1

        one.steps_per_epoch = len(items)  # type: ignore[attr-defined]
        one.transport = fed.transport  # type: ignore[attr-defined]
        steppers[name] = one
    return steppers, shown


def paper_step_section(steps: int, quick: bool, method: Any, federation: Any, timed: Any,
                       batch: int | None = None) -> dict[str, Any]:
    """Stage-1 and stage-2 step times of the paper configuration, and per-epoch and whole-fit extrapolations.

    ``method``/``federation``/``timed``: the engine's helpers (they carry ``--device`` and synchronise a GPU).
    ``batch`` (``--paper-batch``, for dry runs of the code path only): both stages' batch size instead of the
    paper's; the figures are then not the paper configuration's, and the note says so.
    """
    steppers, shown = paper_steppers(quick, method, federation, batch)
    times = {}
    for name, one in steppers.items():
        timed(one, 1)  # the first step pays lazy set-up (allocations, kernels)
        times[name] = [timed(one, 1)[0] for _ in range(steps)]
    n1, n2 = steppers["stage1"].steps_per_epoch, steppers["stage2"].steps_per_epoch
    e1, e2 = statistics.median(times["stage1"]) * n1, statistics.median(times["stage2"]) * n2
    epochs1, epochs2 = shown["pretrain_epochs"], shown["epochs"]
    total = epochs1 * e1 + epochs2 * e2
    return {
        "configuration": shown,
        "stage1_step_seconds": [round(t, 3) for t in times["stage1"]], "stage1_steps_per_epoch": n1,
        "stage2_step_seconds": [round(t, 3) for t in times["stage2"]], "stage2_steps_per_epoch": n2,
        "stage1_epoch_seconds_extrapolated": round(e1, 1), "stage2_epoch_seconds_extrapolated": round(e2, 1),
        "paper_fit_minutes_extrapolated": round(total / 60, 1),
        "paper_fit_hours_extrapolated": round(total / 3600, 2),
        "note": (f"extrapolated from {len(times['stage1'])} stage-1 and {len(times['stage2'])} stage-2 timed steps "
                 f"(median x steps per epoch; {epochs1} + {epochs2} epochs); not a measured epoch"
                 + _note(quick, batch)),
        "paper_reference": REFERENCE,
    }


def paper_epochs_section(epochs: tuple[int, int], quick: bool, method: Any, sync: Any,
                         batch: int | None = None, federation: Any = None, test_images: int = 0) -> dict[str, Any]:
    """A fit of ``epochs`` (stage 1, stage 2) whole epochs of the paper configuration, every epoch timed, and the
    paper fit (150 + 200 epochs) extrapolated from the measured epochs; ``test_images``: then the short fit's test
    accuracy on that many test images (MCAR 2 missingness as in training; the accuracy effect of a precision)."""
    e1, e2 = (int(e) for e in epochs)
    train, test = _paper_data(quick, test_images) if test_images > 0 else (_paper_data(quick), None)
    small = _small(batch)
    model = method("false-vfl-1", "paper", **PAPER_CONFIG, **small, pretrain_epochs=e1, epochs=e2, min_steps=0)
    paper, shown = _configuration(model, train, small)
    marks: list[tuple[str, float]] = []

    def on_epoch(stage: str, epoch: int, metrics: dict[str, float]) -> None:
        sync()  # the epoch's loss was read back already; this makes sure nothing of it is still queued
        marks.append((stage, time.perf_counter()))
        since = marks[-1][1] - (marks[-2][1] if len(marks) > 1 else t0)
        print(f"paper-epochs: {stage} epoch {epoch} took {since:.2f} s", file=sys.stderr, flush=True)  # if cut short

    fed = federation(train, None) if federation is not None else None  # the engine's (--concurrent)
    sync()
    t0 = time.perf_counter()
    model.fit(train, on_epoch=on_epoch, **({"federation": fed} if fed is not None else {}))
    sync()
    wall = time.perf_counter() - t0
    accuracy: dict[str, Any] = {"stage1_bound_last_epoch": next(
        (h.get("bound") for h in reversed(model.history_) if h.get("stage") == "pretrain"), None)}
    if test is not None:
        t1 = time.perf_counter()
        test = test.subset(np.arange(min(test_images, test.n_samples)))
        try:  # a failed prediction costs the accuracy, not the measured epochs
            accuracy.update(test_images=int(test.n_samples), test_accuracy=round(float(model.score(test)), 4),
                            predict_seconds=round(time.perf_counter() - t1, 2))
        except Exception as e:
            accuracy["test_error"] = f"{type(e).__name__}: {e}"
    seconds: dict[str, list[float]] = {"pretrain": [], "train": []}
    for i, (stage, t) in enumerate(marks):
        first = i == 0 or marks[i - 1][0] != stage
        if not first:  # the first epoch of each stage also pays the stage's set-up: reported apart
            seconds[stage].append(t - marks[i - 1][1])
    firsts = {stage: round(t - (t0 if i == 0 else marks[i - 1][1]), 2) for i, (stage, t) in enumerate(marks)
              if i == 0 or marks[i - 1][0] != stage}
    med1 = statistics.median(seconds["pretrain"]) if seconds["pretrain"] else firsts.get("pretrain", 0.0)
    med2 = statistics.median(seconds["train"]) if seconds["train"] else firsts.get("train", 0.0)
    total = paper["pretrain_epochs"] * med1 + paper["epochs"] * med2
    return {
        "configuration": {**shown, "pretrain_epochs": e1, "epochs": e2},
        "fit_seconds": round(wall, 2), "stage_seconds": {k: round(v, 2) for k, v in model.stage_seconds_.items()},
        "first_epoch_seconds": firsts,
        "stage1_epoch_seconds": [round(t, 2) for t in seconds["pretrain"]],
        "stage2_epoch_seconds": [round(t, 2) for t in seconds["train"]],
        "paper_fit_minutes_from_epochs": round(total / 60, 1), **accuracy,
        "note": (f"{e1} stage-1 and {e2} stage-2 whole epochs measured (a fit through the training loop); the "
                 "first epoch of each stage (set-up, first kernels) apart; the paper fit "
                 f"({paper['pretrain_epochs']} + {paper['epochs']} epochs) extrapolated from the median measured "
                 "epochs" + _note(quick, batch)),
        "paper_reference": REFERENCE,
    }
