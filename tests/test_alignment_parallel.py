"""Alignment's group arithmetic on several cores or a Ray cluster gives the single-core path's bytes (issue 46).

:class:`~partialvfl.federation.trust.group_work.GroupWork` splits the per-ID hashing and scalar multiplications into
chunks run on threads (by default every core) or Ray tasks; tokens, blindings and refusals must not depend on where
they ran, nor on the chunk size.  The party's table index (:class:`TokenIndex`) must answer as the dict it replaced.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partialvfl.federation.trust import psu
from partialvfl.federation.trust.group_work import DOMAIN, GroupWork
from partialvfl.federation.trust.token_index import TokenIndex, first_repeat

IDS = [f"C{i:07d}" for i in range(600)] + ["ünïcode", "7", " "]
SCALAR = psu.session_key(b"k" * 32, ["ab" * 32])


def one_by_one(texts: list[str], scalar: bytes) -> list[bytes]:
    """The definition, one libsodium call at a time: H(t) = from_hash(SHA-512(DOMAIN || t)), then ^scalar."""
    sodium = psu._sodium()
    return [sodium.crypto_scalarmult_ristretto255(scalar, sodium.crypto_core_ristretto255_from_hash(
        hashlib.sha512(DOMAIN + t.encode()).digest())) for t in texts]


@pytest.mark.parametrize("work", [GroupWork(1), GroupWork(3, chunk=64), GroupWork(0, chunk=100), GroupWork(2)])
def test_tokens_on_any_number_of_threads_equal_the_single_core_definition(work: GroupWork) -> None:
    expected = one_by_one(IDS, SCALAR)
    assert psu.points_list(work.tokens(IDS, SCALAR), "t") == expected
    assert psu.points_list(work.hashed(IDS), "h") == psu.hash_to_group(IDS)
    evaluated = work.evaluate(work.hashed(IDS), SCALAR, "x")
    assert psu.points_list(evaluated, "t") == expected


def test_the_default_uses_every_core_and_a_blinding_unblinds_to_the_single_core_tokens() -> None:
    assert GroupWork().workers >= 1 and GroupWork(0).workers == GroupWork().workers
    blinding = psu.Blinding(IDS, GroupWork(0, chunk=50))
    unblinded = blinding.unblind(GroupWork(2, chunk=70).evaluate(blinding.points, SCALAR, "eval"), "unblind")
    assert psu.points_list(unblinded, "t") == one_by_one(IDS, SCALAR)


@settings(max_examples=15, deadline=None)
@given(chunk=st.integers(1, 40), bad=st.integers(0, 59))
def test_an_invalid_element_is_named_by_its_position_in_the_whole_set_whatever_the_chunks(chunk: int,
                                                                                            bad: int) -> None:
    points = GroupWork(1).hashed([f"x{i}" for i in range(60)])
    points[bad] = 0xFF  # not a canonical encoding
    with pytest.raises(psu.AlignmentError, match=f"element {bad} is not a valid"):
        GroupWork(3, chunk=chunk).evaluate(points, SCALAR, "party 1 ('shop'), psu_eval")
    with pytest.raises(psu.AlignmentError, match=f"element {bad} is not a valid"):
        GroupWork(2, chunk=chunk).validate(points, "reply")


@settings(max_examples=25, deadline=None)
@given(st.lists(st.binary(min_size=32, max_size=32), max_size=40, unique=True), st.binary(min_size=32, max_size=32))
def test_token_index_answers_as_the_dict_it_replaced(tokens: list[bytes], other: bytes) -> None:
    rows = np.arange(len(tokens), dtype=np.int64)[::-1].copy()
    arr = psu.points_array(tokens)
    index = TokenIndex(arr, rows)
    as_dict = dict(zip(tokens, rows.tolist(), strict=True))
    assert list(index) == sorted(as_dict) and dict(index.items()) == as_dict
    assert index.get(other) == as_dict.get(other)
    probe = psu.points_array([*tokens, other])
    assert index.lookup(probe).tolist() == [as_dict.get(t, -1) for t in [*tokens, other]]
    assert first_repeat(arr) is None
    if tokens:
        assert first_repeat(np.concatenate([arr, arr[:1]])) == len(tokens)


def test_a_party_aligner_gives_the_same_tokens_on_one_thread_and_on_many(tmp_path: Path) -> None:
    """The party's whole reply (sorted tokens) and its row index, single-core against every core."""
    ids = [f"C{i:07d}" for i in range(300)]
    replies = []
    for threads in (1, 0):
        party = psu.PartyAligner("shop", b"s" * 32, lambda table: ids, tmp_path / str(threads), threads=threads)
        party.work = GroupWork(threads, chunk=32)
        nonce = party.open()["nonce"]
        party.nonce = "cd" * 32  # one session key for both (the nonce is the party's own random draw)
        del nonce
        tokens, _ = party.tokens("training", ["cd" * 32])
        replies.append((tokens, dict(party.row_index("training").items())))
    assert np.array_equal(replies[0][0], replies[1][0]) and replies[0][1] == replies[1][1]


@pytest.mark.slow
def test_tokens_on_a_local_ray_cluster_equal_the_single_core_tokens() -> None:
    """Ray with this machine's cores as the cluster (starts Ray: seconds)."""
    ray = pytest.importorskip("ray")
    try:
        work = GroupWork(ray_address="local", chunk=100)
        ids = [f"R{i}" for i in range(450)]
        assert np.array_equal(work.tokens(ids, SCALAR), GroupWork(1).tokens(ids, SCALAR))
        bad = GroupWork(1).hashed(ids)
        bad[321] = 0xFF
        with pytest.raises(psu.AlignmentError, match="element 321 is not a valid"):
            work.evaluate(bad, SCALAR, "on ray")
    finally:
        ray.shutdown()


def test_a_party_file_says_where_its_alignment_arithmetic_runs(tmp_path: Path) -> None:
    from partialvfl.federation.grpc.party_config import load_party_config

    def party(extra: str) -> Path:
        f = tmp_path / "bank.toml"
        f.write_text(f'[party]\nname = "bank"\nindex = 0\n{extra}\n[data]\npath = "bank.csv"\nid_column = "id"\n'
                     '[tls]\nca = "ca.pem"\ncert = "bank.pem"\nkey = "bank.key"\n')
        return f

    default = load_party_config(party(""))
    assert default.alignment_threads == 0 and default.ray_address is None  # every core, no Ray
    assert load_party_config(party('alignment_threads = "auto"')).alignment_threads == 0
    one = load_party_config(party('alignment_threads = 1\nray_address = "10.0.0.5:6379"'))
    assert one.alignment_threads == 1 and one.ray_address == "10.0.0.5:6379"
    with pytest.raises(ValueError, match="alignment_threads must be an integer >= 0 or 'auto'"):
        load_party_config(party("alignment_threads = -2"))
