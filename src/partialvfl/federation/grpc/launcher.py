"""How :class:`~partialvfl.federation.grpc.local.LocalDeployment` starts its ``party serve`` processes.

* ``"exec"`` (the default): ``python -m partialvfl party serve --config FILE``, a fresh interpreter per party, as an
  institution runs it.  Each start imports torch again: about 3 CPU-seconds on the 2-core AMD EPYC VM.
* ``"fork"``: the same ``party serve`` command, run in a process forked from a server process that imported torch,
  NumPy, pandas and PyArrow once (:mod:`multiprocessing`'s ``forkserver``; nothing of partialvfl is imported there, so
  each party imports the package from its own ``PYTHONPATH``, plugins included).  A party is still its own OS process
  (its own memory, its own session, its port, its log, killed and restarted by signal) and runs the same code from
  the command's ``main``; only the interpreter start and the third-party imports are shared.  The test suite uses it
  (``PARTIALVFL_LOCAL_LAUNCHER=fork``, set by tests/conftest.py) because it starts hundreds of parties; the tests of
  the command itself start it with ``exec``.

Both return a handle with :class:`subprocess.Popen`'s ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``
and ``kill``.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

__all__ = ["LAUNCHERS", "LAUNCHER_ENV", "PartyHandle", "default_launcher", "forkserver_context", "launch_party",
           "redirect_output"]

#: The environment variable that chooses the launcher of deployments that do not say (``exec`` or ``fork``).
LAUNCHER_ENV = "PARTIALVFL_LOCAL_LAUNCHER"
LAUNCHERS = ("exec", "fork")

#: what the fork server imports once (third-party only: a party imports partialvfl itself, from its own path); the
#: doc tests' warm command server (tests/warm_command.py) preloads the same
PRELOAD = ("numpy", "pandas", "pyarrow", "pyarrow.parquet", "torch", "cryptography.x509")


class PartyHandle(Protocol):
    """What a deployment needs of a started party process (a subset of :class:`subprocess.Popen`)."""

    pid: int

    @property
    def returncode(self) -> int | None:
        """The process's exit status (``None`` while it runs)."""

    def poll(self) -> int | None:
        """The exit status if the process has ended, else ``None``."""

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to end (at most ``timeout`` seconds); its exit status."""

    def send_signal(self, sig: int) -> None:
        """Send the process signal ``sig``."""

    def kill(self) -> None:
        """Kill the process."""


def default_launcher() -> str:
    """The launcher named by ``PARTIALVFL_LOCAL_LAUNCHER`` (``exec`` if unset); another value is an error."""
    name = os.environ.get(LAUNCHER_ENV, "exec") or "exec"
    if name not in LAUNCHERS:
        raise ValueError(f"{LAUNCHER_ENV} must be one of {LAUNCHERS}, got {name!r}")
    return name


def launch_party(launcher: str, argv: Sequence[str], log: Path, env: Mapping[str, str]) -> PartyHandle:
    """Start ``partialvfl ARGV`` as a party process with environment ``env``, its output appended to ``log``."""
    if launcher == "exec":
        with open(log, "ab") as out:
            return subprocess.Popen([sys.executable, "-m", "partialvfl", *argv], stdout=out,
                                    stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)
    if launcher == "fork":
        return ForkedParty(list(argv), log, dict(env))
    raise ValueError(f"unknown party launcher {launcher!r}; known: {LAUNCHERS}")


_CONTEXT: multiprocessing.context.ForkServerContext | None = None


def forkserver_context() -> multiprocessing.context.ForkServerContext:
    """The ``forkserver`` context whose server preloads :data:`PRELOAD` (one per process, started on first use)."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        _CONTEXT = ctx
    return _CONTEXT


def redirect_output(log: str | Path) -> None:
    """In a forked process: its standard output and error appended to ``log`` (file descriptors and Python streams)."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for std in (1, 2):
        os.dup2(fd, std)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stream
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _run_party(argv: list[str], log: str, env: dict[str, str]) -> None:
    """The forked process: a new session, the log as its standard output and error, ``env`` as its environment and
    its ``PYTHONPATH`` first on the path, then the command; ends with the command's exit status."""
    os.setsid()
    redirect_output(log)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["partialvfl", *argv]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in extra if p not in sys.path]
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    try:  # `python -m partialvfl ARGV`, as the exec launcher runs it (the command's package is above this layer)
        runpy.run_module("partialvfl", run_name="__main__", alter_sys=True)
        rc = 0
    except SystemExit as stop:
        rc = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(rc)


class ForkedParty:
    """A party process forked from the preloaded server, with :class:`subprocess.Popen`'s interface."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self._process = forkserver_context().Process(target=_run_party, args=(argv, str(log), env),
                                                 daemon=True)  # ended with this process
        self._process.start()
        self.pid = int(self._process.pid or 0)
        self.args = argv

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

