"""The thread policy: one thread for small steps, the core share for large ones, workers never oversubscribe,
OpenMP's idle threads sleep, ``--threads`` parsed with plain errors, and the methods' step estimates."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialvfl.methods import get_method
from partialvfl.utils.threads import (
    SMALL_STEP_FLOPS,
    choose_threads,
    configure_openmp,
    mlp_flops,
    resolve_threads,
    step_flops_of,
    thread_budget,
    use_threads,
)

CPU_GRID = dict(encoder="mlp", decoder="mlp", encoder_hidden=[128, 128], decoder_hidden=[128, 128],
                global_hidden=[128, 128], mask_hidden=[128, 128], pretrain_batch_size=256, d_h=196, d_z=32)


@given(st.integers(1, 64), st.integers(1, 64))
def test_workers_never_oversubscribe_the_cores(workers: int, cores: int) -> None:
    budget = thread_budget(workers, cores)
    assert budget >= 1
    assert workers * budget <= max(cores, workers)  # at least one thread each, never more than the cores allow


def test_small_or_unknown_steps_get_one_thread_large_ones_the_budget() -> None:
    assert choose_threads(None, 8) == 1
    assert choose_threads(SMALL_STEP_FLOPS / 2, 8) == 1
    assert choose_threads(SMALL_STEP_FLOPS * 2, 8) == 8
    assert choose_threads(SMALL_STEP_FLOPS * 2, 1) == 1


def test_threads_option_is_a_positive_number_or_auto() -> None:
    assert resolve_threads("auto", None, 4) == 1
    assert resolve_threads(None, SMALL_STEP_FLOPS * 10, 4) == 4
    assert resolve_threads("3", None, 4) == 3  # an explicit number wins, whatever the estimate
    for bad in ("0", "-2", "many"):
        with pytest.raises(ValueError, match="threads must be a positive integer or 'auto'"):
            resolve_threads(bad, None, 4)


def test_openmp_waits_passively_unless_the_environment_says_otherwise() -> None:
    env: dict[str, str] = {}
    configure_openmp(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    configure_openmp(env)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE"


def test_use_threads_restores_the_previous_number() -> None:
    before = torch.get_num_threads()
    with use_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_mlp_flops_counts_two_per_multiply_add() -> None:
    assert mlp_flops([3, 4, 2], rows=5) == 2 * 5 * (3 * 4 + 4 * 2)


def test_step_estimates_put_the_cpu_grid_above_and_small_models_below_the_threshold() -> None:
    fvl1, fvl2 = get_method("false-vfl-1"), get_method("false-vfl-2")
    grid = step_flops_of(fvl1, CPU_GRID, [(98,)] * 8)
    assert grid is not None and grid > SMALL_STEP_FLOPS  # FashionMNIST cpu grid: ~9.5 GFLOP per stage-1 step
    assert step_flops_of(fvl2, CPU_GRID, [(98,)] * 8) > grid  # II adds the indicators on every row
    fast = fvl1("fast").resolve_params("digits")
    assert step_flops_of(fvl1, fast, [(16,)] * 4) < SMALL_STEP_FLOPS
    laser = dict(encoder_hidden=[128, 128], latent_dim=128, batch_size=128)
    assert step_flops_of(get_method("laser-vfl"), laser, [(196,)] * 4) < SMALL_STEP_FLOPS
    # convolutional parties: no estimate (one thread)
    assert step_flops_of(fvl1, dict(CPU_GRID, encoder="cnn"), [(14, 7)] * 8) is None
    assert step_flops_of(get_method("laser-vfl"), {}, [(14, 7)] * 8) is None
    assert step_flops_of(object, {}, [(3,)]) is None  # a method without an estimate


def test_cli_fit_uses_and_reports_the_threads_it_was_given(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from partialvfl.cli import main

    args = ["fit", "--dataset", "digits", "--labels", "200", "--aligned", "50", "--method", "vanilla-vfl",
            "--epochs", "1", "--max-train", "400", "--max-test", "100", "--out", str(tmp_path / "m"), "--quiet"]
    assert main([*args, "--threads", "1"]) == 0
    assert "(1 torch thread)" in capsys.readouterr().err
    assert main([*args, "--threads", "none"]) == 2
    assert "threads must be a positive integer or 'auto'" in capsys.readouterr().err
