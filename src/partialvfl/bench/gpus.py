"""Grids on GPUs: which device each local worker uses, and what a Ray task asks the cluster for.

``bench --device cuda --fits-per-gpu N`` runs N fits side by side on every GPU this machine has (``--device cuda:K``:
on GPU K only): ``N x GPUs`` worker processes (unless ``--workers`` says otherwise), worker ``i`` on GPU
``i mod GPUs``.  Each worker still gets a CPU thread budget of ``cores // workers`` (the thread policy of CPU workers
is unchanged: :func:`~partialvfl.utils.threads.thread_budget`).  On Ray each fit is a task asking for
``num_gpus = 1 / N`` (fractional GPUs: N tasks share one GPU) beside its CPUs; Ray makes the GPU it picks the
task's ``cuda``.

Everything here is plain arithmetic on device names and counts, so it is tested on machines without a GPU.
"""

from __future__ import annotations

__all__ = ["is_cuda", "plan_workers", "ray_resources"]


def is_cuda(device: str, gpus: int) -> bool:
    """Whether ``device`` (a ``--device`` value) puts fits on CUDA on a machine with ``gpus`` GPUs."""
    d = device.strip().lower()
    return d == "cuda" or d.startswith("cuda:") or (d == "auto" and gpus > 0)


def _check_fits_per_gpu(device: str, fits_per_gpu: int | None, cuda: bool) -> int:
    if fits_per_gpu is None:
        return 1
    if fits_per_gpu < 1:
        raise ValueError(f"--fits-per-gpu must be at least 1, got {fits_per_gpu}")
    if not cuda:
        raise ValueError(f"--fits-per-gpu is for fits on GPUs (--device cuda, cuda:N, or auto on a machine with a "
                         f"GPU); --device {device} runs on the CPU")
    return fits_per_gpu


def plan_workers(device: str, fits_per_gpu: int | None, workers: int | None, *, gpus: int,
                 cpu_workers: int) -> tuple[int, list[str]]:
    """(number of local workers, the device of each): ``cpu_workers`` (the CPU default, usually the cores) on the
    CPU; on CUDA ``fits_per_gpu`` (default 1) per GPU, round-robin over the GPUs (or over the one named)."""
    cuda = is_cuda(device, gpus)
    per_gpu = _check_fits_per_gpu(device, fits_per_gpu, cuda)
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if not cuda:
        n = workers or cpu_workers
        return n, [device] * n
    if gpus < 1:
        raise ValueError(f"--device {device}: no CUDA GPU is visible to torch on this machine")
    d = device.strip().lower()
    if d.startswith("cuda:"):
        index = int(d.partition(":")[2])
        if index >= gpus:
            raise ValueError(f"--device {device}: this machine has {gpus} CUDA GPU(s), cuda:0..cuda:{gpus - 1}")
        indices = [index]
    else:
        indices = list(range(gpus))
    n = workers or per_gpu * len(indices)
    return n, [f"cuda:{indices[i % len(indices)]}" for i in range(n)]


def ray_resources(device: str, fits_per_gpu: int | None, threads: int) -> dict[str, float]:
    """What one fit's Ray task asks for: ``num_cpus`` (its torch threads) and, for ``--device cuda``, ``num_gpus``
    ``1 / fits_per_gpu`` (Ray's fractional GPUs).  ``auto`` on Ray means CUDA: the cluster's nodes, not this
    machine, have the GPUs; ``cuda:N`` is refused (Ray picks the GPU)."""
    d = device.strip().lower()
    if d.startswith("cuda:"):
        raise ValueError(f"--device {device} with --executor ray: Ray assigns the GPUs; use --device cuda")
    cuda = d in ("cuda", "auto") and (d == "cuda" or fits_per_gpu is not None)
    per_gpu = _check_fits_per_gpu(device, fits_per_gpu, cuda)
    out: dict[str, float] = {"num_cpus": float(max(1, threads))}
    if cuda:
        out["num_gpus"] = 1.0 / per_gpu
    return out
