"""A restarted party continues its coordinator session (it does not rejoin): its session, alignment, data and program
come back from its own disk, the coordinator continues the session with one authenticated ``hello``, nothing served
before is served again, and nothing is computed again at the other parties.

In process (party servers driven request by request, no network): a server restarted from another's state
directory answers the rest of a training run exactly as the uninterrupted one; a request it had served when it went
down is answered again from what it kept, not applied twice.  Over gRPC (real party processes, slow): a party killed
(SIGKILL) in the middle of a fit and started again is continued within the running step, the fit ends in the weights
of an uninterrupted fit, and the other parties saw one ``hello`` only."""

from __future__ import annotations

import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from helpers import PATIENCE
from partialvfl import Task, VerticalDataset
from partialvfl.federation.grpc.frames import WireRequest
from partialvfl.federation.grpc.limits import Refused
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.grpc.party import PartyServer
from partialvfl.federation.grpc.party_config import load_party_config
from partialvfl.federation.grpc.sessions import SessionGuard, secret_digest
from partialvfl.federation.trust.access_log import read_access_log
from partialvfl.federation.trust.alignment import write_key
from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.federation.wire.setup_config import OptimiserSetup
from partialvfl.methods import get_method
from partialvfl.methods.splitnn.party import SplitSetup
from partialvfl.orchestration import FitOptions, run_fit


# ---------------------------------------------------------------------- the session guard
def _wire(kind: str, seq: int, step: int = 0, lane: int = 0, session: str = "s", **meta: Any) -> WireRequest:
    return WireRequest(Request(kind, {}, meta), step, 0, session, seq, lane)


def test_a_restored_session_serves_nothing_until_its_coordinator_continues_it() -> None:
    guard = SessionGuard("bank")
    guard.restore("s", secret_digest("the secret"), idle_for=1.0)
    for refused in (_wire("embed", 5), _wire("hello", 5, resume="another", continue_session=True),
                    _wire("hello", 5, resume="the secret", continue_session=True, session="other")):
        with pytest.raises(Refused) as e:
            guard.check(refused)
        assert e.value.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED)
    guard.check(_wire("bye", 5))  # its coordinator may end it (then the files go) ...
    guard.check(_wire("hello", 5, session="other"))  # ... and, not continued yet, it holds no coordinator off
    hello = _wire("hello", 7, step=3, resume="the secret", continue_session=True, lane_seqs={"1": 40})
    guard.check(hello)
    assert guard.commit(hello) == {"session_secret": "the secret"} and guard.resumed
    for replayed in (_wire("embed", 6, step=3), _wire("embed", 40, step=3, lane=1)):  # sent before the hello
        with pytest.raises(Refused, match="replayed"):
            guard.check(replayed)
    guard.check(_wire("embed", 8, step=3))
    guard.check(_wire("embed", 41, step=3, lane=1))
    with pytest.raises(Refused, match="another coordinator session"):  # continued: live again, as any session
        guard.check(_wire("hello", 9, session="other"))


def test_a_session_gone_idle_cannot_be_continued() -> None:
    guard = SessionGuard("bank", idle_seconds=5.0)
    guard.restore("s", secret_digest("x"), idle_for=6.0)
    with pytest.raises(Refused, match="no such session to continue"):
        guard.check(_wire("hello", 2, resume="x", continue_session=True))
    guard.check(_wire("hello", 2, session="other"))  # a new coordinator may open one


# ---------------------------------------------------------------------- a party server, restarted
def _server_files(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = "\n".join(f"c{i},{a:.5f},{b:.5f},{c:.5f}" for i, (a, b, c) in enumerate(rng.normal(size=(40, 3))))
    (directory / "shop.csv").write_text("id,a,b,c\n" + rows + "\n")
    write_key(directory / "hmac.key")
    config = directory / "shop.toml"
    config.write_text('[party]\nname = "shop"\nindex = 1\nstate_dir = "state"\nalignment = "hmac"\n'
                      'hmac_key_file = "hmac.key"\n[data]\npath = "shop.csv"\nid_column = "id"\n'
                      '[tls]\nca = "a"\ncert = "b"\nkey = "c"\n[policy]\npreset = "research"\n')
    return config


class Driver:
    """Requests to a :class:`PartyServer` as a coordinator's transport stamps them (one session, rising sequence)."""

    def __init__(self, server: PartyServer, seq: int = 0) -> None:
        self.server, self.seq = server, seq

    def __call__(self, kind: str, tensors: dict[str, torch.Tensor] | None = None, step: int = 0,
                 **meta: Any) -> Reply:
        self.seq += 1
        wire = WireRequest(Request(kind, dict(tensors or {}), meta), step, 0, "session-1", self.seq)
        return self.server._serve(wire, {"kind": kind}, "coordinator-key")


def _training(shop: Driver, server: PartyServer, steps: range) -> list[torch.Tensor]:
    """Piggy-backed split-learning steps on rows of the attached handle: each gradient carries the next rows."""
    out = []
    for step in steps:
        rows = torch.arange(step % 5, 40, 5)
        nxt = torch.arange((step + 1) % 5, 40, 5)
        grad = torch.full((len(rows), 4), 0.01 * step)
        reply = shop("grad_embedding", {"grad:f": grad, "next:f": nxt}, step=step, data="train", train=True)
        out.append(reply.tensors["emb:f"])
    return out


def _trained(config: Path) -> tuple[PartyServer, Driver, str]:
    """A party server in a session: set up, its training table attached and standardised, a first training forward
    pending; with its driver and the session's secret."""
    server = PartyServer(load_party_config(config))
    shop = Driver(server)
    secret = shop("hello").meta["session_secret"]
    setup = SplitSetup(feature_shape=(3,), models=("f",), latent_dim=4, encoder="mlp", encoder_hidden=(8,),
                       optimizer=OptimiserSetup(name="adam", lr=0.01)).to_wire()
    shop("setup", program="splitnn/party", config=setup, seed=3)
    shop("attach", {"hashes": torch.from_numpy(server.table.hashes.copy()), "rows": torch.arange(40)},
         handle="train", n_samples=40)
    shop("preprocess", data="train", standardize=True)
    shop("embed", {"rows:f": torch.arange(0, 40, 5)}, step=1, data="train", train=True)
    return server, shop, secret


def _params(server: PartyServer) -> dict[str, torch.Tensor]:
    st = server.runtime.program.state_dict()
    return {k: v.clone() for k, v in st["models"]["f"].items()}


def test_a_restarted_party_server_continues_its_session_where_it_was(tmp_path: Path) -> None:
    first, shop, secret = _trained(_server_files(tmp_path / "a"))
    _training(shop, first, range(1, 4))
    kept_seq = shop.seq
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # its disk as it was when it went down
    # the uninterrupted party goes on ...
    later = _training(shop, first, range(4, 7))
    expected = _params(first)
    # ... the restarted one (the same configuration, the state directory it left) reads its session back
    second = PartyServer(load_party_config(tmp_path / "b" / "shop.toml"))
    assert second.restored is not None and second.restored["program"] == "splitnn/party"
    again = Driver(second, seq=kept_seq + 50)
    with pytest.raises(Refused, match="continue"):  # nothing before the coordinator continues the session
        again("grad_embedding", {"grad:f": torch.zeros(8, 4)}, step=4)
    hello = again("hello", step=4, resume=secret, continue_session=True)
    assert hello.meta["continued"] and hello.meta["holds"]["handles"] == ["train"]
    assert hello.meta["holds"]["mid_step"]
    resumed = _training(again, second, range(4, 7))
    for a, b in zip(resumed, later):
        assert torch.equal(a, b)
    for name, value in _params(second).items():
        assert torch.equal(value, expected[name]), name


def test_a_request_served_just_before_the_party_went_down_is_not_applied_twice(tmp_path: Path) -> None:
    config = _server_files(tmp_path)
    first, shop, secret = _trained(config)
    last = _training(shop, first, range(1, 3))[-1]  # its reply never reached the coordinator: the party went down
    params = _params(first)
    second = PartyServer(load_party_config(config))
    again = Driver(second, seq=shop.seq + 10)
    again("hello", step=2, resume=secret, continue_session=True)
    rows, nxt = torch.arange(2, 40, 5), torch.arange(3, 40, 5)
    reply = again("grad_embedding", {"grad:f": torch.full((len(rows), 4), 0.02), "next:f": nxt}, step=2,
                  data="train", train=True)  # the same request again
    assert torch.equal(reply.tensors["emb:f"], last)
    for name, value in _params(second).items():
        assert torch.equal(value, params[name]), name


# ---------------------------------------------------------------------- over gRPC: a party killed mid-fit
def _data(n: int = 60, seed: int = 1) -> VerticalDataset:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    blocks = [rng.normal(size=(n, d)) + y[:, None] for d in (3, 4, 2)]
    obs = np.ones((n, 3), bool)
    obs[45:, 1] = False
    for k, b in enumerate(blocks):
        b[~obs[:, k]] = np.nan
    return VerticalDataset(blocks, obs, ids=[f"c{i:03d}" for i in range(n)], y=y, labeled=np.arange(n) < 40,
                           task=Task.classification(["no", "yes"]), active_party=0,
                           party_names=["bank", "shop", "telco"])


FIT = {"latent_dim": 4, "encoder_hidden": [8], "epochs": 3, "batch_size": 8}


def _fit(dep: LocalDeployment, on_epoch: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
    from partialvfl.federation.grpc.federation import GrpcFederation

    fed = GrpcFederation.from_config(dep.federation_file, connect=False)
    try:
        model = get_method("laser-vfl")("fast", seed=3, **FIT)
        result = run_fit(model, fed, FitOptions(party_timeout=timeout), on_epoch=on_epoch)
        view, handle = fed.align(handle="check")
        proba = result.model.predict_output_federated(view, handle)
        fed.release(handle)
        return result, proba[np.argsort(np.asarray([str(i) for i in view.ids], dtype=object))]
    finally:
        fed.close()


@pytest.mark.slow
def test_a_party_killed_mid_fit_and_restarted_continues_the_session(tmp_path: Path) -> None:
    """The telco is killed (SIGKILL) after the first epoch and started again (same configuration and state
    directory): the fit, waiting for it, continues the session there within the running step and ends in the
    predictions of an uninterrupted fit; the bank and the shop saw one hello (no rejoin, nothing redone)."""
    policy = {"seed": 17, "resume_alignment_by_name": True}  # pinned seeds, the same order: fits comparable
    with LocalDeployment(tmp_path / "fed", _data(), deadline=PATIENCE, start_timeout=600.0, policy=policy) as dep:
        dep.start()
        _, reference = _fit(dep)
        logs = {name: len(read_access_log(dep.dir / "state" / name / "access.log")) for name in dep.names}
        events: list[str] = []

        def on_epoch(stage: str, epoch: int, metrics: dict[str, float]) -> None:
            if stage == "train" and epoch == 1:
                dep.kill(2, signal.SIGKILL)
                threading.Thread(target=lambda: (dep.start([2]), events.append("listening"))).start()

        result, proba = _fit(dep, on_epoch, timeout=PATIENCE)
        assert events == ["listening"] and result.party_failures == 0
        np.testing.assert_array_equal(proba, reference)
        for name in dep.names:
            entries = read_access_log(dep.dir / "state" / name / "access.log")[logs[name]:]
            hellos = [e for e in entries if e["kind"] == "hello" and e["outcome"] == "served"]
            assert len(hellos) == (2 if name == "telco" else 1), name  # the session's (+ the continuation)
        assert "restored its coordinator session" in (dep.dir / "party-2.log").read_text()
