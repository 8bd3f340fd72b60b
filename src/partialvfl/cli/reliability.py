"""``evaluate --reliability FILE``: a reliability diagram of a model's predictions (accuracy against confidence)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["write_reliability"]


def write_reliability(path: str | None, model: Any, output: np.ndarray, view: Any, title: str) -> None:
    """``evaluate --reliability FILE``: the reliability diagram of ``output`` against ``view``'s labels (the
    labelled rows; by how many parties each prediction used)."""
    if not path:
        return
    if not model.index_.task.is_classification:
        raise ValueError("--reliability: a regression model's predictions have no confidence to plot")
    from partialvfl.bench.explain_figures import figure_path, reliability_diagram
    from partialvfl.methods.evaluation import true_in_model_classes

    target = figure_path(path, "--reliability")
    true, _ = true_in_model_classes(view, model.index_.task.classes)
    rows = np.flatnonzero(np.asarray(view.labeled))
    used = np.asarray(model.parties_used(view), dtype=bool)
    calibrated = "calibrated, " + model.calibration_.describe() if model.calibration_ is not None else "uncalibrated"
    reliability_diagram(output[rows], true[rows], used[rows], target, title=f"{title} ({calibrated})")
    print(f"reliability diagram written to {target}", file=sys.stderr)
