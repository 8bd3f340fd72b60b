"""A party process owns its side: sessions, sockets, its policy on the wire, its access log, prediction tables.

Real ``party serve`` processes with their default policy (seed pinned in their files); the party processes import
this module as a plugin (``PYTHONPATH`` = this folder) for the leaky program below.  No test depends on speed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pandas as pd
import pytest
import torch

from helpers import PATIENCE
from partialvfl import Task, VerticalDataset
from partialvfl.cli import main
from partialvfl.federation import MessageSpec, PartyProgram, Reply, Request, TensorSpec, register_program
from partialvfl.federation.grpc.certs import issue_certificate
from partialvfl.federation.grpc.federation_file import load_federation_config
from partialvfl.federation.grpc.frames import CALL_METHOD, decode_reply, encode_request
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.grpc.transport import PartyError
from partialvfl.federation.trust.access_log import read_access_log

HERE = Path(__file__).resolve().parent


@register_program
class LeakyParty(PartyProgram):
    """A buggy (or malicious) plugin program that answers with its own weights."""

    program_name = "test/leaky"
    messages = {"weights": MessageSpec(reply=[TensorSpec("w", "float32", (4, 3))])}

    def __init__(self, runtime, config, seed):
        super().__init__(runtime, config, seed)
        self.layer = torch.nn.Linear(4, 3)

    def on_weights(self, req: Request) -> Reply:
        return Reply({"w": self.layer.weight.detach().T.contiguous()})


def two_party_data(n: int = 40, seed: int = 2, prefix: str = "u", labeled: bool = True) -> VerticalDataset:
    """Two parties (widths 3, 4), two classes, party 1 missing every fifth row; all rows labelled or none."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    dims = (3, 4)
    blocks = [rng.normal(size=(n, d)) + y[:, None] for d in dims]
    obs = np.ones((n, 2), bool)
    obs[::5, 1] = False
    blocks[1][~obs[:, 1]] = np.nan
    return VerticalDataset(blocks, obs, ids=[f"{prefix}{i:03d}" for i in range(n)], y=y,
                           labeled=np.full(n, labeled), task=Task.classification([0, 1]), active_party=0,
                           party_names=["bank", "shop"])


@pytest.fixture(scope="module")
def data() -> VerticalDataset:
    return two_party_data()


@pytest.fixture(scope="module")
def new_users() -> VerticalDataset:
    return two_party_data(12, seed=9, prefix="new", labeled=False)


@pytest.fixture(scope="module")
def dep(tmp_path_factory, data, new_users):
    policy = {"seed": 5, "programs": ["builtin", "test/leaky"], "unchecked_programs": ["test/leaky"],
              "max_handles": 4}
    d = LocalDeployment(tmp_path_factory.mktemp("hardening"), data, plugins=["test_party_hardening"],
                        pythonpath=[HERE], deadline=PATIENCE, max_message_mb=1.0, start_timeout=600.0,
                        policy=policy, predict={"new-users": new_users})
    try:
        d.start()
        yield d
    finally:
        d.close()


class RawCoordinator:
    """Hand-made requests to party 0 from an allowlisted certificate (session ``name``)."""

    def __init__(self, dep: LocalDeployment, session: str, cert: str = "coordinator") -> None:
        cfg = load_federation_config(dep.federation_file)
        ca = cfg.tls.ca.read_bytes()
        certs = dep.certs if cert == "coordinator" else Path(cert)
        name = "coordinator" if cert == "coordinator" else "intruder"
        creds = grpc.ssl_channel_credentials(ca, (certs / f"{name}.key").read_bytes(),
                                             (certs / f"{name}.pem").read_bytes())
        self.channel = grpc.secure_channel(cfg.parties[0].address, creds,
                                           options=[("grpc.ssl_target_name_override", "bank"),
                                                    ("grpc.max_send_message_length", 8 * 2**20)])
        self.call = self.channel.unary_unary(CALL_METHOD)
        self.session = session
        self.seq = 0

    def send(self, kind: str, tensors: dict[str, torch.Tensor] | None = None, step: int = 1,
             **meta: Any) -> tuple[grpc.StatusCode, str]:
        self.seq += 1
        payload = encode_request(Request(kind, tensors or {}, meta), step=step, round=0, session=self.session,
                                 seq=self.seq)
        try:
            self.reply = decode_reply(self.call(payload, timeout=PATIENCE))
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    def send_bytes(self, payload: bytes) -> tuple[grpc.StatusCode, str]:
        """A frame made by hand (not by :func:`encode_request`)."""
        try:
            self.reply = decode_reply(self.call(payload, timeout=PATIENCE))
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    def close(self) -> None:
        self.channel.close()


@pytest.mark.slow
def test_a_hello_while_a_session_is_live_is_refused_and_leaves_it_as_it_was(dep) -> None:
    live, other = RawCoordinator(dep, "live"), RawCoordinator(dep, "other")
    try:
        assert live.send("hello")[0] == grpc.StatusCode.OK
        secret = live.reply.meta["session_secret"]
        assert isinstance(secret, str) and len(secret) == 64
        for meta in ({}, {"resume": "0" * 64}):  # an allowlisted peer's hello, with a guessed secret or none ...
            code, why = other.send("hello", **meta)
            assert code == grpc.StatusCode.ABORTED and "is serving another coordinator session" in why, why
            assert "that session was left as it is" in why and "session_idle_seconds" in why
        code, why = other.send("hello", {"x": torch.zeros(2)})  # a malformed one too
        assert code == grpc.StatusCode.ABORTED
        assert live.send("ping", step=2) == (grpc.StatusCode.OK, "")  # ... and the live session goes on
        code, why = other.send("ping", step=3)
        assert code == grpc.StatusCode.ABORTED and "no longer serves this coordinator session" in why
        assert other.send("hello", resume=secret)[0] == grpc.StatusCode.OK  # it proves it holds the session
        assert other.reply.meta["session_secret"] == secret  # resumed, not a new one
        code, why = live.send("ping", step=4)  # the session moved to the coordinator that proved it held it
        assert code == grpc.StatusCode.ABORTED and "another session took over" in why, why
        assert other.send("bye", step=5) == (grpc.StatusCode.OK, "")  # ended: anyone allowlisted may start one
        assert live.send("hello", step=6)[0] == grpc.StatusCode.OK
        assert live.reply.meta["session_secret"] != secret
        assert live.send("bye", step=7)[0] == grpc.StatusCode.OK
    finally:
        live.close()
        other.close()
    entries = read_access_log(dep.dir / "state" / "bank" / "access.log")
    assert [e["status"] for e in entries if e["kind"] == "hello"][-6:] == [
        "OK", "ABORTED", "ABORTED", "ABORTED", "OK", "OK"]  # every refusal is logged


@pytest.mark.slow
def test_a_silent_session_can_be_taken_over_after_the_idle_timeout(tmp_path) -> None:
    with LocalDeployment(tmp_path, two_party_data(12), deadline=PATIENCE, start_timeout=600.0, policy="default",
                         session_idle_seconds=1.0) as d:
        d.start([0])
        live, other = RawCoordinator(d, "live"), RawCoordinator(d, "other")
        try:
            assert live.send("hello")[0] == grpc.StatusCode.OK
            time.sleep(1.5)  # no request for longer than the party's idle timeout
            assert other.send("hello")[0] == grpc.StatusCode.OK
            assert live.send("ping", step=2)[0] == grpc.StatusCode.ABORTED
        finally:
            live.close()
            other.close()


@pytest.mark.slow
def test_a_second_party_on_an_address_in_use_fails_at_start_with_a_clear_error(dep, tmp_path) -> None:
    text = dep.party_config_file(0).read_text()
    port = dep.ports[0]
    text = text.replace('address = "127.0.0.1:0"', f'address = "127.0.0.1:{port}"')  # as the running party
    text = "\n".join(line for line in text.splitlines() if not line.startswith("port_file"))
    second = tmp_path / "second.toml"
    second.write_text(text)
    assert f"127.0.0.1:{port}" in text
    done = subprocess.run([sys.executable, "-m", "partialvfl", "party", "serve", "--config", str(second)],
                          env=dep.env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: party 'bank': cannot listen on 127.0.0.1:{port}: the address is in use (is another party serving "
        "there?) or not an address of this host")
    fed = dep.federation()  # the first party still answers
    assert fed.party_info[0]["name"] == "bank"
    fed.close()


def test_a_peer_not_on_the_allowlist_is_refused_before_its_body_is_read(dep, tmp_path) -> None:
    issue_certificate(tmp_path / "intruder", "intruder", ca_cert=dep.certs / "ca.pem", ca_key=dep.certs / "ca.key")
    intruder = RawCoordinator(dep, "x", cert=str(tmp_path / "intruder"))
    try:
        big = {"rows": torch.zeros(2**19, dtype=torch.int64)}  # 4 MB: over the party's 1 MB request limit
        code, why = intruder.send("hello", big)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "not on its allowlist" in why  # not RESOURCE_EXHAUSTED
    finally:
        intruder.close()
    ok = RawCoordinator(dep, "y")
    try:
        assert ok.send("hello", big)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED  # an allowed peer: the size limit
    finally:
        ok.close()


def test_the_policy_holds_over_the_wire(dep, data) -> None:
    fed = dep.federation()
    try:
        cfg = {"feature_dim": 3, "feature_shape": [3], "models": ["f"], "latent_dim": 3, "encoder": "mlp",
               "encoder_hidden": [], "optimizer": {"name": "sgd", "lr": 0.0, "weight_decay": 0.0}}
        fed.transport.new_step()
        with pytest.raises(PartyError) as err:
            fed.call(0, "setup", program="splitnn/party", config=cfg, seed=1)
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "policy rule 'min_hidden_layers': model 'f' is an MLP with 0 hidden layer(s)" in err.value.details
        fed.transport.new_step()
        fed.call(0, "setup", program="test/leaky", config={}, seed=1)  # allowed, unchecked ...
        fed.transport.new_step()
        with pytest.raises(PartyError) as err:  # ... but its weights are not sent
            fed.call(0, "weights")
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and "'allow_weight_sharing'" in err.value.details
        assert "holds the values of its state tensor layer.weight" in err.value.details  # transposed: still
        for i in range(4):  # max_handles = 4
            fed.attach(data, f"h{i}")
        with pytest.raises(PartyError, match="policy rule 'max_handles'"):
            fed.attach(data, "one-too-many")
        for i in range(4):
            fed.release(f"h{i}")
        fed.attach(data, "fine-again")
        fed.release("fine-again")
    finally:
        fed.close()


def test_every_request_answered_or_refused_is_in_the_access_log(dep, data) -> None:
    log_file = dep.dir / "state" / "bank" / "access.log"
    before = len(read_access_log(log_file)) if log_file.exists() else 0
    fed = dep.federation()
    try:
        fed.attach(data, "audit")
        fed.transport.new_step()
        with pytest.raises(PartyError):
            fed.call(0, "setup", program="no/such", config={}, seed=0)
        fed.release("audit")
    finally:
        fed.close()
    entries = read_access_log(log_file)[before:]
    kinds = [(e["kind"], e["outcome"]) for e in entries]
    # the bank is the label holder: no alignment key, its tokens come blinded through a keyed party
    assert kinds == [("hello", "served"), ("psu_open", "served"), ("psu_blind", "served"), ("psu_unblind", "served"),
                     ("attach", "served"), ("setup", "refused"), ("release", "served"), ("bye", "served")], kinds
    hello, _, blind, unblind, attach, setup, _, _ = entries
    assert hello["peer"] == "coordinator" and hello["address"].startswith("ipv4:127.0.0.1")
    held = int(data.observed[:, 0].sum())
    assert blind["reply"] == {"points": [[held, 32], "uint8"]} and blind["reply_bytes"] > 0
    assert unblind["request"] == {"points": [[held, 32], "uint8"]} and unblind["reply"] == {"tokens": [[held, 32],
                                                                                                        "uint8"]}
    assert attach["request"]["rows"] == [[int(data.observed[:, 0].sum())], "int64"]
    assert attach["meta"] == {"handle": "audit", "n_samples": len(data.ids)} and attach["status"] == "OK"
    assert setup["status"] == "PERMISSION_DENIED" and "'no/such' is not one this party runs" in setup["reason"]
    assert {"time", "step", "round", "session"} <= set(attach)


def test_new_users_are_predicted_from_their_own_table_and_never_trained_on(dep, data, new_users,
                                                                           tmp_path) -> None:
    model = tmp_path / "model"
    fit = ["fit", "--federation", str(dep.federation_file), "--method", "vanilla-vfl", "--seed", "1", "--out",
           str(model), "--quiet", "--param", "latent_dim=4", "--param", "encoder_hidden=[8]", "--param", "epochs=2"]
    assert main(fit) == 0
    fed = dep.federation()
    try:  # the fit's alignment never sees the new users: they are in no training table
        view, handle = fed.align(handle="check")
        new = {bytes(h).hex() for h in fed.id_tokens(new_users.ids)}
        assert view.n_samples == len(data.ids) and not new & set(view.ids)
        fed.release(handle)
    finally:
        fed.close()
    ids = tmp_path / "new.csv"
    ids.write_text("id\n" + "\n".join([*new_users.ids, "u000"]) + "\n")
    out = tmp_path / "pred.csv"
    assert main(["predict", "--federation", str(dep.federation_file), "--model", str(model), "--ids", str(ids),
                 "--table-set", "new-users", "--out", str(out)]) == 2  # u000 is held by no party: refused
    assert main(["predict", "--federation", str(dep.federation_file), "--model", str(model), "--ids", str(ids),
                 "--table-set", "new-users", "--out", str(out), "--allow-prior-only"]) == 0
    pred = pd.read_csv(out, dtype={"id": str}, keep_default_na=False)
    held = [";".join(n for k, n in enumerate(new_users.party_names) if new_users.observed[i, k])
            for i in range(len(new_users.ids))]
    assert list(pred["parties"]) == [*held, ""]  # u000 is a training user, not in the new-users tables
    np.testing.assert_allclose(pred[["p_0", "p_1"]].sum(axis=1), 1.0, rtol=1e-6)


def test_rows_of_a_prediction_table_only_answer_inference_messages(dep, data, new_users) -> None:
    fed = dep.federation()
    try:
        fed.attach(data, "train")
        view, handle = fed.attach_ids(new_users.ids, table="new-users")
        cfg = [{"feature_dim": d, "feature_shape": [d], "models": ["f"], "latent_dim": 4, "encoder": "mlp",
                "encoder_hidden": [8], "optimizer": {"name": "sgd", "lr": 0.1, "weight_decay": 0.0}}
               for d in data.feature_dims]
        fed.setup("splitnn/party", cfg, seed=0)
        new_rows = torch.as_tensor(np.flatnonzero(view.observed[:, 0]))

        def call(kind: str, tensors: dict[str, torch.Tensor] | None = None, **meta: Any) -> Any:
            fed.transport.new_step()
            return fed.call(0, kind, tensors, **meta)

        with pytest.raises(PartyError, match="policy rule 'prediction_tables': 'embed' with train=true"):
            call("embed", {"rows:f": new_rows}, data=handle, train=True)
        assert call("embed", {"rows:f": new_rows}, data=handle, train=False).tensors["emb:f"].shape == (12, 4)
        with pytest.raises(PartyError, match="'grad_embedding' after rows of the prediction-only data set"):
            call("grad_embedding", {"grad:f": torch.zeros(12, 4)})
        with pytest.raises(PartyError, match="'pretrain' after rows"):
            call("pretrain", data=handle, simsiam={"lr": 0.1}, epoch=0)
        train_rows = torch.as_tensor(np.flatnonzero(data.observed[:, 0])[:8])
        call("embed", {"rows:f": train_rows}, data="train", train=True)  # training rows again: training goes on
        call("grad_embedding", {"grad:f": torch.zeros(8, 4)})
        fed.transport.new_step()
        with pytest.raises(PartyError, match="labels go with the training table"):
            fed.transport.call(0, "attach", {"hashes": torch.zeros(0, 32, dtype=torch.uint8),
                                             "rows": torch.zeros(0, dtype=torch.int64),
                                             "labels": torch.zeros(12, dtype=torch.int64),
                                             "labeled": torch.ones(12, dtype=torch.bool)},
                               handle="x", n_samples=12, table="new-users")
        fed.release(handle)
    finally:
        fed.close()


@pytest.mark.slow
def test_a_bad_party_file_fails_in_one_line(tmp_path) -> None:
    f = tmp_path / "p.toml"
    f.write_text('[party]\nname = "a"\nindex = 0\nhmac_key_file = "k"\n[data]\npath = "t.csv"\nid_column = "id"\n'
                 '[tls]\nca = "a"\ncert = "b"\nkey = "c"\n[policy]\nmin_lr = "low"\n')
    done = subprocess.run([sys.executable, "-m", "partialvfl", "party", "serve", "--config", str(f)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (f"error: {f}: [policy]: min_lr must be a non-negative number, "
                                                    "got 'low'")


def test_hello_tells_the_coordinator_which_prediction_tables_a_party_serves(dep) -> None:
    fed = dep.federation()
    try:
        assert fed.party_info[0]["tables"] == {"new-users": int(two_party_data(12, seed=9).observed[:, 0].sum())}
        with pytest.raises(ValueError, match="no party serves a prediction table 'old-users'"):
            fed.attach_ids(["new000"], table="old-users")
    finally:
        fed.close()


def test_a_deeply_nested_setup_config_is_refused_in_one_line_and_the_party_keeps_serving(dep) -> None:
    """Issue 35: a setup whose config nests 20,000 deep (40 KB) was answered INTERNAL with a RecursionError traceback
    in the party's log; now it is a one-line INVALID_ARGUMENT, logged as a refusal."""
    raw = encode_request(Request("setup", {}, {"program": "splitnn/party", "seed": 1, "config": {"a": 1}}), step=1,
                         round=0, session="deep", seq=1)
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].replace(b'{\\"a\\": 1}', b"[" * 20_000 + b"]" * 20_000)
    assert len(header) > 40_000
    log = dep.dir / "party-0.log"
    before = len(log.read_text())
    coord = RawCoordinator(dep, "deep")
    try:
        code, why = coord.send_bytes(len(header).to_bytes(8, "little") + header + raw[8 + n:])
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, why)
        assert why == "malformed message: partialvfl header nests deeper than 64 levels"
    finally:
        coord.close()
    fed = dep.federation()  # still serving
    fed.close()
    written = log.read_text()[before:]
    assert "Traceback" not in written and "RecursionError" not in written
    entry = [e for e in read_access_log(dep.dir / "state" / "bank" / "access.log")
             if e.get("reason", "").endswith("nests deeper than 64 levels")][-1]
    assert entry["outcome"] == "refused" and entry["status"] == "INVALID_ARGUMENT"


def test_a_party_process_refuses_a_malformed_setup_config_naming_the_key(dep, data) -> None:
    """Issue 37: a party server reads a setup config by its program's declaration, on arrival: a value of the wrong
    type or an unknown key is refused in one line naming the party, the program, the key and the value, and the
    parties then take a good config; a program message's metadata is read by its declaration too."""
    from partialvfl.federation.runtime.coordinator import SetupRefused

    fed = dep.federation()
    try:
        cfg = [{"feature_dim": d, "feature_shape": [d], "models": ["f"], "latent_dim": 4, "encoder": "mlp",
                "encoder_hidden": [8], "optimizer": {"name": "sgd", "lr": 0.1, "weight_decay": 0.0}}
               for d in data.feature_dims]
        bad = [{**cfg[0], "latent_dim": "4"}, {**cfg[1], "optimiser": cfg[1]["optimizer"]}]
        with pytest.raises(SetupRefused) as e:
            fed.setup("splitnn/party", bad, seed=0)
        lines = str(e.value).splitlines()
        assert any(line.startswith("  party 0 ('bank'): ") and "program 'splitnn/party': setup config key "
                   "'latent_dim' must be an integer >= 1, got '4'" in line for line in lines), lines
        assert any(line.startswith("  party 1 ('shop'): ") and "setup config has unknown key 'optimiser'" in line
                   for line in lines), lines
        fed.setup("splitnn/party", cfg, seed=0)
        # typed message metadata: a string count reaches no handler; the party names program, kind and key
        fed.transport.new_step()
        with pytest.raises(PartyError) as refused:
            fed.call(0, "pretrain", data="train", simsiam={}, epoch="0")
        assert "program 'splitnn/party', kind 'pretrain', request: meta key 'epoch' must be an integer >= 0, " \
               "got '0'" in str(refused.value), str(refused.value)
        assert "\n" not in str(refused.value)
    finally:
        fed.close()
