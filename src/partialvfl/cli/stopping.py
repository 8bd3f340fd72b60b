"""How a fit ends when it cannot finish: a signal, or a party lost mid-fit.

SIGINT/SIGTERM during ``fit`` ask the training loop to checkpoint at the next step boundary
(:meth:`~partialvfl.federation.checkpoint.Checkpointer.request_stop`); the command then prints the exact command
that resumes and exits 130 (SIGINT) or 143 (SIGTERM).  A second signal stops at once.  A party lost during
``fit --federation`` ends the command with one line: what failed, the last checkpoint, and the resume command
(exit 3).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["EXIT_PARTY_LOST", "exit_code", "fit_checkpointer", "report_interrupted", "report_party_lost",
           "resume_command", "stop_on_signals"]

EXIT_PARTY_LOST = 3


def exit_code(signum: int | None) -> int:
    """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum) if signum else 1


def fit_checkpointer(args: argparse.Namespace) -> Any:
    """The fit's checkpointer: ``--checkpoint-every``/``--resume``'s, or one that only checkpoints when stopped."""
    from partialvfl.cli.checkpoints import checkpointer
    from partialvfl.federation.checkpoint import Checkpointer

    return checkpointer(args) or Checkpointer(Path(args.out) / "checkpoints", every=10**12)


@contextmanager
def stop_on_signals(ck: Any) -> Iterator[None]:
    """While the fit runs, SIGINT/SIGTERM request a checkpoint and a stop (a second one stops at once)."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: Any) -> None:
        ck.request_stop(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print(f"{signal.Signals(signum).name}: checkpointing at the next step, then stopping (again to stop now)",
              file=sys.stderr, flush=True)

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


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


def report_party_lost(args: argparse.Namespace, names: tuple[str, ...], ck: Any, e: Any) -> int:
    """One line for a fit stopped because a party did not answer; returns :data:`EXIT_PARTY_LOST`."""
    party = f"party {e.party} ({names[e.party]!r})" if 0 <= e.party < len(names) else f"party {e.party}"
    latest = ck.latest() if ck is not None else None
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
