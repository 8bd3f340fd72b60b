"""How a fit ends when it cannot finish: a signal, or a party lost mid-fit.

SIGINT/SIGTERM during ``fit`` ask the training loop to checkpoint at the next step boundary
(:meth:`~partialvfl.federation.runtime.checkpoint.Checkpointer.request_stop`); the command then prints the exact command
that resumes and exits 130 (SIGINT) or 143 (SIGTERM).  A second signal stops at once.  A party lost during
``fit --federation`` ends the command with one line: what failed, the last checkpoint, and the resume command
(exit 3).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

__all__ = ["EXIT_PARTY_LOST", "exit_code", "fit_command", "report_interrupted", "report_party_lost",
           "resume_command"]

EXIT_PARTY_LOST = 3


def exit_code(signum: int | None) -> int:
    """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum) if signum else 1


def fit_command(args: argparse.Namespace, options: Any, model: Any, data: Any, **kwargs: Any) -> Any:
    """The fit of every ``fit`` command: :func:`~partialvfl.orchestration.run_fit` with the command's ``options``
    (:func:`~partialvfl.cli.checkpoints.fit_options`), SIGINT/SIGTERM checkpointing and stopping it; then what the
    command says about its epochs and checkpoints.  Returns the ``FitResult``, or the exit code of a fit a signal
    stopped."""
    from partialvfl.cli.checkpoints import report_checkpoints
    from partialvfl.cli.params import report_last_epochs
    from partialvfl.federation.runtime.checkpoint import FitInterrupted
    from partialvfl.orchestration import run_fit, stop_on_signals

    try:
        with stop_on_signals() as stop:
            result = run_fit(model, data, options, stop=stop, **kwargs)
    except FitInterrupted as e:
        return report_interrupted(args, e)
    report_last_epochs(args, model)
    report_checkpoints(args, result, not args.quiet)
    return result


def resume_command(args: argparse.Namespace) -> str:
    """The command line of this fit with ``--resume`` (as it was typed, when ``main`` recorded it)."""
    argv = list(getattr(args, "argv", None) or _rebuilt_argv(args))
    argv = [a for a in argv if a != "--resume"] + ["--resume"]
    return shlex.join(["partialvfl", *argv])


def _rebuilt_argv(args: argparse.Namespace) -> list[str]:
    argv = ["fit"]
    if getattr(args, "federation", None):
        argv += ["--federation", str(args.federation)]
    argv += ["--method", args.method, "--preset", args.preset, "--seed", str(args.seed), "--out", str(args.out)]
    if args.epochs is not None:
        argv += ["--epochs", str(args.epochs)]
    for p in args.param or []:
        argv += ["--param", p]
    if args.checkpoint_every:
        argv += ["--checkpoint-every", str(args.checkpoint_every)]
    return argv


def report_interrupted(args: argparse.Namespace, e: Any) -> int:
    """One line for a fit stopped by a signal; returns its exit code."""
    name = signal.Signals(e.signum).name if e.signum else "a stop request"
    print(f"stopped by {name} after training step {e.step}: checkpoint saved in {e.directory}; resume with: "
          f"{resume_command(args)}", file=sys.stderr, flush=True)
    return exit_code(e.signum)


def report_party_lost(args: argparse.Namespace, names: tuple[str, ...], e: Any) -> int:
    """One line for a fit stopped because a party did not answer; returns :data:`EXIT_PARTY_LOST`."""
    from partialvfl.federation.runtime.checkpoint import Checkpointer

    party = f"party {e.party} ({names[e.party]!r})" if 0 <= e.party < len(names) else f"party {e.party}"
    latest = Checkpointer(Path(args.out) / "checkpoints").latest()
    where = (f"the last checkpoint is after step {latest.step} ({latest.directory.parent})" if latest is not None
             else "there is no checkpoint yet (the resumed fit starts from the beginning)")
    if "FAILED_PRECONDITION" in e.reason:  # it answers, but lost this coordinator's session: it restarted
        what = (f"{party} restarted during the fit (it has no session of this coordinator: {e.reason}); the fit "
                f"stopped, {where}; resume with: {resume_command(args)} (or wait for parties with --party-timeout)")
    else:
        what = (f"{party} did not answer: {e.reason}; the fit stopped, {where}; restart the party (same "
                f"configuration and state directory), then resume with: {resume_command(args)}")
    print(f"error: {what}", file=sys.stderr, flush=True)
    return EXIT_PARTY_LOST
