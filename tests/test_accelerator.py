"""Keeping an accelerator busy, checked without one (issue 36).

* the operator counter (``partialvfl.utils.opcount``), the CPU proxy of a GPU's kernel launches, and the profiler
  arithmetic behind the busy fraction;
* a FALSE-VFL batch's shared latent noise drawn once per process, not once per party (the same numbers);
* host-to-device copies that never make the host wait: a training step with the coordinator and the parties on the
  ``meta`` device dispatches no blocking copy (on CUDA a blocking copy synchronises the stream);
* channels-last convolutional blocks, switched on for CUDA only (the CPU keeps its numbers bit for bit).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import make_data
from partialvfl.federation import LocalFederation
from partialvfl.methods.base import get_method
from partialvfl.methods.false_vfl.formulas import after_latent_noise, latent_noise, latent_noise_generator
from partialvfl.nn.blocks import CNNEncoder, ResNet18, TransposedCNNDecoder, for_device, use_channels_last
from partialvfl.nn.stats import feature_gaussian_log_density
from partialvfl.utils.devices import to_device
from partialvfl.utils.opcount import OpCounter, busy_fraction, count_ops, device_activity
from test_contract import TINY

META, CPU = torch.device("meta"), torch.device("cpu")


# ---------------------------------------------------------------------- the counter
def test_the_counter_sorts_operators_by_what_they_ask_of_a_device() -> None:
    a = torch.randn(4, 3)
    with OpCounter() as counter:
        b = a.t()  # a view
        total = (b * 2).sum()  # two kernels
        float(total)  # a readback
        a.to(META)  # a blocking transfer
        a.to(META, non_blocking=True)  # a transfer that does not wait
        a.double()  # a cast (a kernel)
    r = counter.result(1)
    assert r.by_name["t"] == 1 and r.by_name["mul"] == 1 and r.by_name["sum"] == 1
    assert r.readbacks == 1
    assert r.transfers == 2 and r.blocking_transfers == 1
    assert r.casts == 1
    assert r.views == 1
    assert r.kernels == 5  # mul, sum, two copies to meta, the cast
    assert r.ops == r.kernels + r.views + r.readbacks


def test_count_ops_averages_over_steps_after_the_warm_up() -> None:
    calls = []

    def step() -> None:
        calls.append(1)
        torch.ones(3).add_(1) if len(calls) == 1 else torch.ones(3)

    r = count_ops(step, steps=4, warmup=1)
    assert len(calls) == 5 and r.steps == 4
    assert r.ops == 1 and r.by_name == {"ones": 1.0}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 10)), max_size=12), st.integers(1, 60))
def test_busy_fraction_is_the_union_of_the_intervals(spans: list[tuple[int, int]], wall: int) -> None:
    intervals = [(float(a), float(a + n)) for a, n in spans]
    cells = {t for a, b in intervals for t in range(int(a), int(b))}  # unit cells covered, overlaps once
    assert busy_fraction(intervals, float(wall)) == pytest.approx(min(len(cells) / wall, 1.0))


def test_device_activity_counts_kernels_copies_and_launches_per_step() -> None:
    events = [("volta_sgemm", "kernel", 0.0, 10.0), ("elementwise", "kernel", 5.0, 20.0),
              ("Memcpy HtoD (Pinned -> Device)", "memcpy", 30.0, 34.0), ("cudaLaunchKernel", "cpu", 0.0, 1.0),
              ("cudaLaunchKernel", "cpu", 2.0, 3.0), ("aten::mm", "cpu", 0.0, 5.0)]
    a = device_activity(events, steps=2, wall_s=100e-6)
    assert a.kernels == 1 and a.copies == 0.5 and a.launch_calls == 1
    assert a.kernel_s == pytest.approx(12.5e-6)
    assert a.busy_fraction == pytest.approx(0.24)  # [0, 20] and [30, 34] of 100 us
    assert a.as_dict()["busy_percent"] == 24.0


# ---------------------------------------------------------------------- the batch's noise, drawn once
def test_latent_noise_is_the_generators_draw_and_eps_z_follows_it() -> None:
    shape = (3, 5, 4)
    gen = latent_noise_generator(11)
    eps_h, eps_z = torch.randn(shape, generator=gen), torch.randn((3, 5, 2), generator=gen)
    assert torch.equal(latent_noise(11, shape, CPU), eps_h)
    assert torch.equal(latent_noise(11, shape, CPU), eps_h)  # from the memo: the same numbers
    assert torch.equal(torch.randn((3, 5, 2), generator=after_latent_noise(11, shape)), eps_z)
    assert not torch.equal(latent_noise(12, shape, CPU), eps_h)
    assert latent_noise(11, shape, META).device == META


def _stage1(data, device: str = "cpu", name: str = "false-vfl-1", stage: int = 1):
    """A FALSE-VFL step function of ``stage`` (every party and the coordinator on ``device``), cycling over epoch 0."""
    fed = LocalFederation.for_dataset(data, device=device)
    params = dict(TINY[name], pretrain_epochs=0, epochs=0)
    model = get_method(name)("fast", seed=0, device=device, **params).fit(data, federation=fed)
    view, handle = data.coordinator_view(), fed.attach(data, "steps")
    stage = (model._pretrain_stage if stage == 1 else model._train_stage)(view, handle)
    items = list(stage.items(0, stage.rng))
    at = [0]

    def step() -> None:
        fed.transport.new_step()
        stage.step(items[at[0] % len(items)], stage.rng)
        at[0] += 1

    return step


def test_a_stage1_step_draws_the_batchs_noise_once_not_once_per_party() -> None:
    """Three parties and the coordinator share eps_h: one draw of it and one of eps_z per step (was 1 + 3 + 1)."""
    r = count_ops(_stage1(make_data(96, seed=0, prefix="tr")), steps=3)
    assert r.by_name["randn"] == 2


# ---------------------------------------------------------------------- copies that do not wait
def test_to_device_keeps_cpu_tensors_and_queues_copies_elsewhere() -> None:
    t = torch.arange(5)
    assert to_device(t, CPU) is t
    with OpCounter() as counter:
        out = to_device(t, META)
    assert out.device == META and counter.result(1).transfers == 1 and counter.result(1).blocking_transfers == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch")
def test_to_device_on_cuda_copies_from_pinned_memory() -> None:
    t = torch.randn(1000)
    out = to_device(t, torch.device("cuda"))
    t.zero_()  # the source may change at once: the copy was staged in pinned memory
    torch.cuda.synchronize()
    assert out.is_cuda and not torch.equal(out.cpu(), t)


@pytest.mark.parametrize(("name", "stage"), [("false-vfl-1", 1), ("false-vfl-2", 1), ("false-vfl-1", 2)])
def test_a_training_step_on_a_device_never_waits_for_a_copy(name: str, stage: int) -> None:
    """Coordinator and parties on meta: every host-to-device copy of a step is non-blocking (row positions, noise,
    masks, labels), so on a GPU no copy drains the queue (before: 14 blocking copies per FALSE-VFL-I stage-1 step)."""
    r = count_ops(_stage1(make_data(96, seed=0, prefix="tr"), "meta", name, stage), steps=2)
    assert r.transfers > 0
    assert r.blocking_transfers == 0


def test_a_laser_vfl_step_on_a_device_never_waits_for_a_copy() -> None:
    data = make_data(96, seed=0, prefix="tr")
    model = get_method("laser-vfl")("fast", seed=0, device="meta", **dict(TINY["laser-vfl"], epochs=0,
                                                                            pretrain=False))
    model.fit(data, federation=LocalFederation.for_dataset(data, device="meta"))
    view, fed = data.coordinator_view(), model.federation_
    handle = fed.attach(data, "steps")
    batches = list(model._batches(view, model._training_rows(view), np.random.default_rng(0)))

    def step(at: list = [0]) -> None:  # noqa: B006 - the position
        fed.transport.new_step()
        model._train_step(view, handle, batches[at[0] % len(batches)], np.random.default_rng(at[0]))
        at[0] += 1

    r = count_ops(step, steps=3)
    assert r.transfers > 0 and r.blocking_transfers == 0


# ---------------------------------------------------------------------- channels last
def _conv_blocks() -> list[tuple[torch.nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    return [(ResNet18((14, 7), 6, width=4), torch.randn(5, 98)), (CNNEncoder((2, 7, 7), 6), torch.randn(5, 98)),
            (TransposedCNNDecoder(6, (14, 7)), torch.randn(2, 5, 6))]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_conv_blocks_go_channels_last_on_cuda_only(index: int) -> None:
    module, x = _conv_blocks()[index]
    module.eval()  # batch-norm with running statistics: the same function in both layouts
    before = module(x)
    assert for_device(module, CPU) is module and not any(
        p.dim() == 4 and not p.is_contiguous() for p in module.parameters())
    seen = []
    hooks = [m.register_forward_pre_hook(lambda _, a: seen.append(a[0].is_contiguous(
        memory_format=torch.channels_last))) for m in module.modules()
        if isinstance(m, torch.nn.Conv2d | torch.nn.ConvTranspose2d)]
    for_device(module, torch.device("cuda"))  # only the layout changes: no GPU needed to check it
    after = module(x)
    for h in hooks:
        h.remove()
    weights = [p for p in module.parameters() if p.dim() == 4]
    assert weights and all(p.is_contiguous(memory_format=torch.channels_last) for p in weights)
    assert seen and all(seen)
    assert after.shape == before.shape
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-4)


def test_a_channels_last_state_loads_into_the_default_layout_unchanged() -> None:
    """A model fitted on a GPU (channels last) predicts on a CPU as the same weights in the default layout do."""
    module, x = _conv_blocks()[0]
    module.eval()
    reference = module(x)
    gpu_like = use_channels_last(copy.deepcopy(module))
    fresh = ResNet18((14, 7), 6, width=4).eval()
    fresh.load_state_dict(gpu_like.state_dict())
    assert torch.equal(fresh(x), reference)


# ---------------------------------------------------------------------- bf16: no cast the precision does not need
def test_the_decoder_likelihood_and_its_gradient_stay_float32_under_bf16_autocast() -> None:
    """The backward pass of a party's ``decode_grad`` runs inside its bf16 autocast: the hand-written likelihood's
    gradient must not drop to bfloat16 there (it did: two casts and a bfloat16 matmul per party and step)."""
    torch.manual_seed(0)
    x, mean, logvar = torch.randn(5, 7), torch.randn(3, 5, 7), 0.3 * torch.randn(7)
    grad = torch.randn(3, 5)

    def run(autocast: bool) -> tuple[torch.Tensor, ...]:
        m, lv = mean.clone().requires_grad_(), logvar.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = feature_gaussian_log_density(x, m, lv)
            with OpCounter() as counter:
                out.backward(grad)
        return out, m.grad, lv.grad, torch.tensor(counter.result(1).casts)

    plain, under_bf16 = run(False), run(True)
    for a, b in zip(plain, under_bf16):
        assert torch.equal(a, b)


def test_the_counter_tells_the_optimisers_operators_apart() -> None:
    p = torch.nn.Parameter(torch.randn(3, 4))
    opt = torch.optim.Adam([p], lr=0.1, fused=True)
    p.grad = torch.randn(3, 4)
    opt.step()  # its state exists: the next step is the fused kernel and the step counts
    with OpCounter() as counter:
        (p * 2).sum()
        opt.step()
    r = counter.result(1)
    assert r.by_name["_fused_adam_"] == 1
    assert r.optimizer == r.by_name["_fused_adam_"] + r.by_name["_foreach_add_"]  # the profiler marks are outside
    assert r.ops - r.optimizer == 2 + r.by_name["_record_function_enter_new"] + r.by_name["_record_function_exit"]
