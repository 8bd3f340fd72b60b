"""Keyless alignment (issue 24): the private set union's messages, its refusals, and the dictionary attack.

Unit tests drive :class:`PartyAligner` (the party's side) and :class:`PsuAlignment` (the coordinator's) through an
in-process stand-in for the transport; the deployment tests use real party processes.  The attack test is the
issue's: a curious coordinator keeps everything it received and its own secrets, enumerates 1e5 candidate IDs and
tries to identify IDs only other parties hold; against ``alignment = "psu"`` it finds none, against the explicit
``alignment = "hmac"`` (positive control) all of them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers import PATIENCE
from partialvfl.data.dataset import Task, VerticalDataset
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.grpc.psu_session import PsuAlignment
from partialvfl.federation.grpc.transport import PartyError
from partialvfl.federation.trust import psu
from partialvfl.federation.trust.access_log import read_access_log
from partialvfl.federation.trust.alignment import load_key
from partialvfl.federation.trust.psu import AlignmentError, PartyAligner, hash_to_group, points_array, points_list
from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.federation.wire.refusals import PolicyViolation

SECRET = b"s" * 32


# ---------------------------------------------------------------------- in process
class Wire:
    """The transport's contract as PsuAlignment uses it, dispatching to each party's alignment handlers."""

    def __init__(self, parties: Mapping[int, PartyAligner], tamper: Any = None) -> None:
        self.handlers = {k: p.handlers(lambda req: req.meta.get("table", "training")) for k, p in parties.items()}
        self.tamper = tamper
        self.steps = 0

    def new_step(self) -> None:
        self.steps += 1

    def call_many(self, requests: Mapping[int, Request], *, tolerate: bool = False) -> dict[int, Reply]:
        out = {}
        for k, req in requests.items():
            reply = self.handlers[k][req.kind][1](req)
            out[k] = self.tamper(k, req, reply) if self.tamper else reply
        return out


def aligner(name: str, ids: list[str], secret: bytes | None, tmp: Path, **kw: Any) -> PartyAligner:
    return PartyAligner(name, secret, lambda table: ids, tmp / name, **kw)


def three(tmp: Path, **kw: Any) -> dict[int, PartyAligner]:
    return {0: aligner("bank", ["a", "b", "c"], SECRET, tmp, **kw),
            1: aligner("shop", ["b", "c", "d"], SECRET, tmp, **kw), 2: aligner("insurer", ["c", "e"], None, tmp)}


def test_union_tokens_agree_across_keyed_unkeyed_parties_and_the_coordinator(tmp_path: Path) -> None:
    parties = three(tmp_path)
    coord = PsuAlignment(Wire(parties), ["bank", "shop", "insurer"])
    tokens, own = coord.party_tokens([0, 1, 2], None, ["e", "b", "zz"], expected={0: 3, 1: 3, 2: 2})
    by_id: dict[str, set[bytes]] = {}
    for k, p in parties.items():
        index = p.row_index("training")
        assert sorted(index) == points_list(tokens[k], "t")  # the party knows its own tokens, sorted on the wire
        for tok, row in index.items():
            by_id.setdefault(p.texts("training")[row], set()).add(tok)
    assert all(len(t) == 1 for t in by_id.values())  # one token per ID, whichever party holds it
    assert by_id["b"] == {bytes(own[1])} and by_id["e"] == {bytes(own[0])}
    assert bytes(own[2]) not in {t for ts in by_id.values() for t in ts}
    assert coord.id_tokens(["c"])[0].tobytes() in by_id["c"]  # a lookup: one round to one keyed party


def test_sessions_are_unlinkable_unless_the_party_resumes_them_by_its_own_ticket(tmp_path: Path) -> None:
    """Issue 35: a coordinator-chosen ``alignment_id`` made a party's tokens identical across sessions (1,497 of
    1,497), so what several sessions learned combined.  Now a party reuses a session's nonce only for the ticket it
    handed that coordinator for that session (kept in its own state), never for a name or salt the coordinator
    picks."""
    from partialvfl.federation.grpc.sessions import AlignmentTickets

    def session(alignment_id: str | None, tickets: Any = None, caller: str = "coordinator", **kw: Any) -> set[bytes]:
        parties = three(tmp_path, **kw)
        for p in parties.values():
            p.caller = caller
        coord = PsuAlignment(Wire(parties), ["bank", "shop", "insurer"], alignment_id=alignment_id, tickets=tickets)
        return set(points_list(coord.party_tokens([0, 1, 2], None)[0][0], "t"))

    assert not session(None) & session(None)
    assert not session("fit seed 0") & session("fit seed 0")  # a name the coordinator chooses reproduces nothing
    kept = AlignmentTickets(tmp_path / "coordinator" / "tickets.json")
    first = session("fit-1", kept)
    assert kept.get("fit-1", "bank") and kept.get("fit-1", "shop") and not kept.get("fit-1", "insurer")
    assert session("fit-1", AlignmentTickets(tmp_path / "coordinator" / "tickets.json")) == first  # resumed, e.g.
    # by a coordinator restarted with --resume, which reads the tickets kept with its checkpoints
    assert not session("fit-1", kept, caller="another coordinator") & first  # a ticket is bound to its holder
    assert not session("fit-2", kept) & first
    assert not session("fit-3", AlignmentTickets(), persist=False) & session("fit-3", persist=False)
    named = session("fit-4", resume_by_name=True)  # the research preset: a name reproduces (simulations repeat)
    assert session("fit-4", resume_by_name=True) == named and not session("fit-4") & named


def test_a_coordinator_cannot_choose_a_salt_that_reproduces_an_earlier_sessions_tokens(tmp_path: Path) -> None:
    old = aligner("bank", ["a", "b"], SECRET, tmp_path)
    old_nonce = old.open("fit")["nonce"]
    old_tokens, _ = old.tokens("training", [old_nonce])
    new = aligner("bank", ["a", "b"], SECRET, tmp_path)  # a new session of the same party
    fresh = new.open("fit")["nonce"]
    assert fresh != old_nonce
    for salt in ([old_nonce], sorted([old_nonce, "ab" * 32])):
        with pytest.raises(AlignmentError, match="the salt does not hold this party's nonce of this session"):
            new.tokens("training", salt)
    tokens, _ = new.tokens("training", sorted([fresh, old_nonce]))  # the old nonce beside its own: another key
    assert not set(points_list(tokens, "t")) & set(points_list(old_tokens, "t"))


def test_bad_input_is_refused_naming_the_party(tmp_path: Path) -> None:
    bank = aligner("bank", ["a", "b"], SECRET, tmp_path, max_lookups=5)
    nonce = bank.open()["nonce"]
    with pytest.raises(AlignmentError, match="party 'bank', psu_eval: the salt does not hold this party's nonce"):
        bank.evaluate(points_array(hash_to_group(["x"])), ["ab" * 32])
    good = points_array(hash_to_group(["x", "y"]))
    bad = good.copy()
    bad[1] = 0xFF  # not a canonical encoding of a group element
    with pytest.raises(AlignmentError, match="party 'bank', psu_eval: element 1 is not a valid ristretto255"):
        bank.evaluate(bad, [nonce])
    with pytest.raises(AlignmentError, match="duplicated or replayed"):
        bank.evaluate(np.concatenate([good[:1], good[:1]]), [nonce])
    bank.evaluate(good, [nonce])
    with pytest.raises(AlignmentError, match="already evaluated in this session"):
        bank.evaluate(good[:1], [nonce])
    with pytest.raises(PolicyViolation, match="'max_lookups'.*at most 5"):
        bank.evaluate(points_array(hash_to_group(list("pqrs"))), [nonce])
    with pytest.raises(AlignmentError, match="the salt changed within the session"):
        bank.evaluate(points_array(hash_to_group(["k"])), sorted([nonce, "cd" * 32]))
    insurer = aligner("insurer", ["c", "e"], None, tmp_path)
    insurer.open()
    blinded = insurer.blind("training")
    with pytest.raises(AlignmentError, match="party 'insurer', psu_unblind: 1 evaluated elements for 2 sent"):
        insurer.unblind("training", blinded[:1])
    with pytest.raises(AlignmentError, match="not blinded in this session"):
        insurer.unblind("training", blinded)  # the blinding is used once
    with pytest.raises(AlignmentError, match="holds no alignment key"):
        insurer.evaluate(blinded, [nonce])
    with pytest.raises(AlignmentError, match="table 'training' is not aligned in this session"):
        aligner("shop", ["z"], SECRET, tmp_path).row_index("training")


def _tampered(kind: str, party: int, change: Any) -> Any:
    def tamper(k: int, req: Request, reply: Reply) -> Reply:
        if k == party and req.kind == kind:
            name = next(iter(reply.tensors))
            return Reply({name: change(reply.tensors[name])}, reply.meta)
        return reply
    return tamper


@pytest.mark.parametrize(("kind", "party", "change", "message"), [
    ("psu_tokens", 1, lambda t: t[:-1], r"party 1 \('shop'\) sent 2 tokens for the 3 rows of its training table"),
    ("psu_eval", 0, lambda t: torch.cat([torch.full_like(t[:1], 255), t[1:]]),
     r"party 0 \('bank'\), psu_eval: element 0 is not a valid ristretto255"),
    ("psu_tokens", 1, lambda t: t[[0, 0, 1]], r"party 1 \('shop'\), psu_tokens: the set holds the same element twice"),
    ("psu_eval", 0, lambda t: t[:-1], r"party 0 \('bank'\) answered psu_eval with 1 elements for 2 sent"),
    ("psu_unblind", 2, lambda t: t[:1], r"party 2 \('insurer'\) sent 1 tokens for the 2 rows"),
])
def test_the_coordinator_refuses_bad_replies_naming_the_party(tmp_path: Path, kind: str, party: int, change: Any,
                                                              message: str) -> None:
    coord = PsuAlignment(Wire(three(tmp_path), _tampered(kind, party, change)), ["bank", "shop", "insurer"])
    with pytest.raises(AlignmentError, match=message):
        coord.party_tokens([0, 1, 2], None, expected={0: 3, 1: 3, 2: 2})


def test_parties_with_different_keys_or_no_key_are_refused(tmp_path: Path) -> None:
    parties = three(tmp_path)
    parties[1] = aligner("shop", ["b"], b"t" * 32, tmp_path)
    with pytest.raises(AlignmentError, match=r"party 0 \('bank'\) and party 1 \('shop'\) hold different alignment"):
        PsuAlignment(Wire(parties), ["bank", "shop", "insurer"]).party_tokens([0, 1, 2], None)
    with pytest.raises(AlignmentError, match="no party holds the alignment key"):
        PsuAlignment(Wire({2: aligner("insurer", ["c"], None, tmp_path)}), ["bank", "shop", "insurer"]).party_tokens(
            [2], None)


# ---------------------------------------------------------------------- real party processes
SPACE = 100_000  # customer numbers "C" + 6 digits below 100,000: the candidates a curious coordinator enumerates


def customers(seed: int = 0) -> VerticalDataset:
    """bank 3,000 and shop 2,000 customers, insurer (the label holder) 1,500; labels for about 1,000 of its own."""
    rng = np.random.default_rng(seed)
    pool = rng.choice(SPACE, 4_800, replace=False)
    held = {"bank": pool[:3000], "shop": pool[1800:3800], "insurer": np.concatenate([pool[2500:3000], pool[3800:]])}
    ids = np.array([f"C{i:06d}" for i in pool], dtype=object)
    observed = np.stack([np.isin(pool, held[n]) for n in ("bank", "shop", "insurer")], axis=1)
    labeled = observed[:, 2] & (rng.random(len(pool)) < 0.67)
    blocks = [np.where(observed[:, [k]], rng.normal(size=(len(pool), 2)), np.nan).astype(np.float32) for k in range(3)]
    y = np.where(labeled, rng.integers(0, 2, len(pool)), -1)
    return VerticalDataset(blocks, observed, ids=ids, y=y, labeled=labeled, task=Task.classification([0, 1]),
                           active_party=2, party_names=["bank", "shop", "insurer"])


@pytest.fixture(scope="module")
def data() -> VerticalDataset:
    return customers()


def _deployment(tmp: Path, data: VerticalDataset, alignment: str, **kw: Any) -> Iterator[LocalDeployment]:
    dep = LocalDeployment(tmp, data, deadline=PATIENCE, start_timeout=600.0, alignment=alignment, **kw)
    try:
        dep.start()
        yield dep
    finally:
        dep.close()


@pytest.fixture(scope="module")
def psu_dep(data: VerticalDataset, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    yield from _deployment(tmp_path_factory.mktemp("psu"), data, "psu",
                           policy={"preset": "research", "max_lookups": 3000})


def _recording(fed: Any) -> list[Any]:
    """Everything the coordinator receives from now on (every reply's tensors and metadata)."""
    received: list[Any] = []
    call_many = fed.transport.call_many

    def recording(requests: Any, **kw: Any) -> dict[int, Reply]:
        replies = call_many(requests, **kw)
        received.extend(replies.values())
        return replies
    fed.transport.call_many = recording
    return received


def _others_only(data: VerticalDataset) -> set[str]:
    """IDs the coordinator's institution does not hold (neither its label table nor its own party's block)."""
    own = data.observed[:, data.active_party] | data.labeled
    return {str(i) for i in data.ids[data.observed.any(axis=1) & ~own]}


@pytest.mark.slow
def test_dictionary_attack_finds_nothing_against_psu_and_everything_against_hmac(
        data: VerticalDataset, psu_dep: LocalDeployment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    candidates = [f"C{i:06d}" for i in range(SPACE)]
    targets = _others_only(data)
    assert len(targets) == 3_300  # bank's and shop's 3,800 less the 500 the insurer holds too
    # keyless: the coordinator keeps every reply and every scalar it drew, then tries H(c), and H(c) under each of
    # its scalars (and their inverses), against every 32-byte value it ever received
    scalars: list[bytes] = []
    draw = psu.random_scalar
    monkeypatch.setattr(psu, "random_scalar", lambda: scalars.append(draw()) or scalars[-1])
    fed = psu_dep.federation()
    received = _recording(fed)
    try:
        view, handle = fed.align()
        fed.release(handle)
    finally:
        fed.close()
    seen = {v for r in received for t in r.tensors.values() if t.dtype == torch.uint8 and t.ndim == 2
            and t.shape[-1] == 32 for v in points_list(t.numpy(), "received")}
    assert len(seen) >= view.n_samples and scalars
    exponents = [*scalars, *(psu.invert(s) for s in scalars)]
    seen |= {v for s in exponents for v in psu.evaluate(sorted(seen), s, "attack")}
    found = {c for c, h in zip(candidates, hash_to_group(candidates), strict=True) if h in seen}
    assert found & targets == set()

    # the positive control: the same tables, alignment = "hmac": the coordinator's key finds every one of them
    for dep in _deployment(tmp_path / "hmac", data, "hmac"):
        fed = dep.federation()
        received = _recording(fed)
        try:
            fed.align()
        finally:
            fed.close()
        key = load_key(dep.key_file)
        hashes = {bytes(h) for r in received if "hashes" in r.tensors for h in r.tensors["hashes"].numpy()}
        found = {c for c in candidates if hmac.new(key, c.encode(), hashlib.sha256).digest() in hashes}
        assert found & targets == targets


@pytest.mark.slow
def test_a_guessed_id_is_tested_only_online_logged_and_capped(psu_dep: LocalDeployment) -> None:
    fed = psu_dep.federation()
    try:
        fed.align()
        guesses = [f"C{i:06d}" for i in range(1500)]
        tokens = fed.id_tokens(guesses)  # the only way to test guesses: the keyed parties answer, log and count
        assert tokens.shape == (1500, 32)
        # align() had one keyed party evaluate about 2,500 (the insurer's 1,500 rows and its labels), the lookup
        # above went to the other; this one, to the first again, would pass the session's cap of 3,000
        with pytest.raises(PartyError, match="max_lookups"):
            fed.id_tokens([f"C{i:06d}" for i in range(1500, 3500)])
    finally:
        fed.close()
    log = [e for k in (0, 1) for e in read_access_log(psu_dep.dir / "state" / psu_dep.names[k] / "access.log")
           if e["kind"] == "psu_eval"]
    assert any(e["request"]["points"][0] == [1500, 32] and e["outcome"] == "served" for e in log)
    assert any(e["outcome"] == "refused" and "max_lookups" in e["reason"] for e in log)


@pytest.mark.slow
def test_a_party_with_another_key_stops_the_alignment_before_anything_is_attached(
        data: VerticalDataset, tmp_path: Path) -> None:
    for dep in _deployment(tmp_path, data, "psu"):
        psu.write_alignment_key(tmp_path / "other.key")
        cfg = dep.party_config_file(1)
        dep.kill(1)
        dep.procs.pop(1)
        dep.alignment_key_file, saved = tmp_path / "other.key", dep.alignment_key_file
        dep.start([1])
        dep.alignment_key_file = saved
        assert "other.key" in cfg.read_text()
        fed = dep.federation()
        try:
            with pytest.raises(AlignmentError, match=r"party 0 \('bank'\) and party 1 \('shop'\) hold different"):
                fed.align()
        finally:
            fed.close()
        for name in dep.names:
            assert not [e for e in read_access_log(dep.dir / "state" / name / "access.log") if e["kind"] == "attach"]


def test_session_order_reproduces_the_federations_order_for_whoever_holds_every_key(tmp_path: Path) -> None:
    parties = three(tmp_path)
    coord = PsuAlignment(Wire(parties), ["bank", "shop", "insurer"])
    tokens, _ = coord.party_tokens([0, 1, 2], None)
    union = sorted({t for arr in tokens.values() for t in points_list(arr, "t")})
    ids = ["e", "d", "c", "b", "a"]
    order = psu.session_order(ids, SECRET, coord.salt or [])
    assert points_list(coord.id_tokens([ids[i] for i in order]), "t") == union


@pytest.mark.slow
def test_files_name_the_alignment_and_the_templates_give_the_label_side_no_key(psu_dep: LocalDeployment,
                                                                              tmp_path: Path) -> None:
    from partialvfl.federation.grpc.federation_file import load_federation_config
    from partialvfl.federation.grpc.party_config import load_party_config

    assert "key_file" not in psu_dep.federation_file.read_text()  # the coordinator holds no key
    cfgs = [load_party_config(psu_dep.party_config_file(k)) for k in range(3)]
    assert [c.alignment_key_file is not None for c in cfgs] == [True, True, False]  # the insurer (active) has none
    assert {c.alignment for c in cfgs} == {"psu"} and load_federation_config(psu_dep.federation_file).alignment == "psu"
    base = psu_dep.party_config_file(0).read_text()
    for line, message in [('alignment = "hmac"', "alignment = 'hmac' needs 'hmac_key_file'"),
                          ('alignment = "plain"', "alignment must be 'psu' or 'hmac'")]:
        bad = tmp_path / "bad.toml"
        bad.write_text(base.replace('alignment = "psu"', line))
        with pytest.raises(ValueError, match=message):
            load_party_config(bad)


@pytest.mark.slow
def test_a_resumed_fit_gets_its_tokens_back_by_the_parties_tickets_and_a_repeated_fit_does_not(
        data: VerticalDataset, tmp_path: Path) -> None:
    """Issue 35 against real parties under the default policy: the fit's alignment (``alignment_id``) is kept by
    each keyed party under a ticket the coordinator keeps with its checkpoints; a coordinator restarted with them
    aligns with the same tokens (``fit --resume``), a new fit of the same seed (the same ``alignment_id``) without
    them gets fresh ones."""
    from partialvfl.federation.grpc.federation import TICKETS_FILE

    def align(dep: LocalDeployment, checkpoints: Path | None) -> tuple[list[str], set[bytes]]:
        fed = dep.federation(connect=False)
        fed.alignment_id = "fit seed 0"  # what run_fit asks for
        if checkpoints is not None:
            fed.keep_sessions_with(checkpoints)
        try:
            fed.connect()
            view, handle = fed.align()
            fed.release(handle)
            return list(fed.aligner.salt), {bytes(t) for t in fed.party_hashes()[0]}
        finally:
            fed.close()

    for dep in _deployment(tmp_path / "dep", data, "psu", policy="default"):
        checkpoints = tmp_path / "model" / "checkpoints"
        checkpoints.mkdir(parents=True)
        (checkpoints / "LATEST").write_text("step-5\n")  # a checkpoint to resume from
        salt, bank = align(dep, checkpoints)
        tickets = json.loads((checkpoints / TICKETS_FILE).read_text())
        assert set(tickets["fit seed 0"]) == {"bank", "shop"}  # the keyed parties; the insurer holds no key
        assert align(dep, checkpoints) == (salt, bank)  # resumed: the same nonces, the same tokens
        other_salt, other_bank = align(dep, None)  # the same seed, no ticket: a new alignment
        assert not set(other_salt) & set(salt) and not other_bank & bank
        empty = tmp_path / "stopped-early" / "checkpoints"
        align(dep, empty)  # no checkpoint was written: the tickets are not left behind
        assert not (empty / TICKETS_FILE).exists()
