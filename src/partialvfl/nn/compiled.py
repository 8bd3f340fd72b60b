"""Compiled hot steps (``--compile``): ``torch.compile`` with inductor and its on-disk cache, or eager with a message.

A function wrapped by :func:`compiled` runs through ``torch.compile`` (inductor; ``dynamic=True``, so the varying
row counts of a round compile once, not once per shape).  Inductor keeps what it built in its on-disk cache
(``TORCHINDUCTOR_CACHE_DIR``, by default a ``torchinductor_<user>`` folder in the temporary directory), so the next
process (a grid's next fit, another worker) loads the kernels instead of compiling them again: a cold start pays
the compile, a warm one a fraction of it (docs/benchmarks.md, "Compiled steps", has the measured costs).

On the CPU inductor writes C++ and needs a compiler (``gcc`` or ``clang``; ``CXX`` selects one).  Where compiling
fails for any reason (no toolchain, an unsupported operation), the function runs eagerly instead: the same numbers,
one message on stderr naming the cause, never a crash.  The wrapped functions are pure (no state changes), so
running one eagerly after a failed compile is safe.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RECOMPILE_LIMIT", "compile_failures", "compiled"]

#: what failed to compile in this process, and why (the first line of the error), by name
_FAILED: dict[str, str] = {}
#: dynamo's recompile limit while compiled steps run (its default, 8, is below the variants one function sees)
RECOMPILE_LIMIT = 64


def compile_failures() -> dict[str, str]:
    """The compiled functions that fell back to eager in this process, with the cause."""
    return dict(_FAILED)


def _cause(e: BaseException) -> str:
    while e.__cause__ is not None and e.__cause__ is not e:
        e = e.__cause__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


class _Compiled:
    """``fn`` through ``torch.compile`` on first use; eager for good once compiling failed."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn = fn
        self.name = name
        self.compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.name in _FAILED:
            return self.fn(*args, **kwargs)
        if self.compiled is None:
            import torch._dynamo.config as dynamo_config

            # one function serves several call sites (shapes, grad modes, layer layouts): room for their variants
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
            self.compiled = torch.compile(self.fn, dynamic=True)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as e:  # any compile failure: run eagerly (a real error raises there too)
            _FAILED[self.name] = _cause(e)
            print(f"partialvfl --compile: could not compile {self.name} ({_FAILED[self.name]}); running it eagerly "
                  "instead (the same results, without the speed-up). On the CPU torch.compile needs a C++ compiler "
                  "(gcc or clang; CXX selects one).", file=sys.stderr)
            return self.fn(*args, **kwargs)


def compiled(fn: Callable[..., Any], on: bool, name: str) -> Callable[..., Any]:
    """``fn`` compiled when ``on`` (one compiled function per ``name``), else ``fn`` itself."""
    return _Compiled(fn, name) if on else fn
