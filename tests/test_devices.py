"""Devices on a CPU-only machine: the ``device`` option, the meta-device check, moves, bf16, GPU-saved models.

The meta-device check: every method fits and predicts with its parameters and data on the ``meta`` device (tensors
with shapes and no values; reading one back gives placeholders, :mod:`partialvfl.utils.devices`).  A tensor created
on the CPU and combined with a meta tensor fails loudly, as it would on a GPU, so a forgotten ``device=`` fails
here without a GPU; :func:`~partialvfl.utils.devices.strict_devices` checks every operation as well (the meta
kernels of matmuls and convolutions accept a CPU operand).  The coordinator and the parties are checked on meta
together and each alone (the other on the CPU: the transports' moves in both directions).  The planted-mistake
tests show the check catching a tensor created without the device, on the coordinator's side and on a party's.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import partialvfl.federation.runtime.party as party_module
from helpers import make_data
from partialvfl.federation import LocalFederation
from partialvfl.federation.runtime.party import PartyRuntime
from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.methods.base import VFLMethod, get_method
from partialvfl.methods.registry import method_names
from partialvfl.utils.devices import (
    DeviceError,
    all_finite,
    check_precision,
    host,
    move_message,
    resolve_device,
    scalar,
    strict_devices,
    to_numpy,
)
from test_contract import TINY, gpu_atol

METHODS = method_names()
META, CPU = torch.device("meta"), torch.device("cpu")
#: (coordinator, parties): both on meta, then each alone with the other on the CPU
PLACEMENTS = [("meta", "meta"), ("meta", "cpu"), ("cpu", "meta")]
HAS_CUDA = torch.cuda.is_available()
#: the meta-device check fits with TINY's parameters in batches of half the training rows: a meta operation costs
#: the same whatever its size (torch's meta kernels: Python, ~0.5 ms each), so a fit costs its number of steps, and
#: two batches an epoch (a full one and the rest) still run every stage, every epoch and every kind of step
META_BATCH = 48


def meta_params(name: str) -> dict:
    """TINY's parameters of ``name`` with every batch size :data:`META_BATCH`."""
    return {k: META_BATCH if k.endswith("batch_size") else v for k, v in TINY[name].items()}


@pytest.fixture(scope="module")
def train():
    return make_data(96, seed=0, prefix="tr")


@pytest.fixture(scope="module")
def test_data():
    return make_data(40, seed=1, prefix="te")


def fit_on(name: str, data, coordinator: str, parties: str, **params) -> tuple[VFLMethod, LocalFederation]:
    fed = LocalFederation.for_dataset(data, device=parties)
    with warnings.catch_warnings(), strict_devices():  # loading CPU placeholders into meta modules: a no-op
        warnings.simplefilter("ignore", UserWarning)
        model = get_method(name)("fast", seed=3, device=coordinator, **{**meta_params(name), **params}).fit(
            data, federation=fed)
    return model, fed


def parameter_devices(model: VFLMethod, fed: LocalFederation) -> tuple[set[str], set[str]]:
    """The devices of the coordinator's and of the parties' parameters."""
    coord = {str(p.device) for m in model._coordinator_modules().values() for p in m.parameters()}
    parties = set()
    for rt in fed.runtimes:
        state = rt.program.__dict__
        for value in state.values():
            if isinstance(value, torch.nn.Module):
                parties |= {str(p.device) for p in value.parameters()}
            elif isinstance(value, dict):
                parties |= {str(p.device) for v in value.values() if isinstance(v, torch.nn.Module)
                            for p in v.parameters()}
    return coord, parties


# ---------------------------------------------------------------------- the option
def test_resolve_device_forms_and_plain_errors() -> None:
    assert resolve_device("cpu") == CPU and resolve_device(None) == CPU and resolve_device(" CPU ") == CPU
    assert resolve_device("auto") == (torch.device("cuda") if HAS_CUDA else CPU)
    with pytest.raises(DeviceError, match=r"--device 'gpu': choose one of auto \| cpu \| cuda \| cuda:N \| mps"):
        resolve_device("gpu")
    with pytest.raises(DeviceError, match="--device cuda:x: a CUDA device is cuda or cuda:N"):
        resolve_device("cuda:x")
    with pytest.raises(DeviceError, match="--device cuda:99: this machine has|--device cuda:99: .*CUDA"):
        resolve_device("cuda:99")
    if not HAS_CUDA:
        with pytest.raises(DeviceError, match="--device cuda: .*use --device cpu or auto"):
            resolve_device("cuda")
    if not torch.backends.mps.is_available():
        with pytest.raises(DeviceError, match="--device mps: Apple's MPS backend is not available"):
            resolve_device("mps")
    assert check_precision("bf16") == "bf16"
    with pytest.raises(DeviceError, match="--precision 'fp16': choose one of fp32, bf16"):
        check_precision("fp16")


def test_method_and_load_refuse_a_bad_device_naming_it(train, tmp_path) -> None:
    with pytest.raises(DeviceError, match="^device 'tpu'"):
        get_method("local")("fast", device="tpu")
    with pytest.raises(DeviceError, match="^precision 'int8'"):
        get_method("local")("fast", precision="int8")
    model = get_method("local")("fast", seed=0, **TINY["local"]).fit(train)
    model.save(tmp_path / "m")
    with pytest.raises(DeviceError, match="^device 'tpu'"):  # the caller's mistake, not a broken model file
        VFLMethod.load(tmp_path / "m", device="tpu")


def test_messages_arrive_floats_on_the_device_indices_on_the_cpu() -> None:
    out = move_message({"h": torch.ones(2, 3), "rows": torch.arange(2), "flag": torch.ones(2, dtype=torch.bool)},
                       META)
    assert out["h"].device == META and out["rows"].device == CPU and out["flag"].device == CPU
    back = move_message({"h": out["h"]}, CPU)["h"]  # a meta tensor leaves as a placeholder of its shape
    assert back.device == CPU and back.shape == (2, 3)
    m = torch.ones(3, device=META)
    assert scalar(m.sum()) == 0.0 and all_finite(m) and to_numpy(m).shape == (3,) and host(m).device == CPU
    assert to_numpy(torch.ones(2, dtype=torch.bfloat16)).dtype == np.float32  # numpy has no bfloat16


def test_a_party_computes_on_its_device_and_replies_on_the_cpu(train) -> None:
    rt = PartyRuntime(0, "bank", device="meta")
    rt.attach("d", train.party(0))
    t = rt.table("d")
    assert t.device == META and t.shape == train.party(0).features.shape and rt.table("d") is t  # moved once
    reply = rt.depart(party_module.RUNTIME_MESSAGES["ping"], Reply({"x": torch.ones(2, device=META)}))
    assert reply.tensors["x"].device == CPU
    assert rt.arrive(Request("k", {"x": torch.ones(2), "rows": torch.arange(2)})).tensors["x"].device == META


def test_party_data_moves_to_the_device_once_per_dataset_not_per_step(train, monkeypatch) -> None:
    calls = []
    real = party_module.table_tensor
    monkeypatch.setattr(party_module, "table_tensor", lambda f, d: calls.append(d) or real(f, d))
    model = get_method("false-vfl-1")("fast", seed=3, **TINY["false-vfl-1"]).fit(train)
    assert model.federation_.transport.step > 5 * train.n_parties  # many steps...
    assert len(calls) == train.n_parties  # ...one move of each party's table for the whole fit


# ---------------------------------------------------------------------- the meta-device check
@pytest.mark.parametrize("coordinator,parties", PLACEMENTS)
@pytest.mark.parametrize("name", METHODS)
@pytest.mark.slow
def test_every_method_trains_and_predicts_on_the_meta_device(name: str, coordinator: str, parties: str, train,
                                                             test_data) -> None:
    model, fed = fit_on(name, train, coordinator, parties)
    coord, party = parameter_devices(model, fed)
    assert coord == {coordinator} and party == {parties}  # the check ran where it says
    with strict_devices():
        proba = model.predict_proba(test_data)
    assert proba.shape == (test_data.n_samples, 3) and np.isfinite(proba).all()


@pytest.mark.parametrize("coordinator,parties", PLACEMENTS)
@pytest.mark.parametrize("name", ["laser-vfl", "vanilla-vfl"])
@pytest.mark.slow
def test_generative_initialisation_trains_on_the_model_device(name: str, coordinator: str, parties: str, train,
                                                             test_data) -> None:
    """``pretrain_kind="false-vfl"`` fits FALSE-VFL's stage 1 inside the fit: on the model's device, and the
    supervised stage's replies still arrive there (the stage-1 fit once left the transport on the CPU: a GPU grid's
    LASER-VFL + FALSE-VFL init fits all failed)."""
    model, fed = fit_on(name, train, coordinator, parties, pretrain=True, pretrain_kind="false-vfl",
                        pretrain_epochs=1, generative={"decoder_hidden": [8], "global_hidden": [8], "d_z": 2})
    coord, party = parameter_devices(model, fed)
    assert coord == {coordinator} and party == {parties}
    assert model.generative_["epochs"] == 1
    with strict_devices():
        proba = model.predict_proba(test_data)
    assert proba.shape == (test_data.n_samples, 3)


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.slow
def test_meta_check_catches_a_coordinator_tensor_created_without_the_device(name: str, train, monkeypatch) -> None:
    """The planted mistake: the coordinator's index and label tensors created on the CPU (``device=`` forgotten)."""
    monkeypatch.setattr(VFLMethod, "_tensor", lambda self, data, dtype=None: torch.as_tensor(data, dtype=dtype))
    with pytest.raises((RuntimeError, NotImplementedError), match="device|meta"):
        fit_on(name, train, "meta", "meta")
    fit_on(name, train, "cpu", "cpu")  # the same mistake is invisible on the CPU alone


@pytest.mark.parametrize("name", ["false-vfl-1", "vanilla-vfl", "x-vfl", "fedhssl"])  # one per party program
def test_meta_check_catches_a_party_tensor_created_without_the_device(name: str, train, monkeypatch) -> None:
    """The planted mistake: a party's features gathered on the CPU, not from its device table."""
    monkeypatch.setattr(PartyRuntime, "table", lambda self, handle: torch.as_tensor(
        np.asarray(self.data(handle).features), dtype=torch.float32))
    with pytest.raises((RuntimeError, NotImplementedError), match="device|meta"):
        fit_on(name, train, "cpu", "meta")



# ---------------------------------------------------------------------- a real GPU (skipped without one)
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU visible to torch")


@needs_cuda
@pytest.mark.parametrize("coordinator,parties", [("cuda", "cpu"), ("cpu", "cuda")])
@pytest.mark.parametrize("name", METHODS)
def test_cuda_one_side_on_the_gpu_the_other_on_the_cpu(name: str, coordinator: str, parties: str, train,
                                                       test_data) -> None:
    """The messages cross between a GPU and the CPU both ways; the fit lands close to the CPU's."""
    model, fed = fit_on(name, train, coordinator, parties)
    coord, party = parameter_devices(model, fed)
    assert {d.split(":")[0] for d in coord} == {coordinator} and {d.split(":")[0] for d in party} == {parties}
    cpu = get_method(name)("fast", seed=3, **TINY[name]).fit(train).predict_proba(test_data)
    np.testing.assert_allclose(model.predict_proba(test_data), cpu, rtol=0, atol=gpu_atol(name))


@needs_cuda
@pytest.mark.parametrize("name", ["false-vfl-1", "vanilla-vfl", "x-vfl", "fedhssl"])  # one per party program
def test_cuda_bf16_trains_and_predicts_float32_probabilities(name: str, train, test_data) -> None:
    model = get_method(name)("fast", seed=3, device="cuda", precision="bf16", **TINY[name]).fit(train)
    proba = model.predict_proba(test_data)
    assert proba.dtype == np.float32 or proba.dtype == np.float64
    assert np.isfinite(proba).all()
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-4)

# ---------------------------------------------------------------------- models saved on a GPU
@contextmanager
def files_claiming(device: str) -> Iterator[None]:
    """``torch.save`` writes every tensor as if it lived on ``device`` (how a GPU-fitted model's files look)."""
    import torch.serialization as ser

    real = ser.location_tag
    ser.location_tag = lambda storage: device  # type: ignore[assignment]
    try:
        yield
    finally:
        ser.location_tag = real


def test_the_simulated_files_really_claim_a_gpu() -> None:
    buf = io.BytesIO()
    with files_claiming("cuda:0"):
        torch.save({"w": torch.ones(2)}, buf)
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.slow
def test_a_model_saved_on_a_gpu_loads_and_predicts_on_the_cpu(name: str, train, test_data, tmp_path) -> None:
    model = get_method(name)("fast", seed=3, **TINY[name]).fit(train)
    expected = model.predict_proba(test_data)
    with files_claiming("cuda:0"):
        model.save(tmp_path / "m")
    loaded = VFLMethod.load(tmp_path / "m", device="cpu")
    np.testing.assert_array_equal(loaded.predict_proba(test_data), expected)


# ---------------------------------------------------------------------- bf16 autocast
def test_bf16_trains_like_fp32_and_keeps_the_declared_wire_dtypes(train, test_data) -> None:
    """bf16 autocast learns (a stale cast cache would freeze the coordinator's weights: the loss would not move)
    and every reply keeps its declared dtype (the reply checks run on every message)."""
    params = dict(TINY["vanilla-vfl"], epochs=15)
    runs = {}
    for precision in ("fp32", "bf16"):
        fed = LocalFederation.for_dataset(train, precision=precision)
        model = get_method("vanilla-vfl")("fast", seed=3, precision=precision, **params).fit(train, federation=fed)
        runs[precision] = ([h["loss"] for h in model.history_], model.predict_proba(test_data))
    (loss32, p32), (loss16, p16) = runs["fp32"], runs["bf16"]
    assert loss16[-1] < 0.9 * loss16[0]
    assert abs(loss16[-1] - loss32[-1]) < 0.01 * loss32[0]
    assert not np.array_equal(p16, p32) and np.abs(p16 - p32).max() < 0.05


@pytest.mark.parametrize("name", ["false-vfl-2", "x-vfl", "fedhssl", "laser-vfl"])
def test_bf16_runs_every_kind_of_method(name: str, train, test_data) -> None:
    fed = LocalFederation.for_dataset(train, precision="bf16")
    model = get_method(name)("fast", seed=3, precision="bf16", **TINY[name]).fit(train, federation=fed)
    proba = model.predict_proba(test_data)
    assert np.isfinite(proba).all()
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-5)


# ---------------------------------------------------------------------- the command line
def test_cli_device_cpu_is_the_default_fit_and_a_missing_gpu_is_refused(tmp_path, capsys) -> None:
    from partialvfl.cli import main

    base = ["fit", "--dataset", "digits", "--parties", "3", "--labels", "120", "--aligned", "30", "--max-train",
            "300", "--max-test", "100", "--method", "local", "--epochs", "2", "--quiet"]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    default = capsys.readouterr().out
    assert main([*base, "--out", str(tmp_path / "b"), "--device", "cpu"]) == 0
    assert capsys.readouterr().out == default  # the same test accuracy, to the last digit
    assert main(["evaluate", "--model", str(tmp_path / "b"), "--device", "cpu", "--precision", "bf16"]) == 0
    if not HAS_CUDA:
        assert main([*base, "--out", str(tmp_path / "c"), "--device", "cuda"]) == 2
        assert "error: --device cuda: " in capsys.readouterr().err
        assert main(["evaluate", "--model", str(tmp_path / "b"), "--device", "cuda:1"]) == 2
        assert "error: --device cuda:1: " in capsys.readouterr().err


def test_a_party_picks_its_own_device_in_its_party_file(tmp_path) -> None:
    from partialvfl.federation.grpc.party_config import load_party_config

    def party_file(extra: str) -> object:
        (tmp_path / "p.toml").write_text(
            f'[party]\nname = "a"\nindex = 0\nhmac_key_file = "h"\n{extra}[data]\npath = "t.csv"\nid_column = "id"\n'
            '[tls]\nca = "c"\ncert = "c"\nkey = "k"\n')
        return load_party_config(tmp_path / "p.toml")

    cfg = party_file('device = "cpu"\nprecision = "bf16"\n')
    assert (cfg.device, cfg.precision) == ("cpu", "bf16")
    assert (party_file("").device, party_file("").precision) == ("cpu", "fp32")
    with pytest.raises(DeviceError, match=r"p\.toml: \[party\] precision 'fp8'"):
        party_file('precision = "fp8"\n')
    if not HAS_CUDA:
        with pytest.raises(DeviceError, match=r"p\.toml: \[party\] device cuda: "):
            party_file('device = "cuda"\n')
