"""Issue 23's trust boundaries against real ``party serve`` processes: peers pinned, not named; a hello cannot end a
running fit; an allowlisted peer's parallel large requests cannot grow a party's memory without bound.

No test depends on the machine's speed: deadlines are generous, the mid-fit hello is sent at a given training step.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from helpers import PATIENCE, make_data
from partialvfl.cli import main
from partialvfl.federation.grpc.certs import issue_certificate, make_ca
from partialvfl.federation.grpc.federation import GrpcFederation
from partialvfl.federation.grpc.federation_file import load_federation_config
from partialvfl.federation.grpc.frames import CALL_METHOD, chunks, decode_reply, encode_request
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.grpc.party_config import load_party_config
from partialvfl.federation.grpc.party_process import serve
from partialvfl.federation.grpc.transport import PartyError
from partialvfl.federation.trust.access_log import read_access_log
from partialvfl.federation.trust.pins import spki_sha256
from partialvfl.federation.wire.messages import Request
from partialvfl.methods import get_method
from test_contract import TINY


def other_institution(directory: Path, *names: str) -> Path:
    """Another institution's CA (as in a bundle of every member's CA) and certificates it issues for ``names``."""
    ca, key = make_ca(directory, "another institution's CA")
    for name in names:
        issue_certificate(directory, name, ca_cert=ca, ca_key=key)
    return ca


class Peer:
    """Raw requests to party ``k`` with the certificate ``cert_dir/name.pem`` (session ``session``)."""

    def __init__(self, dep: LocalDeployment, k: int, cert_dir: Path, name: str = "coordinator",
                 session: str = "raw") -> None:
        cfg = load_federation_config(dep.federation_file)
        creds = grpc.ssl_channel_credentials(dep.ca_bundle.read_bytes(), (cert_dir / f"{name}.key").read_bytes(),
                                             (cert_dir / f"{name}.pem").read_bytes())
        self.channel = grpc.secure_channel(cfg.parties[k].address, creds, options=[
            ("grpc.ssl_target_name_override", cfg.parties[k].identity), ("grpc.max_send_message_length", 2**28)])
        self.call = self.channel.stream_unary(CALL_METHOD)
        self.session, self.seq = session, 0
        self.meta: dict[str, Any] = {}

    def send(self, kind: str, tensors: dict[str, torch.Tensor] | None = None, step: int = 1,
             **meta: Any) -> tuple[grpc.StatusCode, str]:
        self.seq += 1
        payload = encode_request(Request(kind, tensors or {}, meta), step=step, round=0, session=self.session,
                                 seq=self.seq)
        try:
            self.meta = decode_reply(self.call(chunks(payload), timeout=PATIENCE)).meta
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    def close(self) -> None:
        self.channel.close()


# ---------------------------------------------------------------------- peers pinned, not named
@pytest.fixture(scope="module")
def pinned(tmp_path_factory):
    """Three party processes whose CA bundle also holds another institution's CA; parties pin the coordinator's
    key, the coordinator pins each party's certificate."""
    d = tmp_path_factory.mktemp("pinned")
    other = other_institution(d / "acme", "coordinator", "bank")  # acme's CA issues a 'coordinator' and a 'bank'
    with LocalDeployment(d / "fed", make_data(24, seed=0, prefix="p"), deadline=PATIENCE, start_timeout=600.0,
                         policy="default", extra_cas=[other], pins=True) as dep:
        dep.start()
        yield dep, d / "acme"


@pytest.mark.slow
def test_a_coordinator_certificate_from_another_ca_in_the_bundle_is_refused(pinned) -> None:
    dep, acme = pinned
    fed = dep.federation()  # the pinned coordinator is served
    assert fed.party_info[0]["name"] == "bank"
    fed.close()
    impostor = Peer(dep, 0, acme)  # the right name, a certificate the bundle's other CA issued
    try:
        code, why = impostor.send("hello")
        assert code == grpc.StatusCode.UNAUTHENTICATED, (code, why)
        mine = spki_sha256((acme / "coordinator.pem").read_bytes())
        assert f"has public key SHA-256 {mine[:16]}..., not the one pinned for it" in why
        assert "[peers.coordinator] spki_sha256" in why
    finally:
        impostor.close()
    last = read_access_log(dep.dir / "state" / "bank" / "access.log")[-1]
    assert (last["peer"], last["outcome"], last["status"]) == ("coordinator", "refused", "UNAUTHENTICATED")
    fed = dep.federation()  # and the party keeps serving its coordinator
    fed.close()


@pytest.mark.slow
def test_a_party_file_that_names_its_peer_without_pinning_it_is_refused_when_the_bundle_has_several_cas(
        pinned, tmp_path) -> None:
    dep, _ = pinned
    text = dep.party_config_file(0).read_text()
    start = text.index("[peers.coordinator]")
    loose = tmp_path / "loose.toml"
    loose.write_text(text[:start] + text[text.index("[policy]", start):])
    with pytest.raises(ValueError, match="holds 2 certificates, so any of those CAs could issue a certificate "
                                         "named 'coordinator': pin it"):
        load_party_config(loose)
    fed_text = dep.federation_file.read_text()
    unpinned = tmp_path / "federation.toml"
    unpinned.write_text("\n".join(line for line in fed_text.splitlines() if not line.startswith("certificate")))
    with pytest.raises(ValueError, match="named 'bank': pin it"):
        load_federation_config(unpinned)
    both = tmp_path / "both.toml"  # a party that explicitly trusts both CAs for the coordinator accepts either
    both.write_text(text[:start] + f"[peers.coordinator]\nca = \"{dep.ca_bundle}\"\n" + text[text.index("[policy]"):])
    assert len(load_party_config(both).peers["coordinator"].cas) == 2


@pytest.mark.slow
def test_the_coordinator_refuses_a_server_that_presents_another_cas_certificate_for_a_party(
        pinned, tmp_path) -> None:
    dep, acme = pinned
    text = dep.party_config_file(0).read_text()  # an impostor 'bank' with acme's certificate, on another port
    text = text.replace(str(dep.certs / "bank.pem"), str(acme / "bank.pem"))
    text = text.replace(str(dep.certs / "bank.key"), str(acme / "bank.key"))
    text = "\n".join(line for line in text.splitlines() if not line.startswith("port_file"))
    text = text.replace(str(dep.dir / "state" / "bank"), str(tmp_path / "state"))
    (tmp_path / "impostor.toml").write_text(text)
    server, port, handler = serve(load_party_config(tmp_path / "impostor.toml"))
    try:
        fed_text = dep.federation_file.read_text().replace(f"127.0.0.1:{dep.ports[0]}", f"127.0.0.1:{port}")
        (tmp_path / "federation.toml").write_text(fed_text)
        with pytest.raises(PartyError) as err:
            GrpcFederation.from_config(tmp_path / "federation.toml")
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED and err.value.party == 0
        assert f"presented a certificate for 'bank' that its pinned {dep.certs / 'bank.pem'} does not vouch for: " \
               "not party 'bank'" in err.value.details
    finally:
        server.stop(None)
        handler.close()


def test_certs_init_writes_templates_with_the_pins(tmp_path) -> None:
    assert main(["certs", "init", str(tmp_path), "--parties", "bank", "shop"]) == 0
    (tmp_path / "bank.csv").write_text("id,a\n1,2\n")
    cfg = load_party_config(tmp_path / "bank.party.toml")
    assert cfg.peers["coordinator"].spki_sha256 == {spki_sha256((tmp_path / "coordinator.pem").read_bytes())}
    assert cfg.tls.cert == tmp_path / "bank.pem" and cfg.allowed_peers == ("coordinator",)
    fed = load_federation_config(tmp_path / "federation.toml")
    assert [(p.name, p.pin) for p in fed.parties] == [("bank", tmp_path / "bank.pem"), ("shop", tmp_path / "shop.pem")]
    assert fed.alignment == "psu" and fed.hmac_key_file is None  # the keyless alignment: shop holds the labels
    assert cfg.alignment_key_file == tmp_path / "alignment.key"
    (tmp_path / "shop.csv").write_text("id,a\n1,2\n")
    assert load_party_config(tmp_path / "shop.party.toml").alignment_key_file is None


# ---------------------------------------------------------------------- a hello cannot end a fit
@pytest.fixture(scope="module")
def research(tmp_path_factory):
    """Party processes with the research policy (the coordinator's seed: two fits can be compared exactly)."""
    with LocalDeployment(tmp_path_factory.mktemp("hello"), make_data(48, seed=0, prefix="tr"), deadline=PATIENCE,
                         start_timeout=600.0) as dep:
        dep.start()
        yield dep


def _fit(dep: LocalDeployment, method: str, intrude_at: int | None = None) -> tuple[Any, list[Any]]:
    """Fit ``method`` over the parties; at transport step ``intrude_at`` an allowlisted peer says hello to every
    party (the answers are returned)."""
    fed = dep.federation()
    answers: list[Any] = []
    steps = [0]
    new_step = fed.transport.new_step

    def counting() -> None:
        new_step()
        steps[0] += 1
        if steps[0] == intrude_at:
            for k in range(fed.n_parties):
                peer = Peer(dep, k, dep.certs, session=f"intruder-{k}")
                answers.append(peer.send("hello"))
                peer.close()

    fed.transport.new_step = counting  # type: ignore[method-assign]
    try:
        model = get_method(method)("fast", seed=3, **TINY[method]).fit(dep.data, federation=fed)
        proba = model.predict_proba(dep.data)
    finally:
        fed.close()
    assert intrude_at is None or steps[0] > intrude_at  # the fit went on after the hello
    return proba, answers


@pytest.mark.parametrize("method", ["vanilla-vfl", "false-vfl-1"])
@pytest.mark.slow
def test_a_hello_in_the_middle_of_a_fit_is_refused_and_the_fit_ends_as_an_undisturbed_one(research,
                                                                                          method: str) -> None:
    undisturbed, _ = _fit(research, method)
    disturbed, answers = _fit(research, method, intrude_at=6)
    assert len(answers) == 3 and all(code == grpc.StatusCode.ABORTED for code, _ in answers), answers
    assert all("is serving another coordinator session" in why for _, why in answers)
    np.testing.assert_array_equal(disturbed, undisturbed)


# ---------------------------------------------------------------------- memory per peer
def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _burst(dep: LocalDeployment, payload: bytes, n: int, chunked: bool) -> tuple[float, list[grpc.StatusCode]]:
    """``n`` parallel requests of ``payload`` to party 0; the party's peak RSS growth (MB) and the codes."""
    pid = dep.procs[0].pid
    base = _rss_mb(pid)
    peak, done = [base], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb(pid))
            time.sleep(0.002)

    codes: list[grpc.StatusCode] = []

    def send() -> None:
        peer = Peer(dep, 0, dep.certs, session="burst")
        try:
            call = peer.call if chunked else peer.channel.unary_unary(CALL_METHOD)
            call(chunks(payload) if chunked else payload, timeout=PATIENCE)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            codes.append(e.code())
        finally:
            peer.close()

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=send) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.2)
    done.set()
    sampler.join()
    return peak[0] - base, codes


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads a party's RSS from /proc")
@pytest.mark.slow
def test_sixteen_parallel_60_mb_requests_from_an_allowlisted_peer_raise_a_partys_memory_by_less_than_100_mb(
        tmp_path) -> None:
    # a fresh interpreter, as deployed: a party forked from the suite's preloaded one also counts the pages of that
    # interpreter its work copies on write (measured 101 MB here once)
    with LocalDeployment(tmp_path, make_data(12, seed=0, prefix="m"), deadline=PATIENCE, start_timeout=600.0,
                         policy="default", launcher="exec") as dep:
        dep.start([0])
        payload = encode_request(Request("hello", {"x": torch.ones(15 * 2**20)}), step=1, round=0,
                                 session="burst", seq=1)  # 60 MB, within max_request_mb = 64
        grew, codes = _burst(dep, payload, 16, chunked=True)
        print(f"16 parallel 60 MB requests in chunks: peak RSS +{grew:.0f} MB, {codes.count(grpc.StatusCode.OK)} "
              f"served, {codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)} RESOURCE_EXHAUSTED")  # docs quote it (-s)
        assert grew < 100, (grew, codes)
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 12, codes  # beyond the calls and bytes it holds
        assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT}, codes
        grew, codes = _burst(dep, payload, 16, chunked=False)  # in one wire message each: refused by its length
        print(f"16 parallel 60 MB requests in one wire message each: peak RSS +{grew:.0f} MB")
        assert grew < 100 and set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, (grew, codes)
        peer = Peer(dep, 0, dep.certs, session="after")  # the party keeps serving
        assert peer.send("hello") == (grpc.StatusCode.OK, "") and peer.send("bye", step=2)[0] == grpc.StatusCode.OK
        peer.close()


def test_a_request_is_refused_beyond_the_peers_budget_and_waits_for_it_otherwise() -> None:
    from partialvfl.federation.grpc.limits import PeerLimits, Refused

    limits = PeerLimits(max_calls=2, max_bytes=100)
    with limits.call("c"), limits.call("c"):
        with pytest.raises(Refused, match="has 2 calls in flight"), limits.call("c"):
            pass
        with limits.call("other"):  # per peer
            pass
    with pytest.raises(Refused, match="more than peer 'c' may have this party hold"), limits.bytes("c", 101, 1.0):
        pass
    held, waited = threading.Event(), []

    def first() -> None:
        with limits.bytes("c", 60, 1.0):
            held.set()
            time.sleep(0.3)

    t = threading.Thread(target=first)
    t.start()
    held.wait()
    with pytest.raises(Refused, match="would exceed"), limits.bytes("c", 60, 0.0):
        pass
    with limits.bytes("c", 60, PATIENCE):  # waits until the first request is done
        waited.append(limits.held["c"])
    t.join()
    assert waited == [60] and limits.held["c"] == 0
