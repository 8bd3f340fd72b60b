"""gRPC deployment: real party processes on 127.0.0.1 (OS-chosen ports), mutual TLS, faults, resume, bad input.

The party processes import this module as a plugin (``PYTHONPATH`` = this folder) for the toy split-learning program
below, so these tests do not depend on any method's progress.

No test depends on the machine's speed: every call gets a generous deadline (:data:`PATIENCE`), except the one call
of the deadline test, whose slow party blocks until the test lets it go.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import PATIENCE
from partialvfl import Task, VerticalDataset
from partialvfl.federation import (
    LocalFederation,
    MessageError,
    MessageLog,
    MessageSpec,
    PartyProgram,
    Reply,
    Request,
    TensorSpec,
    register_program,
    tensor_names,
)
from partialvfl.federation.grpc.certs import init_dev_pki, issue_certificate
from partialvfl.federation.grpc.federation import GrpcFederation
from partialvfl.federation.grpc.federation_file import load_federation_config
from partialvfl.federation.grpc.frames import (
    CALL_METHOD,
    WireError,
    chunks,
    decode_reply,
    decode_request,
    encode_request,
)
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.grpc.party import SERVER_MESSAGES
from partialvfl.federation.grpc.transport import GrpcTransport, PartyError, TlsFiles
from partialvfl.federation.runtime.checkpoint import Checkpointer, rng_state, set_rng_state
from partialvfl.federation.runtime.coordinator import Federation
from partialvfl.federation.trust.alignment import hash_ids, load_key, observed_from_hashes, positions_in
from partialvfl.federation.trust.audit import find_raw_feature_leaks
from partialvfl.federation.trust.psu import PSU_MESSAGES
from partialvfl.federation.wire.transport import PartyUnavailable
from partialvfl.methods.base import VFLMethod
from partialvfl.methods.params import inferred_space
from partialvfl.methods.registry import MethodSpec, register_spec, unregister
from partialvfl.methods.training import Stage

HERE = Path(__file__).resolve().parent
HIDDEN = 4


# ---------------------------------------------------------------------- toy split learning (party and coordinator)
@register_program
class ToySplitParty(PartyProgram):
    """Party half of a split network: a linear encoder trained by SGD with momentum from the gradients it gets."""

    program_name = "test/grpc-split"
    messages = {
        "forward": MessageSpec(request=[TensorSpec("rows", "int64", ("B",))],
                               reply=[TensorSpec("embedding", "float32", ("B", "hidden"))], meta=["data"]),
        "backward": MessageSpec(request=[TensorSpec("grad", "float32", ("B", "hidden"))]),
        "leak": MessageSpec(reply=[TensorSpec("oops", "float32", ("N", "feature_dim"))], meta=["data"]),
        "weights": MessageSpec(reply=[TensorSpec("w", "float32", ("feature_dim", "hidden"))]),
    }

    def __init__(self, runtime, config, seed):
        super().__init__(runtime, config, seed)
        g = torch.Generator().manual_seed(seed * 100 + runtime.index)
        self.w = (0.3 * torch.randn(config["feature_dim"], config["hidden"], generator=g)).requires_grad_()
        self.opt = torch.optim.SGD([self.w], lr=0.05, momentum=0.9)
        self._out: torch.Tensor | None = None
        self.gate = Path(config["gate"]) if config.get("gate") else None  # forward waits until this file exists

    def on_forward(self, req: Request) -> Reply:
        view = self.data(req.meta["data"])
        x = torch.as_tensor(view.features[view.position_of_rows(req.tensors["rows"].numpy())])
        if self.gate is not None:
            _wait_for(self.gate)
        self._out = x @ self.w
        return Reply({"embedding": self._out})

    def on_backward(self, req: Request) -> Reply:
        if self._out is None or req.tensors["grad"].shape != self._out.shape:
            raise ValueError(f"gradient of shape {tuple(req.tensors['grad'].shape)} does not match the forward "
                             f"output {None if self._out is None else tuple(self._out.shape)}")
        self.opt.zero_grad()
        self._out.backward(req.tensors["grad"])
        self.opt.step()
        self._out = None
        return Reply()

    def on_leak(self, req: Request) -> Reply:
        return Reply({"oops": torch.as_tensor(self.data(req.meta["data"]).features[:2])})

    def on_weights(self, req: Request) -> Reply:
        return Reply({"w": self.w.detach()})

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w.detach().clone(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.w.copy_(state["w"])
        self.opt.load_state_dict(state["opt"])


@register_program
class ToyBatchedParty(ToySplitParty):
    """The toy program, answering a round of several parties jointly in process (each by its own handler)."""

    program_name = "test/grpc-batched"
    batches: ClassVar[list[int]] = []  # the size of every batched round answered in this process

    @classmethod
    def handle_batch(cls, items: Any) -> list[Reply] | None:
        cls.batches.append(len(items))
        return [program.handle(request) for program, request in items]


def _wait_for(path: Path, limit: float = 600.0) -> None:
    """Block until ``path`` exists (the test opens the gate), at most ``limit`` seconds."""
    t0 = time.monotonic()
    while not path.exists() and time.monotonic() - t0 < limit:
        time.sleep(0.01)


def toy_configs(dims, **extra) -> list[dict[str, Any]]:
    return [{"feature_dim": int(d), "hidden": HIDDEN, **extra} for d in dims]


def toy_head(seed: int, n_classes: int) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = torch.nn.Linear(HIDDEN, n_classes)
    return head, torch.optim.SGD(head.parameters(), lr=0.05, momentum=0.9)


def toy_forward(fed: Federation, handle: str, observed: np.ndarray, rows: np.ndarray, n_hidden: int = HIDDEN,
                *, tolerate: bool = True) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Sum of the observed parties' embeddings for ``rows``; parties that fail are left out (missing)."""
    t = fed.transport
    requests = {}
    for k in range(fed.n_parties):
        have = rows[observed[rows, k]]
        if have.size:
            requests[k] = Request("forward", {"rows": torch.as_tensor(have)}, {"data": handle})
    replies = t.call_many(requests, tolerate=tolerate)
    embs, total = {}, torch.zeros(len(rows), n_hidden)
    for k, r in replies.items():
        e = r.tensors["embedding"].clone().requires_grad_()
        pos = torch.as_tensor(np.searchsorted(rows, requests[k].tensors["rows"].numpy()))
        total = total.index_add(0, pos, e)
        embs[k] = e
    return total, embs


def toy_train(fed: Federation, handle: str, observed: np.ndarray, y: np.ndarray, n_classes: int, *, steps: int,
              seed: int, batch: int = 8, ckpt: Checkpointer | None = None, crash_at: int | None = None,
              setup: bool = True) -> torch.nn.Linear:
    """The coordinator's loop: batches drawn from a saved generator, checkpointed every N steps."""
    if setup:
        fed.setup("test/grpc-split", toy_configs(fed_dims(fed, observed)), seed)
    head, opt = toy_head(seed, n_classes)
    gen = torch.Generator().manual_seed(seed)
    start = 0
    if ckpt is not None and (saved := ckpt.restore()) is not None:
        head.load_state_dict(saved.state["head"])
        opt.load_state_dict(saved.state["opt"])
        set_rng_state(gen, saved.state["gen"])
        start = saved.step
    pool = np.flatnonzero(observed.any(axis=1))
    for step in range(start, steps):
        rows = np.sort(pool[torch.randperm(len(pool), generator=gen)[:batch].numpy()])
        fed.transport.new_step()
        total, embs = toy_forward(fed, handle, observed, rows)
        if crash_at is not None and step + 1 == crash_at:
            os.kill(os.getpid(), signal.SIGKILL)  # the coordinator dies mid-step, after the parties' forward
        loss = torch.nn.functional.cross_entropy(head(total), torch.as_tensor(y[rows]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        fed.transport.call_many({k: Request("backward", {"grad": e.grad}) for k, e in embs.items()}, tolerate=True)
        if ckpt is not None:
            ckpt.maybe_save(step + 1, lambda: {"head": head.state_dict(), "opt": opt.state_dict(),
                                               "gen": rng_state(gen)})
    return head


_DIMS: dict[int, tuple[int, ...]] = {}


def fed_dims(fed: Federation, observed: np.ndarray) -> tuple[int, ...]:
    return _DIMS[observed.shape[1]]


def party_weights(fed: Federation) -> dict[int, torch.Tensor]:
    fed.transport.new_step()
    return {k: r.tensors["w"] for k, r in fed.transport.broadcast(range(fed.n_parties), "weights").items()}


def mostly_labeled_data(n: int = 48, seed: int = 0) -> VerticalDataset:
    """Three parties (widths 3, 4, 2), three classes, each block held with p 0.8, one sample nobody holds, about 90 %
    labelled, party 2 holds the labels (its widths recorded in ``_DIMS[3]``)."""
    rng = np.random.default_rng(seed)
    dims = (3, 4, 2)
    y = rng.integers(0, 3, n)
    blocks = [rng.normal(size=(n, d)) + y[:, None] * 0.5 for d in dims]
    obs = rng.random((n, 3)) < 0.8
    obs[np.arange(0, n, 7)] = True
    obs[5] = False  # one sample nobody holds
    for k, b in enumerate(blocks):
        b[~obs[:, k]] = np.nan
    labeled = rng.random(n) < 0.9
    _DIMS[3] = dims
    return VerticalDataset(blocks, obs, ids=[f"u{i:03d}" for i in range(n)], y=y, labeled=labeled,
                           task=Task.classification(["a", "b", "c"]), active_party=2,
                           party_names=["bank", "shop", "telco"])


# ---------------------------------------------------------------------- typed messages
@register_program
class TypedParty(PartyProgram):
    """For the message checks: ``pair`` is well declared; ``buggy`` answers with the reply ``meta['bug']`` asks for."""

    program_name = "test/grpc-typed"
    messages = {
        "pair": MessageSpec(request=[TensorSpec("x", "float32", ("B", "feature_dim")),
                                     TensorSpec("rows", "int64", ("B",)),
                                     TensorSpec("w", "float32", ("B",), optional=True)],
                            reply=[TensorSpec("y", "float32", ("B", 2))], meta=["data"], optional_meta=["scale"]),
        "buggy": MessageSpec(request=[TensorSpec("rows", "int64", ("B",))],
                             reply=[TensorSpec("y", "float32", ("B", 2))], meta=["bug"]),
    }

    def on_pair(self, req: Request) -> Reply:
        return Reply({"y": torch.zeros(len(req.tensors["rows"]), 2)})

    def on_buggy(self, req: Request) -> Reply:
        b = len(req.tensors["rows"])
        y = torch.zeros(b, 2)
        return Reply({"dtype": {"y": y.double()}, "rank": {"y": y[:, 0]}, "size": {"y": torch.zeros(b + 1, 2)},
                      "missing": {}, "extra": {"y": y, "x": y}}[req.meta["bug"]])


def _typed_request(**change: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A well-formed ``pair`` request for party 0 (3 features), with tensors replaced (``None``: left out)."""
    tensors = {"x": torch.zeros(4, 3), "rows": torch.arange(4)}
    for k, v in change.items():
        if v is None:
            tensors.pop(k)
        else:
            tensors[k] = v
    return tensors, {"data": "train"}


#: malformed requests: (kind, tensors, meta, what the error says)
BAD_REQUESTS: dict[str, tuple[str, dict[str, torch.Tensor], dict[str, Any], str]] = {
    "wrong dtype": ("pair", *_typed_request(rows=torch.zeros(4)), "tensor 'rows' must be int64, got float32"),
    "wrong rank": ("pair", *_typed_request(x=torch.zeros(4)), "tensor 'x' must have rank 2"),
    "mismatched dimension": ("pair", *_typed_request(rows=torch.arange(3)),
                             "tensor 'rows' dimension 0 (B) is 3, but B = 4 from tensor 'x'"),
    "config dimension": ("pair", *_typed_request(x=torch.zeros(4, 5)),
                         "tensor 'x' dimension 1 (feature_dim) is 5, but feature_dim = 3 from the program's config"),
    "missing tensor": ("pair", *_typed_request(x=None), "missing tensor 'x'"),
    "unexpected tensor": ("pair", *_typed_request(z=torch.zeros(4)), "unexpected tensor 'z'"),
    "missing meta key": ("pair", _typed_request()[0], {}, "missing meta key 'data'"),
    "unknown meta key": ("pair", _typed_request()[0], {"data": "train", "colour": "red"},
                         "unknown meta key 'colour'"),
    "unknown kind": ("no-such-kind", {}, {}, "unknown message kind"),
}


# ---------------------------------------------------------------------- a toy method, for the CLI path
class ToySplitMethod(VFLMethod):
    """The toy split network behind the estimator contract (exercises fit/predict/save/load/resume over gRPC).

    Registered only while the CLI test runs, so other test modules never see it in the registry.
    """

    name = "test-toy-split"
    party_program = "test/grpc-split"

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"steps": 12, "batch": 8}

    def _party_config(self, party: int) -> dict[str, Any]:
        return {"feature_dim": self.index_.feature_dims[party], "hidden": HIDDEN}

    def _fit(self, view, handle, loop) -> None:
        _DIMS[view.n_parties] = self.index_.feature_dims
        labeled = view.labeled & view.observed.any(axis=1)
        obs = view.observed & labeled[:, None]
        y = np.where(view.labeled, view.y, 0)
        self.head_, opt = toy_head(self.seed, self.index_.task.n_classes)
        pool = np.flatnonzero(obs.any(axis=1))

        def items(epoch: int, rng: np.random.Generator):
            for _ in range(self.params_["steps"]):
                yield np.sort(rng.choice(pool, size=self.params_["batch"], replace=False))

        def step(rows: np.ndarray, rng: np.random.Generator) -> dict[str, tuple[float, float]]:
            total, embs = toy_forward(self.federation_, handle, obs, rows)
            loss = torch.nn.functional.cross_entropy(self.head_(total), torch.as_tensor(y[rows]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            self.transport.call_many({k: Request("backward", {"grad": e.grad}) for k, e in embs.items()},
                                     tolerate=True)
            return {"loss": (float(loss.detach()), 1.0)}

        loop.run(Stage("train", 1, items, step, np.random.default_rng(self.seed),
                       state=lambda: {"opt": opt.state_dict()}, load_state=lambda st: opt.load_state_dict(st["opt"])))

    def _predict(self, view, handle, rows) -> np.ndarray:
        out = []
        for i in range(0, len(rows), 16):
            r = rows[i:i + 16]
            self.federation_.transport.new_step()
            total, _ = toy_forward(self.federation_, handle, view.observed, r)
            out.append(torch.softmax(self.head_(total), dim=1).detach().numpy())
        return np.concatenate(out)

    def _coordinator_modules(self) -> dict[str, torch.nn.Module]:
        return {"head": self.head_}

    def _build_coordinator(self) -> None:
        self.head_, _ = toy_head(self.seed, self.index_.task.n_classes)


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def data() -> VerticalDataset:
    return mostly_labeled_data()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, data):
    # a fresh interpreter per party (the suite forks the others from a preloaded one: conftest.py), its plugin found
    # through PYTHONPATH as an institution's would be
    dep = LocalDeployment(tmp_path_factory.mktemp("grpc"), data, plugins=["test_grpc"], pythonpath=[HERE],
                          deadline=PATIENCE, max_message_mb=1.0, start_timeout=600.0, launcher="exec")
    try:
        dep.start()
        yield dep
    finally:
        dep.close()


def _fed(dep: LocalDeployment, **kw: Any) -> GrpcFederation:
    return dep.federation(**kw)


# ---------------------------------------------------------------------- unit: wire format and alignment
def test_wire_roundtrip_and_malformed_frames() -> None:
    req = Request("forward", {"rows": torch.arange(3), "x": torch.randn(2, 3)[:, :2]}, {"data": "train", "n": 2})
    w = decode_request(encode_request(req, step=4, round=1, session="s", seq=9))
    assert (w.request.kind, w.step, w.round, w.seq, w.session) == ("forward", 4, 1, 9, "s")
    torch.testing.assert_close(w.request.tensors["x"], req.tensors["x"])
    assert w.request.meta["data"] == "train" and w.request.meta["step"] == 4
    for bad in (b"", b"garbage-bytes-not-a-frame", b"\xff" * 8 + b"{}"):
        with pytest.raises(WireError):
            decode_request(bad)
    with pytest.raises(WireError, match="dtype"):
        decode_request(encode_request(Request("f", {"c": torch.zeros(2, dtype=torch.complex64)}), step=0, round=0,
                                      session="s", seq=1))
    with pytest.raises(WireError, match="kind"):
        decode_request(encode_request(Request("../etc"), step=0, round=0, session="s", seq=1))
    with pytest.raises(WireError, match="exceeds"):
        decode_request(encode_request(req, step=0, round=0, session="s", seq=1), max_bytes=10)


_WIRE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text("abcxyz_", min_size=1, max_size=6),
                       st.tuples(st.sampled_from(_WIRE_DTYPES), st.lists(st.integers(0, 4), max_size=3)),
                       max_size=4),
       st.dictionaries(st.text(max_size=5), st.one_of(st.integers(-9, 9), st.text(max_size=5), st.booleans()),
                       max_size=3),
       st.integers(0, 2**40), st.integers(0, 50))
def test_wire_roundtrip_is_exact_for_any_message(specs, meta, step, rnd) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(tuple(shape), generator=g) * 100).to(dtype) for name, (dtype, shape) in specs.items()}
    w = decode_request(encode_request(Request("k", tensors, meta), step=step, round=rnd, session="s", seq=1))
    assert (w.step, w.round) == (step, rnd) and {k: w.request.meta[k] for k in meta} == meta
    assert w.request.tensors.keys() == tensors.keys()
    for name, t in tensors.items():
        got = w.request.tensors[name]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sets(st.integers(0, 30), max_size=12), min_size=1, max_size=4))
def test_observed_matrix_is_exactly_who_holds_what(held) -> None:
    key = b"q" * 32
    order, obs = observed_from_hashes([hash_ids(sorted(h), key) for h in held])
    everyone = sorted(set().union(*held))
    assert order.shape[0] == len(everyone)
    pos = positions_in(order, hash_ids(everyone, key))
    for i, uid in enumerate(everyone):
        assert obs[pos[i]].tolist() == [uid in h for h in held]


def test_alignment_from_hashes_builds_the_observed_matrix() -> None:
    key = b"k" * 32
    a, b = hash_ids(["1", "2", "3"], key), hash_ids([3, 4], key)  # 3 as an int and as text hash alike
    order, obs = observed_from_hashes([a, b, None])
    assert order.shape == (4, 32) and obs.sum(axis=0).tolist() == [3, 2, 0]
    assert obs[positions_in(order, hash_ids(["3"], key))[0]].tolist() == [True, True, False]
    assert positions_in(order, hash_ids(["9"], key)).tolist() == [-1]
    assert not np.array_equal(hash_ids(["1"], key), hash_ids(["1"], b"x" * 32))  # keyed
    with pytest.raises(ValueError, match="twice"):
        observed_from_hashes([hash_ids(["1", "1"], key)])


def test_checkpointer_resumes_a_local_toy_loop_exactly(tmp_path, data) -> None:
    ref = LocalFederation.for_dataset(data)
    ref_head = toy_train(ref, ref.attach(data, "train"), _train_obs(data), _train_y(data), 3, steps=7, seed=1)
    fed = LocalFederation.for_dataset(data)
    ck = Checkpointer(tmp_path / "ck", fed, every=3)
    toy_train(fed, fed.attach(data, "train"), _train_obs(data), _train_y(data), 3, steps=5, seed=1, ckpt=ck)
    assert ck.saved_steps == [3]  # "crashed" after step 5: steps 4-5 are lost with the process
    fed2 = LocalFederation.for_dataset(data)
    ck2 = Checkpointer(tmp_path / "ck", fed2, every=3)
    head = toy_train(fed2, fed2.attach(data, "train"), _train_obs(data), _train_y(data), 3, steps=7, seed=1,
                     ckpt=ck2)
    assert ck2.saved_steps == [6]
    torch.testing.assert_close(head.weight, ref_head.weight, rtol=0, atol=0)
    for k in range(3):
        torch.testing.assert_close(fed2.runtimes[k].program.w, ref.runtimes[k].program.w, rtol=0, atol=0)


def _train_obs(data: VerticalDataset) -> np.ndarray:
    return data.observed & data.labeled[:, None]


def _train_y(data: VerticalDataset) -> np.ndarray:
    return np.where(data.labeled, data.y, 0)


# ---------------------------------------------------------------------- real processes
@pytest.mark.slow
def test_federated_training_matches_in_process_and_leaks_nothing(deployment, data) -> None:
    log = MessageLog(keep_payloads=True)
    fed = _fed(deployment, log=log)
    try:
        h = fed.attach(data, "train")
        head = toy_train(fed, h, _train_obs(data), _train_y(data), 3, steps=6, seed=2)
        w_grpc = party_weights(fed)
        sent = fed.grpc_transport.bytes_sent
        assert find_raw_feature_leaks(log, data) == []
        crossing = log.crossing()
        assert crossing and {e.kind for e in crossing} >= {"forward", "backward"}
        allowed = (tensor_names(ToySplitParty, kinds=["forward", "backward", "weights"])
                   | tensor_names(SERVER_MESSAGES) | tensor_names(PSU_MESSAGES))
        assert {n for e in crossing for n in e.names} <= allowed
        fed.transport.new_step()
        fed.call(0, "leak", data="train")  # a positive control: the audit sees a raw row when one crosses
        assert find_raw_feature_leaks(log, data)
    finally:
        fed.close()
    local = LocalFederation.for_dataset(data)
    hl = local.attach(data, "train")
    ref = toy_train(local, hl, _train_obs(data), _train_y(data), 3, steps=6, seed=2)
    torch.testing.assert_close(head.weight, ref.weight, rtol=1e-6, atol=1e-7)
    for k in range(3):
        torch.testing.assert_close(w_grpc[k], local.runtimes[k].program.w.detach(), rtol=1e-6, atol=1e-7)
    assert sent > 0


@pytest.mark.slow
def test_align_from_hashed_ids_and_label_table(deployment, data) -> None:
    fed = _fed(deployment)
    try:
        view, handle = fed.align(handle="aligned")
        # every sample some party holds or that carries a label is in the union, in token order; the coordinator
        # finds its own IDs there only through the keyed parties' online lookup
        known = data.observed.any(axis=1) | data.labeled
        assert view.n_samples == int(known.sum())
        pos = positions_in(_unhex(view.ids), fed.id_tokens(data.ids[known]))
        assert (pos >= 0).all()
        np.testing.assert_array_equal(view.observed[pos], data.observed[known])
        np.testing.assert_array_equal(view.labeled[pos], data.labeled[known])
        lab = data.labeled[known]
        np.testing.assert_array_equal(view.y[pos][lab], data.y[known][lab])
        assert view.feature_dims == data.feature_dims
    finally:
        fed.close()


def _unhex(ids: np.ndarray) -> np.ndarray:
    return np.array([np.frombuffer(bytes.fromhex(s), dtype=np.uint8) for s in ids])


@pytest.mark.slow
def test_wrong_certificate_is_rejected_and_server_keeps_serving(deployment, tmp_path) -> None:
    cfg = load_federation_config(deployment.federation_file)
    rogue = tmp_path / "rogue"
    init_dev_pki(rogue, ["coordinator"])  # right name, wrong CA
    t = GrpcTransport(cfg.parties, cfg.active_party, TlsFiles(cfg.tls.ca, rogue / "coordinator.pem",
                                                              rogue / "coordinator.key"), deadline=PATIENCE)
    with pytest.raises(PartyUnavailable):
        t.call(0, "hello")
    t.close()
    issue_certificate(tmp_path / "intruder", "intruder", ca_cert=deployment.certs / "ca.pem",
                      ca_key=deployment.certs / "ca.key")  # right CA, identity not on the allowlist
    t = GrpcTransport(cfg.parties, cfg.active_party, TlsFiles(cfg.tls.ca, tmp_path / "intruder" / "intruder.pem",
                                                              tmp_path / "intruder" / "intruder.key"),
                      deadline=PATIENCE)
    with pytest.raises(PartyError) as err:
        t.call(0, "hello")
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and "allowlist" in err.value.details
    t.close()
    fed = _fed(deployment)  # the legitimate coordinator is still served
    assert fed.party_info[0]["name"] == "bank"
    fed.close()


@pytest.mark.slow
def test_bad_messages_are_refused_with_clear_status_and_server_keeps_serving(deployment, data) -> None:
    fed = _fed(deployment)
    fed.attach(data, "train")
    fed.setup("test/grpc-split", toy_configs(data.feature_dims), seed=0)
    fed.close()
    cfg = load_federation_config(deployment.federation_file)
    ca, cert, key = cfg.tls.read()
    creds = grpc.ssl_channel_credentials(ca, key, cert)
    ch = grpc.secure_channel(cfg.parties[0].address, creds,
                             options=[("grpc.ssl_target_name_override", "bank"),
                                      ("grpc.max_send_message_length", 8 * 2**20)])
    call = ch.unary_unary(CALL_METHOD)
    seq = iter(range(1, 1000))

    def send(kind: str, tensors: dict | None = None, step: int = 5, rnd: int = 0, **meta: Any) -> grpc.StatusCode:
        payload = encode_request(Request(kind, tensors or {}, meta), step=step, round=rnd, session="raw",
                                 seq=next(seq))
        return _status(call, payload)

    assert send("hello") == grpc.StatusCode.OK
    assert _status(call, b"not a frame at all") == grpc.StatusCode.INVALID_ARGUMENT
    assert send("no-such-kind") == grpc.StatusCode.UNIMPLEMENTED
    assert send("forward", {"rows": torch.zeros(2)}, data="train") == grpc.StatusCode.INVALID_ARGUMENT  # dtype
    assert send("forward", {"rows": torch.zeros(2, 2, dtype=torch.int64)}, data="train") \
        == grpc.StatusCode.INVALID_ARGUMENT  # shape
    assert send("forward", {"rows": torch.tensor([10**6])}, data="train") == grpc.StatusCode.INVALID_ARGUMENT  # row
    assert send("forward", {"rows": torch.tensor([0])}, step=6, data="train") == grpc.StatusCode.OK
    assert send("backward", {"grad": torch.zeros(3, HIDDEN)}, step=6) == grpc.StatusCode.INVALID_ARGUMENT  # size
    assert send("forward", {"rows": torch.tensor([0])}, step=6, data="train") == grpc.StatusCode.ALREADY_EXISTS
    assert send("forward", {"rows": torch.tensor([0])}, step=2, data="train") == grpc.StatusCode.FAILED_PRECONDITION
    big = torch.zeros(2**19)  # 2 MB > the 1 MB limit of the parties
    assert send("forward", {"rows": big.long()}, step=7, data="train") == grpc.StatusCode.RESOURCE_EXHAUSTED
    replay = encode_request(Request("ping"), step=8, round=0, session="raw", seq=next(seq))
    assert _status(call, replay) == grpc.StatusCode.OK
    assert _status(call, replay) == grpc.StatusCode.ALREADY_EXISTS
    assert send("save", step=9, dir="../../etc") == grpc.StatusCode.INVALID_ARGUMENT
    assert send("forget", step=9, dir="/etc") == grpc.StatusCode.INVALID_ARGUMENT  # deletes only its own states
    with pytest.raises(PartyError, match="is serving another coordinator session"):
        _fed(deployment)  # a hello while the raw session is live: refused
    assert send("bye", step=10) == grpc.StatusCode.OK
    fed = _fed(deployment)  # a new session: the same server still answers normally
    fed.transport.new_step()
    assert fed.call(0, "ping").meta["name"] == "bank"
    assert send("ping", step=10**6) == grpc.StatusCode.ABORTED  # the old session is over
    fed.close()
    ch.close()


def _status(call: Any, payload: bytes) -> grpc.StatusCode:
    try:
        call(payload, timeout=PATIENCE)
    except grpc.RpcError as e:
        assert e.details()  # every refusal says why
        return e.code()
    return grpc.StatusCode.OK


@pytest.fixture
def typed(deployment, data):
    """The typed-message program at every party, in process and in the party processes."""
    configs = [{"feature_dim": int(d)} for d in data.feature_dims]
    local = LocalFederation.for_dataset(data)
    local.setup("test/grpc-typed", configs, seed=0)
    remote = _fed(deployment)
    remote.setup("test/grpc-typed", configs, seed=0)
    yield local, remote
    remote.close()


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_malformed_request_fails_alike_in_process_and_on_the_wire(typed, case) -> None:
    local, remote = typed
    kind, tensors, meta, says = BAD_REQUESTS[case]
    local.transport.new_step()
    with pytest.raises(MessageError) as here:
        local.call(0, kind, tensors, **meta)
    assert says in str(here.value) and str(here.value).startswith("party 0 ('bank'), program 'test/grpc-typed'")
    assert here.value.direction == ("request" if case != "unknown kind" else None)
    remote.transport.new_step()
    with pytest.raises(PartyError) as there:
        remote.call(0, kind, tensors, **meta)
    code = grpc.StatusCode.UNIMPLEMENTED if case == "unknown kind" else grpc.StatusCode.INVALID_ARGUMENT
    assert there.value.code == code and there.value.details == str(here.value)
    good, good_meta = _typed_request()
    if kind == "pair":  # one admission path: both transports count the refused request as sent in this round ...
        for fed in (local, remote):
            with pytest.raises(RuntimeError, match="already got a 'pair' request"):
                fed.call(0, "pair", good, **good_meta)
    # ... while the server keeps serving, and serves the kind it refused in the same step and round (not a replay)
    t = remote.grpc_transport
    payload = t._encode(Request("pair", good, {**good_meta, "step": t.step, "round": t.round}))
    assert decode_reply(t._calls[0].stream(chunks(payload), timeout=PATIENCE)).tensors["y"].shape == (4, 2)


@pytest.mark.slow
def test_a_repeated_kind_in_one_round_is_refused_alike_by_every_transport(deployment, data) -> None:
    """Transport.call_many is the one admission path: in process (batched or party by party) and over gRPC, a
    kind sent twice to a party in one round is refused before anything is sent, with the same words."""
    feds = [LocalFederation.for_dataset(data, batched=True), LocalFederation.for_dataset(data, batched=False),
            _fed(deployment)]
    said, batches = [], ToyBatchedParty.batches
    try:
        for fed in feds:
            handle = fed.attach(data, "train")
            fed.setup("test/grpc-batched", toy_configs(data.feature_dims), seed=0)
            fed.transport.new_step()
            rows = {k: torch.as_tensor(np.flatnonzero(data.observed[:, k])[:4]) for k in range(3)}
            forward = {k: Request("forward", {"rows": r}, {"data": handle}) for k, r in rows.items()}
            before = len(batches)
            assert set(fed.transport.call_many(forward)) == {0, 1, 2}
            assert batches[before:] == ([3] if fed is feds[0] else [])  # in process batched: one joint round
            sent = len(fed.log), getattr(fed.transport, "bytes_sent", 0)
            with pytest.raises(RuntimeError) as e:
                fed.transport.call_many({0: forward[0], 1: forward[1]}, tolerate=True)
            assert (len(fed.log), getattr(fed.transport, "bytes_sent", 0)) == sent  # nothing was sent or logged
            said.append(str(e.value).replace(f"step {fed.transport.step} ", "step N "))
            fed.transport.new_round()
            assert set(fed.transport.call_many({0: forward[0]})) == {0}  # a new round takes it
    finally:
        feds[2].close()
    assert said == ["party 0 already got a 'forward' request in step N round 0; call transport.new_round() "
                    "between rounds"] * 3, said


@pytest.mark.parametrize("bug", ["dtype", "rank", "size", "missing", "extra"])
def test_malformed_reply_of_a_buggy_program_fails_alike(typed, bug) -> None:
    local, remote = typed
    local.transport.new_step()
    with pytest.raises(MessageError) as here:
        local.call(0, "buggy", {"rows": torch.arange(3)}, bug=bug)
    assert here.value.direction == "reply" and "kind 'buggy', reply: " in str(here.value)
    remote.transport.new_step()
    with pytest.raises(PartyError) as there:
        remote.call(0, "buggy", {"rows": torch.arange(3)}, bug=bug)
    assert there.value.code == grpc.StatusCode.INTERNAL and there.value.details == str(here.value)
    remote.transport.new_step()
    assert remote.call(0, "ping").meta["name"] == "bank"


@pytest.mark.slow
def test_slow_party_past_the_deadline_is_missing_for_that_step(deployment, data, tmp_path) -> None:
    """Party 0 blocks in ``forward`` until the test opens its gate, so it is late by construction, not by a margin;
    the short deadline applies to that one call only, and the warmed-up parties 1 and 2 have ample time."""
    gate = tmp_path / "gate"
    fed = _fed(deployment)
    try:
        h = fed.attach(data, "train")
        configs = toy_configs(data.feature_dims)
        configs[0]["gate"] = str(gate)
        fed.setup("test/grpc-split", configs, seed=0)
        rows = np.flatnonzero(data.observed.all(axis=1))[:6]
        fed.transport.new_step()  # warm up the other two at the generous deadline
        fed.transport.call_many({k: Request("forward", {"rows": torch.as_tensor(rows)}, {"data": h}) for k in (1, 2)})
        fed.transport.new_step()
        fed.grpc_transport.deadline = 10.0
        try:
            total, embs = toy_forward(fed, h, data.observed, rows)
        finally:
            fed.grpc_transport.deadline = PATIENCE
        assert not gate.exists()  # the call returned while party 0 was still blocked: nobody waited for it
        assert set(embs) == {1, 2} and total.shape == (6, HIDDEN)
        step, party, reason = fed.transport.failures[-1]
        assert (step, party) == (fed.transport.step, 0) and "DEADLINE_EXCEEDED" in reason
        gate.touch()
        fed.transport.new_step()
        assert fed.call(0, "ping").meta["name"] == "bank"  # the slow party finished late and keeps serving
    finally:
        gate.touch()  # never leave party 0 blocked for the next tests
        fed.close()


@pytest.mark.slow
def test_coordinator_killed_mid_training_resumes_to_the_same_parameters(deployment, data, tmp_path) -> None:
    def coordinator(out: Path, crash_at: int | None) -> int:
        code = ("import sys, test_grpc; sys.exit(test_grpc._coordinator_main(sys.argv[1:]))")
        args = [sys.executable, "-c", code, str(deployment.federation_file), str(tmp_path / "ck"), str(out),
                str(crash_at or 0)]
        return subprocess.run(args, env=deployment.env(), timeout=1200, capture_output=True).returncode

    assert coordinator(tmp_path / "a.json", crash_at=8) == -signal.SIGKILL
    assert (tmp_path / "ck" / "LATEST").exists() and json.loads((tmp_path / "ck" / "LATEST").read_text())["step"] == 6
    with pytest.raises(PartyError, match="is serving another coordinator session"):  # the dead one's sessions
        GrpcFederation.from_config(deployment.federation_file)  # are live: without their secrets, refused
    assert _coordinator_main([str(deployment.federation_file), str(tmp_path / "ck"), str(tmp_path / "b.json"),
                              "0"]) == 0  # a new coordinator (here: this process) resumes from step 6
    resumed = json.loads((tmp_path / "b.json").read_text())
    assert resumed["start"] == 6
    local = LocalFederation.for_dataset(data)
    h = local.attach(data, "train")
    ref = toy_train(local, h, _train_obs(data), _train_y(data), 3, steps=10, seed=3)
    np.testing.assert_allclose(resumed["head"], ref.weight.detach().numpy(), rtol=1e-6, atol=1e-7)
    for k in range(3):
        np.testing.assert_allclose(resumed["w"][str(k)], local.runtimes[k].program.w.detach().numpy(), rtol=1e-6,
                                   atol=1e-7)


def _coordinator_main(argv: list[str]) -> int:
    """A coordinator process for the crash test: toy training with checkpoints every 3 steps."""
    torch.set_num_threads(1)
    fed_file, ck_dir, out, crash_at = argv[0], Path(argv[1]), Path(argv[2]), int(argv[3])
    data = mostly_labeled_data()
    # the session secrets live with the checkpoints: a coordinator that really restarted proves it holds the
    # parties' sessions (the killed one never said bye, so a coordinator without them would be refused)
    fed = GrpcFederation.from_config(fed_file, session_file=ck_dir / "sessions.json")
    h = fed.attach(data, "train")
    ck = Checkpointer(ck_dir, fed, every=3)
    start = (ck.latest().step if ck.latest() else 0)
    head = toy_train(fed, h, _train_obs(data), _train_y(data), 3, steps=10, seed=3, ckpt=ck,
                     crash_at=crash_at or None)
    w = party_weights(fed)
    out.write_text(json.dumps({"start": start, "head": head.weight.detach().tolist(),
                               "w": {str(k): v.tolist() for k, v in w.items()}}))
    fed.close()
    return 0


@pytest.fixture
def toy_method():
    space = inferred_space(ToySplitMethod.default_params(), {p: lambda ds: {} for p in ToySplitMethod.presets})
    register_spec(MethodSpec(ToySplitMethod.name, "a toy split network", f"{__name__}:ToySplitMethod", space))
    yield ToySplitMethod
    unregister(ToySplitMethod.name)


@pytest.mark.slow
def test_old_checkpoints_are_pruned_at_the_coordinator_and_at_every_party(deployment, data, tmp_path) -> None:
    """fit --checkpoint-every with FALSE-VFL over gRPC keeps the last two checkpoints, here and on every party's disk.

    (A coordinator killed mid-fit resumes to the uninterrupted parameters: tests/test_kill_resume.py, every family.)
    """
    from partialvfl.cli import main

    def fit_args(out: Path) -> list[str]:
        tiny = {"pretrain_epochs": 2, "epochs": 2, "pretrain_batch_size": 16, "batch_size": 16, "d_h": 4,
                "d_z": 2, "importance_samples": 2, "encoder_hidden": [8], "decoder_hidden": [8], "global_hidden": [8],
                "discriminator_hidden": [8], "mask_hidden": [8]}
        params = [a for k, v in tiny.items() for a in ("--param", f"{k}={json.dumps(v)}")]
        return ["fit", "--federation", str(deployment.federation_file), "--method", "false-vfl-2", "--seed", "2",
                "--out", str(out), *params]

    pruned = tmp_path / "pruned"  # checkpoints after 3, 6, 9, 12: the last two are kept, here and at the parties
    assert main([*fit_args(pruned), "--checkpoint-every", "3", "--quiet"]) == 0
    ck = pruned / "checkpoints"
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-000000009", "step-000000012"]
    for name in data.party_names:
        for step, kept in ((3, False), (6, False), (9, True), (12, True)):
            party_dir = deployment.dir / "state" / name / GrpcFederation.party_dir_for(ck / f"step-{step:09d}")
            assert party_dir.is_dir() == kept, (name, step)


@pytest.mark.slow
def test_cli_fit_and_predict_over_grpc(deployment, data, tmp_path, toy_method) -> None:
    from partialvfl.cli import main

    model = tmp_path / "model"
    assert main(["fit", "--federation", str(deployment.federation_file), "--method", "test-toy-split", "--seed", "4",
                 "--out", str(model), "--checkpoint-every", "5", "--param", "steps=6", "--quiet"]) == 0
    assert (model / "model.json").exists() and (model / "party_states.json").exists()
    assert (model / "checkpoints" / "LATEST").exists()
    party_dir = json.loads((model / "party_states.json").read_text())["party_dir"]
    for name in data.party_names:  # each party's state is on its own disk
        assert (deployment.dir / "state" / name / party_dir).is_dir()
    fitted = torch.load(model / "coordinator.pt", weights_only=True)["head"]
    fit_args = ["fit", "--federation", str(deployment.federation_file), "--method", "test-toy-split", "--seed", "4",
                "--out", str(model), "--param", "steps=6", "--quiet"]
    assert main(fit_args) == 2  # a checkpoint is there: refuse to start over silently
    assert main([*fit_args, "--resume"]) == 0  # restores step 5 everywhere, redoes step 6: same model
    for name, t in torch.load(model / "coordinator.pt", weights_only=True)["head"].items():
        torch.testing.assert_close(t, fitted[name], rtol=0, atol=0)
    ids_file = tmp_path / "ids.csv"
    ids_file.write_text("id\n" + "\n".join(str(i) for i in data.ids[:20]) + "\nnobody-has-this\n")
    out = tmp_path / "pred.csv"
    assert main(["predict", "--federation", str(deployment.federation_file), "--model", str(model), "--ids",
                 str(ids_file), "--out", str(out), "--allow-prior-only"]) == 0  # "nobody-has-this": the prior
    import pandas as pd

    pred = pd.read_csv(out, dtype={"id": str})
    assert len(pred) == 21 and set(pred["prediction"]) <= {"a", "b", "c"}
    assert pred["n_parties"].iloc[-1] == 0 and pred["n_parties"].iloc[0] == int(data.observed[0].sum())
    probs = pred[["p_a", "p_b", "p_c"]].to_numpy()
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.slow
def test_killed_party_during_prediction_is_missing_not_fatal(deployment, data) -> None:
    fed = _fed(deployment, allow_absent=True)
    try:
        h = fed.attach(data, "train")
        toy_train(fed, h, _train_obs(data), _train_y(data), 3, steps=2, seed=0)
        rows = np.flatnonzero(data.observed.any(axis=1))
        answered = []
        for i, start in enumerate(range(0, len(rows), 12)):
            if i == 1:
                deployment.kill(1)  # party 1 crashes between two prediction requests
            batch = rows[start:start + 12]
            fed.transport.new_step()
            t0 = time.monotonic()
            total, embs = toy_forward(fed, h, data.observed, batch)
            assert time.monotonic() - t0 < fed.grpc_transport.deadline
            answered.append(set(embs))
            assert total.shape == (len(batch), HIDDEN)
        assert 1 in answered[0] and all(1 not in a and a for a in answered[1:])
        assert any(f[1] == 1 for f in fed.transport.failures)
    finally:
        fed.close()  # the last test of the module: party 1 stays down


def test_certs_init_command_writes_a_working_pki(tmp_path) -> None:
    from cryptography import x509

    from partialvfl.cli import main

    assert main(["certs", "init", str(tmp_path), "--parties", "bank", "shop"]) == 0
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((tmp_path / "shop.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "shop" in sans.get_values_for_type(x509.DNSName)
    assert (tmp_path / "coordinator.key").stat().st_mode & 0o077 == 0
    assert len(load_key(tmp_path / "alignment.key")) == 32 and not (tmp_path / "hmac.key").exists()
    assert (tmp_path / "alignment.key").stat().st_mode & 0o077 == 0


def test_party_table_reads_its_own_csv_and_names_bad_input(tmp_path) -> None:
    from partialvfl.federation.grpc.party_config import PartyConfig
    from partialvfl.federation.grpc.party_tables import PartyTable

    def table(text: str, **kw: Any) -> PartyTable:
        (tmp_path / "t.csv").write_text(text)
        cfg = PartyConfig(name="shop", index=1, address="127.0.0.1:0", data_path=tmp_path / "t.csv",
                          id_column="cid", tls=TlsFiles(tmp_path, tmp_path, tmp_path), state_dir=tmp_path,
                          hmac_key_file=tmp_path / "k", **kw)
        return PartyTable(cfg, b"k" * 32)

    t = table("cid,age,label,spend\n007,30,yes,1.5\n8,41,no,2.0\n", exclude_columns=("label",))
    assert t.feature_names == ("age", "spend") and t.features.dtype == np.float32 and t.features.shape == (2, 2)
    assert list(t.ids) == ["007", "8"]  # IDs are text: leading zeros kept
    np.testing.assert_array_equal(t.hashes[1], hash_ids([8], b"k" * 32)[0])
    with pytest.raises(ValueError, match="ID column 'cid' not found"):
        table("id,age\n1,2\n")
    with pytest.raises(ValueError, match="column 'label'.*not numeric"):
        table("cid,age,label\n1,2,yes\n")
    with pytest.raises(ValueError, match=r"column 'age'.*missing \(NaN\) for ID '2'"):
        table("cid,age\n1,2\n2,\n")
    with pytest.raises(ValueError, match="ID 1 at rows 0 and 1; IDs must be unique"):
        table("cid,age\n1,2\n1,3\n")
