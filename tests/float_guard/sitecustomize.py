"""The float guard's emulation of another processor (issue 33), loaded by every Python process of a guard run.

``scripts/float_guard.sh`` puts this folder first on ``PYTHONPATH`` and sets ``PARTIALVFL_FLOAT_GUARD=1``, so the
pytest process and every process it starts (party servers, the documented commands) import this file at start-up.

Why an emulation beside the real instruction-set switches: on an Intel CPU with AVX-512, MKL rounds a matrix
product of one row differently from the same row inside a product of nine, and a layer of 8 outputs differently
from the first 8 outputs of a layer of 16; on an AMD CPU with AVX2 it does not, and no environment variable makes it
(``MKL_ENABLE_INSTRUCTIONS``, ``MKL_CBWR``, ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA`` were each tried
against the two tests that failed on the Intel machine; they passed). So the guard adds that behaviour itself:
every matrix product's result moves by 1 to 4 units in the last place, by an amount fixed by the product's shape.
Two products of the same shape on the same inputs still agree bitwise (the same kernels compute both sides), two of
different shapes do not, as on a processor whose kernels depend on the shape.  A test that passes only because one
processor rounds two shapes alike fails here, where it is written.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys


def _install() -> None:
    """Wrap torch's matrix products (once torch is imported: a process that never imports it stays without it)."""
    import zlib

    import torch
    import torch.nn.functional as F

    def _nudged(out: torch.Tensor, *shapes: object) -> torch.Tensor:
        """``out`` moved by 1-4 ulps (a count fixed by ``shapes``) where it is a finite, non-zero float32."""
        if out.dtype != torch.float32 or out.device.type != "cpu" or out.numel() == 0:
            return out
        ulps = 1 + zlib.crc32(repr(shapes).encode()) % 4
        with torch.no_grad():
            moved = out.detach().clone()
            bits = moved.view(torch.int32)
            ok = torch.isfinite(moved) & (moved != 0)
            bits.add_(torch.where(ok, ulps, 0).to(torch.int32))
        return out + (moved - out).detach() if out.requires_grad else moved

    def _shape(t: object) -> object:
        return tuple(t.shape) if isinstance(t, torch.Tensor) else None

    def _wrap(fn):  # a torch function and its guarded twin
        def guarded(*args, **kwargs):
            out = fn(*args, **kwargs)
            if not isinstance(out, torch.Tensor):
                return out
            return _nudged(out, fn.__name__, *(_shape(a) for a in args), *(_shape(v) for v in kwargs.values()))

        guarded.__name__ = fn.__name__
        guarded.__wrapped__ = fn
        return guarded

    F.linear = _wrap(F.linear)
    for _name in ("matmul", "mm", "bmm", "addmm", "baddbmm", "einsum"):
        setattr(torch, _name, _wrap(getattr(torch, _name)))
    _matmul = torch.Tensor.__matmul__
    torch.Tensor.__matmul__ = lambda self, other: _nudged(_matmul(self, other), "matmul", _shape(self),
                                                           _shape(other))


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_install` right after ``import torch`` completes, whoever imports it first."""

    def find_spec(self, name, path, target=None):  # the finder protocol
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _install()

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("PARTIALVFL_FLOAT_GUARD") == "1":
    sys.meta_path.insert(0, _AfterTorchImport())
