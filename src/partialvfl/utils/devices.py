"""Where tensors live: the ``--device`` option, moving message tensors, bf16 autocast, and the meta-device check.

The rules (design.md: "a tensor is created on the device of the data or module it meets; wire tensors are CPU"):

* :func:`resolve_device` reads ``auto | cpu | cuda | cuda:N | mps`` (``auto``: the first CUDA GPU if torch sees
  one, else the CPU; MPS only when asked for) and refuses a device this machine does not have, naming the option;
* a party program and the coordinator each run on their own device; their modules are built (seeded) on the CPU and
  then moved, so the initial weights are the same numbers on every device;
* message tensors cross as CPU tensors (the gRPC wire frames them with safetensors); on arrival the *floating-point*
  tensors move to the receiver's device, while integer and boolean tensors (row positions, flags) stay on the CPU,
  where the receiver looks them up in its own tables.  In one process a tensor goes straight to the receiver's
  device (no CPU hop when both sides share one);
* random draws come from seeded CPU generators and are moved to the device, so a seed gives the same noise on
  every device (what is still not bitwise across devices: docs/benchmarks.md, "Devices");
* :func:`host`, :func:`to_numpy`, :func:`scalar` and :func:`all_finite` are how methods read values back.  On the
  ``meta`` device (tensors with shapes and no values) they return placeholders (ones, zeros), so that a whole fit
  runs there: the CPU-only device check (``tests/test_devices.py``) builds parameters and data on ``meta``, where
  any tensor created without the right device fails loudly.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["DEVICE_FORMS", "PRECISIONS", "DeviceError", "all_finite", "autocast", "check_precision", "describe",
           "gpu_count", "host", "move", "move_message", "resolve_device", "scalar", "table_tensor", "to_device",
           "to_numpy", "strict_devices", "use_deterministic"]

#: the values ``--device`` takes
DEVICE_FORMS = "auto | cpu | cuda | cuda:N | mps"
#: the values ``--precision`` takes: float32, or bfloat16 autocast for the matmuls of modules
PRECISIONS = ("fp32", "bf16")


class DeviceError(ValueError):
    """A device (or precision) that is not a form we know, or that this machine does not have."""


def resolve_device(spec: str | torch.device | None = "cpu", *, what: str = "--device") -> torch.device:
    """The torch device ``spec`` names (``None`` is the CPU); ``what`` names the option in errors."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    text = "cpu" if spec is None else str(spec).strip().lower()
    if text == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if text in ("cpu", "meta"):  # meta: the device check's device (no values)
        return torch.device(text)
    if text == "cuda" or text.startswith("cuda:"):
        index = text.partition(":")[2]
        if index and not index.isdigit():
            raise DeviceError(f"{what} {spec}: a CUDA device is cuda or cuda:N with N a GPU index")
        if not torch.cuda.is_available():
            built = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise DeviceError(f"{what} {spec}: {built} (torch {torch.__version__}); use --device cpu or auto")
        n = torch.cuda.device_count()
        if index and int(index) >= n:
            raise DeviceError(f"{what} {spec}: this machine has {n} CUDA GPU(s), cuda:0..cuda:{n - 1}")
        return torch.device(text)
    if text == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise DeviceError(f"{what} mps: Apple's MPS backend is not available on this machine")
        return torch.device("mps")
    raise DeviceError(f"{what} {spec!r}: choose one of {DEVICE_FORMS}")


def check_precision(precision: str, *, what: str = "--precision") -> str:
    """``precision`` if it is one of :data:`PRECISIONS`."""
    if precision not in PRECISIONS:
        raise DeviceError(f"{what} {precision!r}: choose one of {', '.join(PRECISIONS)}")
    return precision


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """bf16 autocast on ``device`` for ``precision == 'bf16'`` (matmuls and convolutions in bfloat16, reductions
    and the log-densities in float32); nothing for ``fp32`` or the meta device."""
    if precision == "fp32" or device.type == "meta":
        yield
        return
    # no weight-cast cache: a context may span optimiser steps (a whole fit), and cached casts would be stale
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=False):
        yield


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    """A CPU stand-in for a meta tensor: its shape and dtype, ones (floats) or zeros (integers, flags)."""
    if t.is_floating_point():
        return torch.ones(t.shape, dtype=t.dtype)
    return torch.zeros(t.shape, dtype=t.dtype)


def host(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached on the CPU (a placeholder for a meta tensor)."""
    t = t.detach()
    if t.device.type == "meta":
        return _placeholder(t)
    return t.cpu()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """``t`` as a numpy array (CPU copy where needed; float32 for a bfloat16 or float16 tensor, which numpy lacks;
    ones/zeros for a meta tensor)."""
    t = host(t)
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()


def scalar(t: torch.Tensor | float) -> float:
    """A Python float of a one-element tensor (0.0 on the meta device)."""
    if not isinstance(t, torch.Tensor):
        return float(t)
    if t.device.type == "meta":
        return 0.0
    return float(t.detach())


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite (``True`` on the meta device, which holds no values)."""
    if t.device.type == "meta":
        return True
    return bool(torch.isfinite(t).all())


def move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: itself if it is there, through a placeholder if it is a meta tensor."""
    if t.device == device:
        return t
    if t.device.type == "meta":
        return _placeholder(t).to(device)
    return t.to(device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor ``t`` (a noise draw, row positions, labels) on ``device`` without making the host wait.

    Itself on the CPU.  To a GPU the copy is queued from pinned (page-locked) memory with ``non_blocking=True``: a
    plain ``.to("cuda")`` from pageable memory synchronises the stream, so every such copy in a step would drain the
    GPU's queue and leave it idle while Python prepares the next kernels.  The pinned staging copy is torch's (its
    caching host allocator keeps the block until the copy has run), so ``t`` may change afterwards.  Any other
    device (``meta``) gets a plain non-blocking copy.
    """
    if t.device == device or t.device.type != "cpu":
        return move(t, device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=True)


def move_message(tensors: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A message's tensors as they arrive at a program on ``device``: floating-point tensors on ``device``, integer
    and boolean tensors (row positions, flags) on the CPU."""
    cpu = torch.device("cpu")
    return {k: move(t, device if t.is_floating_point() else cpu) for k, t in tensors.items()}


def table_tensor(features: np.ndarray, device: torch.device) -> torch.Tensor:
    """A party's feature table as one float32 tensor on ``device`` (moved once; rows are gathered from it).

    On the CPU the tensor shares the array's memory (read only: the table is never written through it).
    """
    arr = np.asarray(features)
    if device.type == "meta":
        return torch.empty(arr.shape, dtype=torch.float32, device=device)
    with warnings.catch_warnings():  # a read-only table: shared, never written
        warnings.simplefilter("ignore", UserWarning)
        t = torch.as_tensor(arr, dtype=torch.float32)
    return t if device.type == "cpu" else t.to(device)


def use_deterministic(on: bool = True) -> None:
    """Ask torch for deterministic algorithms (``torch.use_deterministic_algorithms``), setting the cuBLAS
    workspace (``CUBLAS_WORKSPACE_CONFIG=:4096:8``) it needs on CUDA unless the environment sets one; slower on GPUs,
    and an operation without a deterministic version then raises instead of running."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)


def describe(device: torch.device) -> str:
    """``cpu``, ``cuda:0 (NVIDIA H100 80GB HBM3)``: the device as reports print it."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


def gpu_count() -> int:
    """CUDA GPUs torch sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ---------------------------------------------------------------------- the device check's strict mode
#: ops whose job is to move or copy between devices
_MOVES = ("_to_copy", "copy_", "to", "lift_fresh", "lift_fresh_copy", "_copy_from", "_copy_from_and_resize")
#: indexing ops, which accept CPU index tensors on any device (as CUDA does)
_INDEXING = ("index", "index_put", "index_put_", "_index_put_impl_")


def _strict_mode() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class StrictDevices(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if name not in _MOVES:
                skip_indices = name in _INDEXING
                devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                           and not (t.device.type == "cpu" and (t.dim() == 0 or (
                               skip_indices and not t.is_floating_point())))}
                if len(devices) > 1:
                    raise RuntimeError(f"aten.{name}: tensors on {sorted(map(str, devices))}: a tensor was created "
                                       "without the device of the tensors it meets")
            return func(*args, **kwargs)

    return StrictDevices


@contextlib.contextmanager
def strict_devices() -> Iterator[None]:
    """Refuse every torch operation whose tensors sit on different devices (a CPU scalar, and CPU indices of an
    indexing operation, excepted, as on CUDA), also where a meta kernel would not check: the device check's mode
    (the meta kernels of matmuls and convolutions accept a CPU operand)."""
    with _strict_mode()():
        yield
