"""The ``paper-step`` section of ``benchmarks/engine.py``: FALSE-VFL's FashionMNIST ``paper`` configuration per epoch.

The configuration of the paper's Table 10 and Appendix D (``--preset paper`` on ``fashion-mnist``): 8 parties of
14 x 7 pixels with ResNet-18 encoders and transposed-CNN decoders, d_h 196, d_z 32, kappa 10, stage 1 with batch
1,024 over the 60,000 training images (150 epochs), stage 2 with batch 128 over the 1,000 labelled ones (200
epochs).  A whole epoch is out of reach on a CPU (the paper used an RTX 3090: 60 + 30 minutes), so the section times
a few steps of each stage with the real stage code (the training loop's items and steps, in process, batched where
the modules stack) and **extrapolates**: seconds per epoch = median step time x steps per epoch, and the whole fit =
150 stage-1 epochs + 200 stage-2 epochs.  Every extrapolated figure says so, with the number of steps timed.
"""

from __future__ import annotations

import statistics
from typing import Any

from partialvfl.data.protocol import ProtocolConfig, make_protocol

PAPER_CONFIG = dict(encoder="resnet18", decoder="deconv")


def _time_steps(stage: Any, steps: int, fed: Any, timed: Any) -> tuple[list[float], int]:
    """Seconds of ``steps`` steps of epoch 0 of ``stage`` (after one untimed warm-up step), and its step count."""
    items = list(stage.items(0, stage.rng))
    out = []
    for i, item in enumerate(items[:steps + 1]):
        def one(item: Any = item) -> None:
            fed.transport.new_step()
            stage.step(item, stage.rng)
        t = timed(one, 1)[0]
        if i:  # the first step pays lazy set-up (allocations, kernels)
            out.append(t)
    return out, len(items)


def paper_step_section(steps: int, quick: bool, method: Any, federation: Any, timed: Any,
                       batch: int | None = None) -> dict[str, Any]:
    """Stage-1 and stage-2 step times of the paper configuration, and per-epoch and whole-fit extrapolations.

    ``method``/``federation``/``timed``: the engine's helpers (they carry ``--device`` and synchronise a GPU).
    ``batch`` (``--paper-batch``, for dry runs of the code path only): both stages' batch size instead of the
    paper's; the figures are then not the paper configuration's, and the note says so.
    """
    config = ProtocolConfig("fashion-mnist", parties=8, n_labels=1000, n_aligned=200, train_missing="mcar2", seed=0,
                            max_train=4000 if quick else None, max_test=100)
    train = make_protocol(config)[0]
    small = {} if batch is None else {"pretrain_batch_size": batch, "batch_size": batch}
    model = method("false-vfl-1", "paper", **PAPER_CONFIG, **small, pretrain_epochs=0, epochs=0)
    paper = type(model)("paper").resolve_params("fashion-mnist")
    fed = federation(train, None)
    model.fit(train, federation=fed)  # no epoch: builds and sets up every module
    view = train.coordinator_view()
    handle = fed.attach(train, "engine")
    with model._computing():
        s1, n1 = _time_steps(model._pretrain_stage(view, handle), steps, fed, timed)
        s2, n2 = _time_steps(model._train_stage(view, handle), steps, fed, timed)
    e1, e2 = statistics.median(s1) * n1, statistics.median(s2) * n2
    total = paper["pretrain_epochs"] * e1 + paper["epochs"] * e2
    return {
        "configuration": {"encoder": "resnet18", "decoder": "deconv", "parties": 8, "train_images": train.n_samples,
                          **{k: paper[k] for k in ("d_h", "d_z", "importance_samples", "pretrain_batch_size",
                                                   "batch_size", "pretrain_epochs", "epochs")}, **small},
        "stage1_step_seconds": [round(t, 3) for t in s1], "stage1_steps_per_epoch": n1,
        "stage2_step_seconds": [round(t, 3) for t in s2], "stage2_steps_per_epoch": n2,
        "stage1_epoch_seconds_extrapolated": round(e1, 1), "stage2_epoch_seconds_extrapolated": round(e2, 1),
        "paper_fit_minutes_extrapolated": round(total / 60, 1),
        "paper_fit_hours_extrapolated": round(total / 3600, 2),
        "note": (f"extrapolated from {len(s1)} stage-1 and {len(s2)} stage-2 timed steps (median x steps per epoch; "
                 f"{paper['pretrain_epochs']} + {paper['epochs']} epochs); not a measured epoch"
                 + ("; --quick: 4,000 training images, not the paper's 60,000" if quick else "")
                 + (f"; --paper-batch {batch}: NOT the paper's batch sizes (a dry run)" if batch else "")),
        "paper_reference": "FALSE-VFL Table 11, RTX 3090: 60 + 30 minutes (FashionMNIST)",
    }
