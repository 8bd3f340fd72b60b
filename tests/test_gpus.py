"""Grids on GPUs (``partialvfl.bench.gpus``), tested without a GPU: the workers' devices, the Ray resource request,
the flags' checks, and the ``device`` column of the store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import partialvfl.bench.ray_executor as ray_executor
from partialvfl.bench.gpus import plan_workers, ray_resources
from partialvfl.bench.runner import run_grid
from partialvfl.bench.store import ResultStore
from test_bench import _grid_file, dummy_dir  # noqa: F401 - the dummy method's module (a fixture)


def test_cpu_workers_are_as_before() -> None:
    assert plan_workers("cpu", None, None, gpus=0, cpu_workers=2) == (2, ["cpu", "cpu"])
    assert plan_workers("auto", None, None, gpus=0, cpu_workers=2) == (2, ["auto", "auto"])
    assert plan_workers("cpu", None, 3, gpus=4, cpu_workers=2) == (3, ["cpu"] * 3)


def test_gpu_workers_share_the_gpus_round_robin() -> None:
    assert plan_workers("cuda", 3, None, gpus=2, cpu_workers=16) == (6, ["cuda:0", "cuda:1"] * 3)
    assert plan_workers("cuda", None, None, gpus=2, cpu_workers=16) == (2, ["cuda:0", "cuda:1"])
    assert plan_workers("auto", 2, None, gpus=1, cpu_workers=16) == (2, ["cuda:0", "cuda:0"])
    assert plan_workers("cuda:1", 2, None, gpus=2, cpu_workers=16) == (2, ["cuda:1", "cuda:1"])
    assert plan_workers("cuda", 4, 3, gpus=2, cpu_workers=16) == (3, ["cuda:0", "cuda:1", "cuda:0"])


@pytest.mark.parametrize("args,message", [
    (("cpu", 2, None, 0), "--fits-per-gpu is for fits on GPUs .* --device cpu runs on the CPU"),
    (("auto", 2, None, 0), "--fits-per-gpu is for fits on GPUs"),
    (("cuda", 0, None, 1), "--fits-per-gpu must be at least 1, got 0"),
    (("cuda", None, None, 0), "--device cuda: no CUDA GPU is visible"),
    (("cuda:3", 1, None, 2), r"--device cuda:3: this machine has 2 CUDA GPU\(s\), cuda:0..cuda:1"),
    (("cuda", 1, 0, 1), "--workers must be at least 1"),
])
def test_gpu_flags_are_refused_in_plain_words(args: tuple, message: str) -> None:
    device, per_gpu, workers, gpus = args
    with pytest.raises(ValueError, match=message):
        plan_workers(device, per_gpu, workers, gpus=gpus, cpu_workers=2)


def test_ray_asks_for_fractional_gpus() -> None:
    assert ray_resources("cuda", 4, 1) == {"num_cpus": 1.0, "num_gpus": 0.25}
    assert ray_resources("cuda", None, 2) == {"num_cpus": 2.0, "num_gpus": 1.0}
    assert ray_resources("auto", 2, 1) == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert ray_resources("cpu", None, 1) == ray_resources("auto", None, 1) == {"num_cpus": 1.0}
    with pytest.raises(ValueError, match="Ray assigns the GPUs; use --device cuda"):
        ray_resources("cuda:1", 2, 1)
    with pytest.raises(ValueError, match="--fits-per-gpu is for fits on GPUs"):
        ray_resources("cpu", 2, 1)


class _Ref:
    def __init__(self, value: Any) -> None:
        self.value = value


class _FakeRay:
    """Enough of ``ray`` to see what the executor asks for; tasks run here, in turn."""

    def __init__(self) -> None:
        self.asks: dict[str, Any] = {}
        self.runs: list[dict[str, Any]] = []

    def is_initialized(self) -> bool:
        return True

    def remote(self, **asks: Any) -> Any:
        self.asks = asks

        def wrap(fn: Any) -> Any:
            fake = self

            class Task:
                @staticmethod
                def remote(*args: Any) -> Any:
                    fake.runs.append(args[-1])
                    return _Ref(fn(*args))

            return Task

        return wrap

    def wait(self, pending: list, num_returns: int, timeout: float) -> tuple[list, list]:
        return pending[:1], pending[1:]

    def get(self, ref: Any) -> Any:
        return ref.value


def test_the_ray_executor_requests_a_gpu_fraction_and_runs_on_cuda(tmp_path: Path, dummy_dir: Path,  # noqa: F811
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeRay()
    monkeypatch.setattr(ray_executor, "_ray", lambda: fake)
    grid = _grid_file(tmp_path / "g.toml", seeds="[0]")
    summary = run_grid(grid, tmp_path / "store", executor="ray", device="cuda", fits_per_gpu=4, progress=False)
    assert fake.asks == {"max_retries": 0, "num_cpus": 1.0, "num_gpus": 0.25}
    assert {r["device"] for r in fake.runs} == {"cuda"}
    if not torch.cuda.is_available():  # the fits really asked for CUDA
        assert len(summary.failed) == 2 and "device cuda" in summary.failed[0][1]


def test_the_store_records_the_device(tmp_path: Path, dummy_dir: Path) -> None:  # noqa: F811
    grid = _grid_file(tmp_path / "g.toml", seeds="[0]")
    assert run_grid(grid, tmp_path / "store", workers=1, progress=False, device="cpu").ok
    with ResultStore(tmp_path / "store") as s:
        assert {r["device"] for r in s.rows()} == {"cpu"}


def test_bench_refuses_bad_device_flags_naming_them(tmp_path: Path, dummy_dir: Path,  # noqa: F811
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from partialvfl.cli import main

    grid = str(_grid_file(tmp_path / "g.toml", seeds="[0]"))
    args = ["bench", "--config", grid, "--store", str(tmp_path / "s"), "--quiet"]
    assert main([*args, "--device", "cpu", "--fits-per-gpu", "2"]) == 2
    assert "--fits-per-gpu is for fits on GPUs" in capsys.readouterr().err
    assert main([*args, "--precision", "bf16", "--device", "cpu", "--workers", "1"]) == 0
    if not torch.cuda.is_available():
        assert main([*args, "--device", "cuda"]) == 2
        assert "--device cuda: " in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # the form is checked while parsing
        main([*args, "--device", "gpu0"])
    assert e.value.code == 2
