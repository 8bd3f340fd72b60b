"""The method contract, checked for every registered method (a method registered later is picked up by itself).

On a small dataset with partial overlap and partial labels, each method must: leak no raw feature and send only the
tensors its party program declares; give bitwise identical predictions after save/load; give the same model for the
same seed and another for another seed; refuse a wrong parameter by name; give the same predictions and states over
gRPC (real party processes, mutual TLS) as in process; and, checkpointed and crashed mid-fit, resume to exactly the
uninterrupted fit, in process and over gRPC.

Every method needs an entry in :data:`TINY`: parameters that make a fit take well under a second.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers import PATIENCE, tiny_test, tiny_train
from partialvfl import VerticalDataset
from partialvfl.federation import MessageLog, TensorSpec, find_raw_feature_leaks, tensor_names
from partialvfl.federation.grpc.federation import GrpcFederation
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.grpc.party import SERVER_MESSAGES
from partialvfl.federation.runtime.checkpoint import Checkpointer
from partialvfl.federation.trust.psu import PSU_MESSAGES
from partialvfl.federation.wire.program import PROGRAMS
from partialvfl.methods.base import VFLMethod, get_method
from partialvfl.methods.params import Param
from partialvfl.methods.registry import method_names

SEED, OTHER_SEED = 3, 4

_SPLIT = {"latent_dim": 4, "encoder_hidden": [8], "epochs": 2, "batch_size": 16}
_FALSE = {"d_h": 4, "d_z": 2, "encoder_hidden": [8], "decoder_hidden": [8], "global_hidden": [8],
          "discriminator_hidden": [8], "mask_hidden": [8], "importance_samples": 2, "predict_importance_samples": 3,
          "pretrain_epochs": 2, "epochs": 2, "pretrain_batch_size": 16, "batch_size": 16}
#: per method: parameters for a tiny fit (two epochs of each stage, a few steps each)
TINY: dict[str, dict[str, Any]] = {
    "false-vfl-1": _FALSE,
    "false-vfl-2": _FALSE,
    "laser-vfl": {**_SPLIT, "pretrain": True, "pretrain_epochs": 2, "pretrain_batch_size": 16},
    "vanilla-vfl": _SPLIT,
    "plug-vfl": _SPLIT,
    "local": _SPLIT,
    "ensemble": _SPLIT,
    "combinatorial": _SPLIT,
    "x-vfl": {"latent_dim": 4, "encoder_hidden": [8], "xcom_hidden": [8], "top_hidden": [8], "epochs": 2,
              "batch_size": 16},
    "fedhssl": {"latent_dim": 4, "encoder_hidden": [8, 8], "proj_dim": 4, "proj_hidden": 8, "pred_hidden": 4,
                "pretrain_epochs": 2, "pretrain_batch_size": 8, "epochs": 2, "batch_size": 8,
                "pool": "concat"},  # concat: the classifier's width depends on a parameter (a harder load)
}
METHODS = method_names()
#: the devices the contract runs on: the CPU always; the first CUDA GPU where torch sees one (skipped otherwise)
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="no CUDA GPU visible to torch"))]


def tiny(name: str) -> dict[str, Any]:
    if name not in TINY:
        pytest.fail(f"method {name!r} has no tiny parameters: add an entry for it to TINY in tests/test_contract.py")
    return dict(TINY[name])


@pytest.fixture(scope="module")
def train() -> VerticalDataset:
    return tiny_train()


@pytest.fixture(scope="module")
def test_data() -> VerticalDataset:
    return tiny_test()


@contextmanager
def running_parties(directory: Path, data: VerticalDataset, extra: tuple[VerticalDataset, ...] = ()
                    ) -> Iterator[LocalDeployment]:
    """Party processes for ``data`` (and ``extra``), generous deadlines; killed at the end."""
    with LocalDeployment(directory, data, extra=extra, deadline=PATIENCE, start_timeout=600.0) as dep:
        dep.start()
        yield dep


@pytest.fixture(scope="module")
def deployment(tiny_deployment: LocalDeployment) -> LocalDeployment:
    """One set of party processes for every method (shared with test_schedule: conftest.py's ``tiny_deployment``):
    each party's table holds its training and test rows."""
    return tiny_deployment


# ---------------------------------------------------------------------- checkpointers that count or crash
class StepCounter(Checkpointer):
    """Saves nothing; records where every step of a fit lands: (stage, epoch, item index within the epoch)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, every=1)
        self.positions: dict[int, tuple[str, int, int]] = {}

    def maybe_save(self, step: int, state: Callable[[], dict[str, Any]] | dict[str, Any]) -> bool:
        s = state() if callable(state) else state
        self.positions[step] = (s["stage"], int(s["epoch"]), int(s["index"]))
        return False


class Crash(RuntimeError):
    """The simulated death of the coordinator."""


class CrashingCheckpointer(Checkpointer):
    """Checkpoints as usual, and dies at the end of step ``crash_at`` (after its checkpoint, if one is due)."""

    def __init__(self, directory: Path, every: int, crash_at: int) -> None:
        super().__init__(directory, every=every)
        self.crash_at = crash_at

    def maybe_save(self, step: int, state: Callable[[], dict[str, Any]] | dict[str, Any]) -> bool:
        saved = super().maybe_save(step, state)
        if step == self.crash_at:
            raise Crash(f"the coordinator dies after step {step}")
        return saved


def crash_steps(positions: dict[int, tuple[str, int, int]]) -> list[int]:
    """Where to crash: the end of the first stage (a stage boundary) and an item inside the last stage's last
    epoch that is not the epoch's end (else that epoch's first step); never the fit's last step."""
    steps = sorted(positions)
    stages = list(dict.fromkeys(positions[s][0] for s in steps))
    out = []
    if len(stages) > 1:
        out.append(max(s for s in steps if positions[s][0] == stages[0]))
    last = [s for s in steps[:-1] if positions[s][0] == stages[-1] and positions[s][1] == positions[steps[-1]][1]]
    out.append(last[len(last) // 2] if last else steps[len(steps) // 2])
    return sorted(set(out))


# ---------------------------------------------------------------------- fits shared by the tests
@dataclass
class Reference:
    """A method's in-process fit with seed SEED: the model, its message log, its test predictions, its steps."""

    model: VFLMethod
    log: MessageLog
    proba: np.ndarray
    positions: dict[int, tuple[str, int, int]]


@pytest.fixture(scope="module")
def references(train, test_data, tmp_path_factory) -> Callable[[str], Reference]:
    cache: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in cache:
            log = MessageLog(keep_payloads=True)
            counter = StepCounter(tmp_path_factory.mktemp("count"))
            model = get_method(name)("fast", seed=SEED, **tiny(name)).fit(train, log=log, checkpointer=counter)
            cache[name] = Reference(model, log, model.predict_proba(test_data), counter.positions)
        return cache[name]

    return get


def fit(name: str, data: VerticalDataset, seed: int = SEED, **kw: Any) -> VFLMethod:
    return get_method(name)("fast", seed=seed, **tiny(name)).fit(data, **kw)


# ---------------------------------------------------------------------- saved states
def saved_states(model_dir: Path, deployment: LocalDeployment | None = None) -> dict[str, Any]:
    """The coordinator's and every party's saved state of a model (over gRPC: from the parties' own disks)."""
    out = {"coordinator": torch.load(model_dir / "coordinator.pt", weights_only=True)}
    party_dir = model_dir
    for k, name in enumerate(("bank", "shop", "telco")):
        if deployment is not None:
            party_dir = deployment.dir / "state" / name / GrpcFederation.saved_party_dir(model_dir)
        state = torch.load(party_dir / f"party-{k}.pt", weights_only=True)
        state.pop("model", None)  # the digest of the saved model instance (its metadata holds the fit's timings)
        state.pop("state_id", None)  # which state this is, at that party (for its rewind count): random per process
        out[f"party-{k}"] = state
    return out


def assert_same(a: Any, b: Any, *, exact: bool = True, where: str = "") -> None:
    """Nested states equal: bitwise (``exact``) or to float tolerance."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], exact=exact, where=f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, exact=exact, where=f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        torch.testing.assert_close(a, b, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6, equal_nan=True,
                                   msg=lambda m: f"{where}: {m}")
    elif isinstance(a, float) and not exact:
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6, nan_ok=True), where
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def differs(a: Any, b: Any) -> bool:
    try:
        assert_same(a, b)
    except AssertionError:
        return True
    return False


def assert_declared_and_leak_free(model: VFLMethod, log: MessageLog, *datasets: VerticalDataset,
                                  extra: frozenset[str] = frozenset()) -> None:
    """No raw feature row in any crossing message; every crossing tensor declared by the method's party program
    (for that party's config) or in ``extra`` (the server's own kinds over gRPC)."""
    crossing = log.crossing()
    assert crossing, "nothing crossed the boundary: the audit proves nothing"
    assert find_raw_feature_leaks(log, *datasets) == []
    program = PROGRAMS[model.party_program]
    declared = {k: [TensorSpec(n, "float32") for n in tensor_names(program, model._party_config(k)) | extra]
                for k in range(model.index_.n_parties)}
    for e in crossing:
        party = e.receiver if e.direction == "request" else e.sender
        for n in e.names:
            assert any(s.match(n) is not None for s in declared[party]), \
                f"{e.kind} {e.direction} of party {party} carries tensor {n!r}, which {program.program_name} " \
                "does not declare"


# ---------------------------------------------------------------------- the contract
@pytest.mark.parametrize("name", METHODS)
def test_no_raw_feature_crosses_and_only_declared_tensors_do(name: str, references, test_data, train) -> None:
    ref = references(name)
    assert_declared_and_leak_free(ref.model, ref.log, train, test_data)


@pytest.mark.parametrize("name", METHODS)
def test_save_load_gives_identical_predictions(name: str, references, test_data, tmp_path) -> None:
    ref = references(name)
    ref.model.save(tmp_path / "m")
    loaded = VFLMethod.load(tmp_path / "m")
    assert type(loaded) is type(ref.model)
    np.testing.assert_array_equal(loaded.predict_proba(test_data), ref.proba)
    np.testing.assert_array_equal(ref.model.predict_proba(test_data), ref.proba)  # predicting changes nothing
    np.testing.assert_allclose(ref.proba.sum(axis=1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.slow
def test_same_seed_same_model_other_seed_other_model(name: str, references, train, test_data, tmp_path) -> None:
    ref = references(name)
    ref.model.save(tmp_path / "ref")
    again, other = fit(name, train), fit(name, train, seed=OTHER_SEED)
    np.testing.assert_array_equal(again.predict_proba(test_data), ref.proba)
    assert again.history_ == ref.model.history_
    again.save(tmp_path / "again")
    other.save(tmp_path / "other")
    assert_same(saved_states(tmp_path / "again"), saved_states(tmp_path / "ref"))
    assert not np.array_equal(other.predict_proba(test_data), ref.proba)
    assert differs(saved_states(tmp_path / "other"), saved_states(tmp_path / "ref"))


def gpu_atol(name: str) -> float:
    """How close a GPU fit lands to the CPU's: 1e-3, but FedHSSL's self-supervised stage runs many more steps and
    its float differences grow (measured on an H200, 2026-11-26: 0.0034 with everything on the GPU, 0.067 with the
    parties on the GPU and the coordinator on the CPU)."""
    return 0.1 if name == "fedhssl" else 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", METHODS)
def test_on_each_device_same_seed_same_model_and_it_predicts_on_the_cpu(name: str, device: str, references, train,
                                                                        test_data, tmp_path) -> None:
    """A fit with an explicit ``device``: the same seed gives the same model there (bitwise on the CPU, where it is
    the default's fit; to float tolerance on a GPU, whose kernels are not bitwise reproducible without
    deterministic algorithms), close to the CPU's; saved there, it loads and predicts on the CPU as it did."""
    def make() -> VFLMethod:
        return get_method(name)("fast", seed=SEED, device=device, **tiny(name)).fit(train)

    a, b = make(), make()
    pa = a.predict_proba(test_data)
    exact = device == "cpu"
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-5}
    np.testing.assert_allclose(b.predict_proba(test_data), pa, **tol)
    np.testing.assert_allclose(pa, references(name).proba, **(tol if exact else {"rtol": 0, "atol": gpu_atol(name)}))
    assert {str(p.device.type) for m in a._coordinator_modules().values() for p in m.parameters()} <= {device}
    a.save(tmp_path / "m")
    loaded = VFLMethod.load(tmp_path / "m", device="cpu")
    np.testing.assert_allclose(loaded.predict_proba(test_data), pa, **tol)


def bad_values(p: Param) -> list[Any]:
    """Values the declaration of ``p`` refuses (none for an undeclared ``any`` parameter)."""
    if p.kind in ("int", "float"):
        bounds = ([p.low - 1] if p.low is not None else []) + ([p.high + 1] if p.high is not None else [])
        return ["many", *bounds]
    return {"bool": ["maybe"], "str": ["no-such-choice"] if p.choices else [7], "ints": [[0], "8"],
            "range": [[1.0, 0.0]], "any": []}[p.kind]


@pytest.mark.parametrize("name", METHODS)
def test_a_wrong_parameter_is_refused_with_its_name(name: str) -> None:
    cls = get_method(name)
    with pytest.raises(ValueError, match="'no_such_parameter'"):
        cls("fast", no_such_parameter=1)
    checked = 0
    for p in cls.param_space().params:
        for bad in bad_values(p):
            with pytest.raises(ValueError, match=rf"parameter {re.escape(p.name)} must be") as err:
                cls("fast", **{p.name: bad})
            assert str(err.value).startswith(f"{name}: "), err.value
            checked += 1
    assert checked or cls.params is None, f"{name} declares no parameter with a refusable value"


#: methods whose parties answer alone in process, as over gRPC (issue 21: FALSE-VFL's stacked simulation summed in
#: another float order); the split-network methods stack equal parties in process and agree to float tolerance
PARTIES_ALONE_IN_PROCESS = {"false-vfl-1", "false-vfl-2", "x-vfl", "fedhssl"}


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.slow
def test_federated_over_grpc_equals_in_process(name: str, references, deployment, train, test_data,
                                              tmp_path) -> None:
    ref = references(name)
    log = MessageLog(keep_payloads=True)
    fed = deployment.federation(log=log)
    try:
        remote = fit(name, train, federation=fed)
        proba = remote.predict_proba(test_data)
        remote.save(tmp_path / "remote")
    finally:
        fed.close()
    exact = name in PARTIES_ALONE_IN_PROCESS  # the same floats; the split-network methods to float tolerance
    if exact:
        np.testing.assert_array_equal(proba, ref.proba)
    np.testing.assert_allclose(proba, ref.proba, rtol=1e-5, atol=1e-6)
    assert_same(remote.history_, ref.model.history_, exact=False)  # a history holds timings
    ref.model.save(tmp_path / "local")
    assert_same(saved_states(tmp_path / "remote", deployment), saved_states(tmp_path / "local"), exact=exact)
    extra = tensor_names(SERVER_MESSAGES) | tensor_names(PSU_MESSAGES)
    assert_declared_and_leak_free(remote, log, train, test_data, extra=extra)


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.slow
def test_checkpoint_and_resume_equals_uninterrupted_in_process(name: str, references, train, test_data,
                                                              tmp_path) -> None:
    ref = references(name)
    for n in crash_steps(ref.positions):
        directory = tmp_path / f"ck-{n}"
        with pytest.raises(Crash):
            fit(name, train, checkpointer=CrashingCheckpointer(directory, every=1, crash_at=n))
        resumed = fit(name, train, checkpointer=Checkpointer(directory, every=1))
        assert resumed.resumed_step_ == n, ref.positions[n]
        assert resumed.history_ == ref.model.history_, ref.positions[n]
        np.testing.assert_array_equal(resumed.predict_proba(test_data), ref.proba, err_msg=str(ref.positions[n]))
    with pytest.raises(ValueError, match="seed = 3, this run has 4: resume with the parameters and data of the"):
        fit(name, train, seed=OTHER_SEED, checkpointer=Checkpointer(directory, every=1))  # another run's checkpoint


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.slow
def test_checkpoint_and_resume_over_grpc_equals_uninterrupted(name: str, references, deployment, train, test_data,
                                                             tmp_path) -> None:
    """The parties live on: they did the step after the checkpoint, and a resume must roll them back."""
    ref = references(name)
    n = crash_steps(ref.positions)[-1]
    every = max(1, n - 1)  # the last checkpoint is one step before the crash
    fed = deployment.federation()
    try:
        with pytest.raises(Crash):
            fit(name, train, federation=fed, checkpointer=CrashingCheckpointer(tmp_path, every=every, crash_at=n))
    finally:
        fed.close()
    fed = deployment.federation()  # a new coordinator session; the parties kept running
    try:
        resumed = fit(name, train, federation=fed, checkpointer=Checkpointer(tmp_path, every=every))
        proba = resumed.predict_proba(test_data)
    finally:
        fed.close()
    assert resumed.resumed_step_ == n // every * every
    assert_same(resumed.history_, ref.model.history_, exact=False)
    np.testing.assert_allclose(proba, ref.proba, rtol=1e-5, atol=1e-6)


def test_in_process_checkpoints_are_pruned_to_the_last_two(train, tmp_path) -> None:
    """Every party of the in-process federation answers ``forget``, so pruned checkpoints go entirely."""
    fit(METHODS[0], train, checkpointer=Checkpointer(tmp_path, every=1, keep=2))
    dirs = sorted(p for p in tmp_path.glob("step-*"))
    assert len(dirs) == 2 and all((d / "coordinator.pt").exists() for d in dirs)
