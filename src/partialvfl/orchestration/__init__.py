"""Running fits and predictions: checkpoints, threads, a clean stop, recovery from a lost party.

The layer between the methods and everything that runs them (the ``partialvfl`` commands, the benchmarks, a
service): :func:`run_fit` fits a method in this process or across a federation's party processes (waiting for a
lost party and continuing from the last checkpoint), :func:`run_predict` predicts with whichever parties answer
and says which parties each row used, :func:`stop_on_signals` turns SIGINT/SIGTERM into a checkpoint and a stop.
"""

from partialvfl.orchestration.fit import FitOptions, FitResult, fit_threads, make_checkpointer, run_fit
from partialvfl.orchestration.predict import (
    Prediction,
    PredictOptions,
    PriorOnlyRows,
    predict_reporting_parties,
    require_active_party,
    run_predict,
)
from partialvfl.orchestration.stopping import StopRequest, stop_on_signals

__all__ = [
    "FitOptions", "FitResult", "PredictOptions", "Prediction", "PriorOnlyRows", "StopRequest", "fit_threads",
    "make_checkpointer", "predict_reporting_parties", "require_active_party", "run_fit", "run_predict",
    "stop_on_signals",
]
