"""One fit, in process or across a federation's party processes: checkpoints, threads, a clean stop, a lost party.

:func:`run_fit` is what every ``partialvfl fit`` runs, and what the Python API, the benchmarks or a long-running
service call directly::

    fed = GrpcFederation.from_config("federation.toml", connect=False)
    options = FitOptions(checkpoint_dir="model/checkpoints", checkpoint_every=50, party_timeout=600)
    result = run_fit(get_method("false-vfl-1")("fast", seed=0), fed, options)
    result.model.save("model")

Across a federation it says, in one line, what the passive parties can infer about the labels when the fit does not
protect them (:func:`label_exposure`), opens the session, aligns the parties' IDs (asking them to keep the alignment
nonces for ``fit seed N``, unless the federation's ``alignment_id`` is set, so that a resumed fit gets the same
sample order; every setup says it is a fit and how its labels are protected) and trains; with ``party_timeout`` a
party that stops answering is waited for (up to ``party_retries`` times) and the fit continues from the last
checkpoint once every party answers again, ending in the parameters of an uninterrupted fit (a party that restarts
with its session on disk continues it instead, in the very step it left: the others wait, nothing is redone,
:meth:`~partialvfl.federation.grpc.federation.GrpcFederation.continue_party`).  Without it the fit
stops with the party's :class:`~partialvfl.federation.wire.transport.PartyUnavailable`; a
:class:`~.stopping.StopRequest` stops it with :class:`~partialvfl.federation.runtime.checkpoint.FitInterrupted` after a
checkpoint.  Both leave the checkpoint that a call with ``resume=True`` continues from.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partialvfl.data.dataset import VerticalDataset
from partialvfl.federation.runtime.checkpoint import LATEST, Checkpointer
from partialvfl.federation.wire.transport import PartyUnavailable
from partialvfl.methods.label_dp import RANDOMIZED_RESPONSE
from partialvfl.utils.progress import report_line
from partialvfl.utils.threads import resolve_threads, step_flops_of, thread_budget, use_threads

if TYPE_CHECKING:
    from partialvfl.federation.wire.messages import MessageLog
    from partialvfl.methods.base import VFLMethod
    from partialvfl.methods.training import EpochCallback
    from partialvfl.orchestration.stopping import StopRequest

__all__ = ["FitOptions", "FitResult", "fit_threads", "label_exposure", "make_checkpointer", "run_fit"]

#: a checkpoint interval that never comes: the checkpointer only saves when a stop is requested
NEVER = 10**12


@dataclass(frozen=True)
class FitOptions:
    """How :func:`run_fit` runs a fit.  The defaults: no checkpoint, no waiting for a lost party, threads by the
    size of a training step (:mod:`partialvfl.utils.threads`).

    ``checkpoint_dir``: where checkpoints go (needed by ``checkpoint_every``, ``resume`` and a stop request);
    ``checkpoint_every``: steps between checkpoints (0: only when stopped); ``resume``: continue from the last
    checkpoint in ``checkpoint_dir`` (without it a directory holding one is refused); ``party_timeout``: across a
    federation, seconds to wait for a party that stopped answering (and for parties not up yet) before giving up
    (``None``: stop at the first failure); ``party_retries``: party failures waited out in one fit;
    ``threads``: the coordinator's torch threads, a number or ``"auto"``.
    """

    checkpoint_dir: str | Path | None = None
    checkpoint_every: int = 0
    resume: bool = False
    party_timeout: float | None = None
    party_retries: int = 3
    threads: int | str = "auto"

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be a number of steps >= 0, got {self.checkpoint_every}")
        if self.checkpoint_dir is None and (self.checkpoint_every or self.resume):
            raise ValueError("checkpoint_every and resume need checkpoint_dir (where the checkpoints are)")
        if self.party_timeout is not None and self.party_timeout < 0:
            raise ValueError(f"party_timeout must be a number of seconds >= 0, got {self.party_timeout}")
        if self.party_retries < 0:
            raise ValueError(f"party_retries must be >= 0, got {self.party_retries}")
        resolve_threads(self.threads, None, 1)  # a bad value is refused here, before anything runs


@dataclass(frozen=True)
class FitResult:
    """What :func:`run_fit` did: the fitted ``model`` (not saved yet), the seconds the fit took (alignment and
    waiting for parties included), the coordinator's torch ``threads``, the checkpoint it resumed from
    (``resumed_step``; ``None``: from the start), the checkpoints it wrote and the party failures it waited out."""

    model: VFLMethod
    seconds: float
    threads: int
    resumed_step: int | None = None
    saved_steps: tuple[int, ...] = ()
    party_failures: int = 0


def fit_threads(requested: int | str | None, model: VFLMethod, data: Any) -> int:
    """The torch threads for ``model`` on ``data`` (a dataset or a coordinator's view): ``requested`` if a number,
    else by the method's estimate of one training step (:func:`~partialvfl.utils.threads.resolve_threads`)."""
    dataset = data.info.get("dataset") or getattr(data, "name", "") or None
    flops = step_flops_of(type(model), model.resolve_params(dataset), data.feature_shapes)
    return resolve_threads(requested, flops, thread_budget())


def make_checkpointer(options: FitOptions, stop: StopRequest | None = None) -> Checkpointer | None:
    """The fit's checkpointer (``None``: none needed); a directory holding a checkpoint is refused unless
    ``options.resume``; ``stop`` is routed to it."""
    if options.checkpoint_dir is None:
        if stop is not None:
            raise ValueError("a stop request needs FitOptions.checkpoint_dir: where to checkpoint before stopping")
        return None
    directory = Path(options.checkpoint_dir)
    if not options.resume and (directory / LATEST).exists():
        raise ValueError(f"{directory} holds a checkpoint of an earlier run: pass resume=True to continue from it, "
                         "or remove it")
    if not (options.checkpoint_every or options.resume or stop is not None):
        return None
    ck = Checkpointer(directory, every=options.checkpoint_every or NEVER)
    if stop is not None:
        stop.attach(ck)
    return ck


def run_fit(method: VFLMethod, data: Any, options: FitOptions | None = None, *, stop: StopRequest | None = None,
            log: MessageLog | None = None, on_epoch: EpochCallback | None = None,
            notify: Callable[[str], None] | None = None, data_info: Mapping[str, Any] | None = None,
            party_dp: Mapping[int | str, tuple[float, float]] | None = None) -> FitResult:
    """Fit ``method`` on ``data``: a :class:`~partialvfl.data.dataset.VerticalDataset` (in this process, messages
    counted in ``log``) or a federation of party processes (a
    :class:`~partialvfl.federation.grpc.federation.GrpcFederation`, connected or not: the fit opens its session
    and aligns the parties; ``data_info`` adds to what the model records about its training data).

    ``stop``: a :class:`~.stopping.StopRequest` (e.g. from :func:`~.stopping.stop_on_signals`); ``on_epoch(stage,
    epoch, metrics)`` after every epoch; ``notify(line)`` receives the alignment summary (with the method's
    ``progress``) and what is done about a lost party (default: a line on stderr); ``party_dp``: ``{party: (epsilon,
    delta)}``, the differential-privacy budgets of parties in this process (a federation's parties keep their own).
    """
    options = options if options is not None else FitOptions()
    say = notify if notify is not None else report_line
    ck = make_checkpointer(options, stop)
    t0 = time.perf_counter()
    failures = 0
    if isinstance(data, VerticalDataset):
        threads = fit_threads(options.threads, method, data)
        with use_threads(threads):
            method.fit(data, log=log, checkpointer=ck, on_epoch=on_epoch, party_dp=party_dp)
    elif party_dp:
        raise ValueError("party_dp sets the budgets of parties in this process; a federation's parties keep their own "
                         "([policy] dp_epsilon, dp_delta in each party.toml)")
    elif callable(getattr(data, "align", None)):
        threads, failures = _fit_federation(method, data, options, ck, on_epoch, say, dict(data_info or {}))
    else:
        raise TypeError(f"run_fit fits a VerticalDataset or a federation of party processes, not "
                        f"{type(data).__name__}")
    return FitResult(model=method, seconds=time.perf_counter() - t0, threads=threads,
                     resumed_step=ck.restored_step if ck is not None else None,
                     saved_steps=tuple(ck.saved_steps) if ck is not None else (), party_failures=failures)


def _fit_federation(method: VFLMethod, fed: Any, options: FitOptions, ck: Checkpointer | None,
                    on_epoch: EpochCallback | None, say: Callable[[str], None], extra: dict[str, Any]
                    ) -> tuple[int, int]:
    """Connect, align and fit; with ``party_timeout``, wait out up to ``party_retries`` party failures (each time:
    every party says hello again, the fit resumes from the last checkpoint).  Returns (threads, failures)."""
    exposure = label_exposure(method)
    if exposure is not None:
        say(exposure)
    if options.checkpoint_dir is not None and hasattr(fed, "keep_sessions_with"):
        fed.keep_sessions_with(options.checkpoint_dir)  # a coordinator restarted with resume proves it holds them
    if getattr(fed, "alignment_id", "") is None:
        # the parties keep this fit's alignment nonces (if their policy allows), each under a ticket it hands this
        # coordinator (kept with the checkpoints): the fit resumed or continued after a party restarted gets the
        # same tokens, so the same sample order and model (research parties also resume a fit of the same seed)
        fed.alignment_id = f"fit seed {method.seed}"
    # every setup of this fit says it trains, and how its labels are protected (a party may require label DP)
    fed.fit_labels = {"fit": True, **({"label_dp": float(method.label_dp)} if method.label_dp is not None else {})}
    try:
        return _fit_attempts(method, fed, options, ck, on_epoch, say, extra)
    finally:
        fed.fit_labels = None


def label_exposure(method: VFLMethod) -> str | None:
    """The line a federated fit without label protection starts with: what a passive party can infer about the
    labels from what the method sends it (``label_exposure`` of the method), and ``--label-dp``; ``None`` when the
    labels are protected or the passive parties are sent nothing."""
    if method.label_dp is not None or method.label_exposure == "nothing":
        return None
    if method.label_exposure == "labelled rows":
        return (f"labels: not protected: {method.name} sends the passive parties nothing computed from the labels, "
                "but they learn which of their rows are labelled; --label-dp EPS adds label DP all the same")
    return (f"labels: not protected: {method.name} sends the passive parties gradients computed from the labels of "
            "the rows they hold, from which a passive party infers those labels (100 % of them by the gradients' "
            "direction, docs/privacy.md) and which rows are labelled; fit with --label-dp EPS to bound the labels "
            f"by label DP ({RANDOMIZED_RESPONSE.title})")


def _fit_attempts(method: VFLMethod, fed: Any, options: FitOptions, ck: Checkpointer | None,
                  on_epoch: EpochCallback | None, say: Callable[[str], None], extra: dict[str, Any]
                  ) -> tuple[int, int]:
    """Connect, align and fit, waiting out party failures (:func:`_fit_federation`)."""
    timeout = options.party_timeout
    if timeout is not None:  # parties not up yet are waited for, too
        fed.rejoin(timeout)
    else:
        fed.connect()
    attempt = 0
    while True:
        try:
            view, handle = fed.align(handle="train")
            if method.progress and attempt == 0:
                say(f"aligned {view.n_samples} samples over {fed.n_parties} parties ({int(view.labeled.sum())} "
                    f"labelled); observed per party: {view.observed.sum(axis=0).tolist()}")
            labels = fed.config.labels if getattr(fed, "config", None) is not None else None
            info = {**extra, "n_samples": view.n_samples, "id_column": labels and labels.id_column,
                    "label_column": labels and labels.label_column,
                    "alignment": {"mode": getattr(fed, "alignment_mode", None),
                                  "salt": getattr(getattr(fed, "aligner", None), "salt", None)}}
            threads = fit_threads(options.threads, method, view)
            if timeout is not None and callable(getattr(fed, "continue_party", None)):
                # a party that restarts with its session on disk is waited for and continues in the same step
                fed.grpc_transport.on_lost = functools.partial(fed.continue_party, timeout=timeout, mid_step=True,
                                                               handles=[handle])
            try:
                with use_threads(threads):  # the coordinator's; each party sets its own
                    method.fit_federated(fed, view, handle, data_info=info, checkpointer=ck, on_epoch=on_epoch)
            finally:
                if callable(getattr(fed, "continue_party", None)):
                    fed.grpc_transport.on_lost = None
            fed.release(handle)
            return threads, attempt
        except PartyUnavailable as e:
            if timeout is None or attempt >= options.party_retries:
                raise
            attempt += 1
            say(f"party {e.party} ({fed.party_names[e.party]!r}) did not answer ({e.reason}): waiting up to "
                f"{timeout:g} s for every party (failure {attempt} of at most {options.party_retries})")
            fed.rejoin(timeout)
            latest = ck.latest() if ck is not None else None
            say("every party answers again: continuing from "
                + (f"the checkpoint after step {latest.step}" if latest else "the start"))
