"""IDs, one rule: from_tables, the party server's table and the keyed-hash alignment normalise IDs the same way,
refuse empty IDs and IDs that collide once normalised (naming them), and agree on one canonical sample order."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partialvfl import DataValidationError
from partialvfl.data.builders import from_tables
from partialvfl.data.ids import DEFAULT_ORDER_KEY, id_seeds, normalize_id, normalize_ids, sample_order
from partialvfl.federation.grpc.party_config import PartyConfig
from partialvfl.federation.grpc.party_tables import PartyTable
from partialvfl.federation.grpc.transport import TlsFiles
from partialvfl.federation.trust.alignment import canonical_id, hash_ids, observed_from_hashes

KEY = b"k" * 32


def party_table(tmp_path: Path, text: str, **kwargs: object) -> PartyTable:
    (tmp_path / "t.csv").write_text(text)
    cfg = PartyConfig(name="shop", index=1, address="127.0.0.1:0", data_path=tmp_path / "t.csv", id_column="uid",
                      tls=TlsFiles(tmp_path / "ca", tmp_path / "c", tmp_path / "k"), state_dir=tmp_path / "s",
                      hmac_key_file=tmp_path / "h", **kwargs)  # type: ignore[arg-type]
    return PartyTable(cfg, KEY)


@pytest.mark.parametrize(("raw", "text"), [(12, "12"), (np.int64(12), "12"), (12.0, "12"), ("12", "12"),
                                           (" 12\t", "12"), ("007", "007"), (b"ab", "ab"), ("Cafe\u0301", "Café"),
                                           (1.5, "1.5"), ("AbC", "AbC")])
def test_normalize_id_one_rule(raw: object, text: str) -> None:
    assert normalize_id(raw) == text
    assert canonical_id(raw) == text.encode()  # the alignment hashes exactly this


@pytest.mark.parametrize(("values", "message"), [
    (["a", ""], r"the ID at row 1 is empty"),
    (["a", "   "], r"the ID at row 1 is empty"),
    ([1.0, np.nan], r"the ID at row 1 is missing \(NaN\)"),
    (["a", None], r"the ID at row 1 is missing"),
    ([True, 2], r"the ID at row 0 is a boolean"),
    (["12", " 12"], r"IDs '12' and ' 12', the same ID once normalised \('12'\), at rows 0 and 1"),
    ([12, 12.0], r"IDs 12 and 12.0, the same ID once normalised \('12'\), at rows 0 and 1"),
    (["x", "x"], r"ID 'x' at rows 0 and 1; IDs must be unique"),
])
def test_refused_ids_are_named(values: list, message: str) -> None:
    with pytest.raises(DataValidationError, match="my table: " + message):
        normalize_ids(values, "my table")


def test_from_tables_party_table_and_alignment_agree(tmp_path: Path) -> None:
    """The same IDs, written with white space and as numbers, join and hash identically everywhere."""
    bank = pd.DataFrame({"uid": [" 7", "u2 ", "12"], "x": [1.0, 2.0, 3.0], "y": [0, 1, 0]})
    shop = pd.DataFrame({"uid": [7, 12], "z": [5.0, 6.0]})  # integers join with the text "7" / "12"
    ds = from_tables({"bank": bank, "shop": shop}, id_column="uid", label_column="y", active_party="bank")
    assert sorted(ds.ids.tolist()) == ["12", "7", "u2"] and ds.observed.sum(axis=0).tolist() == [3, 2]
    table = party_table(tmp_path, "uid,z\n 7 ,5.0\n12,6.0\n")
    assert table.ids.tolist() == ["7", "12"]
    np.testing.assert_array_equal(table.hashes, hash_ids(["7", 12], KEY))
    # the federation's order (hashes sorted) is from_tables' order with the same key
    order, _ = observed_from_hashes([hash_ids(bank["uid"], KEY), hash_ids(shop["uid"], KEY)])
    keyed = from_tables({"bank": bank, "shop": shop}, id_column="uid", label_column="y", active_party="bank",
                        order_key=KEY)
    np.testing.assert_array_equal(hash_ids(keyed.ids, KEY), order)


@pytest.mark.parametrize(("text", "message"), [
    ("uid,z\nu1,1.0\n,2.0\n", r"ID column 'uid': the ID at row 1 is missing"),
    ("uid,z\nu1,1.0\n u1,2.0\n", r"IDs 'u1' and ' u1', the same ID once normalised \('u1'\), at rows 0 and 1"),
    ("uid,z\nu1,1.0\nu2,\n", r"column 'z': value is missing \(NaN\) for ID 'u2'"),
    ("uid,city\nu1,Oslo\n", r"feature column 'city' is not numeric"),
])
def test_party_table_refuses_what_from_tables_refuses(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(DataValidationError, match=r"party 1 \('shop'\), t.csv.*" + message):
        party_table(tmp_path, text)
    df = pd.read_csv(tmp_path / "t.csv", dtype={"uid": str})
    with pytest.raises(DataValidationError, match=message):
        from_tables({"shop": df}, id_column="uid")


def test_party_table_excluded_column_must_exist(tmp_path: Path) -> None:
    with pytest.raises(DataValidationError, match=r"excluded column 'label' not found; its columns: \['uid', 'z'\]"):
        party_table(tmp_path, "uid,z\nu1,1.0\n", exclude_columns=("label",))


def test_canonical_order_is_the_keyed_hash_order() -> None:
    ids = ["u3", "u1", "u2", "u10"]
    order = sample_order(ids)
    hashes = hash_ids(ids, DEFAULT_ORDER_KEY)
    keys = [bytes(h) for h in hashes[order]]
    assert keys == sorted(keys)
    other = sample_order(ids, KEY)
    assert sorted(other.tolist()) == [0, 1, 2, 3]


def test_normalised_ids_are_hashed_as_they_are() -> None:
    """IDs normalised once (table_ids, normalize_ids) hash and order exactly as the raw IDs; not normalised again."""
    raw = [" 7", 12, 12.5, "e\u0301 ", b"u1", 3.0]
    texts = normalize_ids(raw, "t")
    np.testing.assert_array_equal(hash_ids(texts, KEY, normalized=True), hash_ids(raw, KEY))
    assert sample_order(texts, KEY, normalized=True).tolist() == sample_order(raw, KEY).tolist()
    with pytest.raises(TypeError, match=r"hash_ids\(normalized=True\) takes normalised ID texts, got int at row 1"):
        hash_ids(["7", 12], KEY, normalized=True)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.integers(-10**6, 10**6), st.text(min_size=1, max_size=6)), max_size=12))
def test_normalised_ids_collide_only_when_their_texts_do(values: list) -> None:
    texts = []
    for v in values:
        try:
            texts.append(normalize_id(v))
        except ValueError:
            return  # empty after stripping: refused (tested above)
    if len(set(texts)) == len(texts):
        assert normalize_ids(values, "t") == texts
    else:
        with pytest.raises(DataValidationError, match="t: "):
            normalize_ids(values, "t")


def test_every_table_reader_follows_one_suffix_rule(tmp_path: Path) -> None:
    """The party server, the coordinator's label table and the predict ID list read a table's format from its name
    as from_tables does: compressed CSV is CSV, an unknown suffix is refused (it was read as CSV by the servers)."""
    from partialvfl.cli.federated import read_id_list
    from partialvfl.data.tables import table_format
    from partialvfl.federation.grpc.federation_file import LabelSource, read_labels

    assert [table_format(n) for n in ("a.csv", "A.CSV.GZ", "a.parquet", "a.PQ", "a.txt", "a.tsv", "a.csv.bak")] == \
        ["csv", "csv", "parquet", "parquet", None, None, None]
    frame = pd.DataFrame({"uid": ["007", "8"], "y": [1, 0], "f": [0.5, 1.5]})
    frame.to_csv(tmp_path / "t.csv.gz", index=False)
    frame.to_csv(tmp_path / "t.txt", index=False)
    cfg = dict(name="shop", index=1, address="127.0.0.1:0", id_column="uid",
               tls=TlsFiles(tmp_path / "ca", tmp_path / "c", tmp_path / "k"), state_dir=tmp_path / "s",
               hmac_key_file=tmp_path / "h", exclude_columns=("y",))
    table = PartyTable(PartyConfig(data_path=tmp_path / "t.csv.gz", **cfg), KEY)  # type: ignore[arg-type]
    assert table.ids.tolist() == ["007", "8"] and table.features.tolist() == [[0.5], [1.5]]
    with pytest.raises(DataValidationError, match=r"cannot tell the format of .*t\.txt"):
        PartyTable(PartyConfig(data_path=tmp_path / "t.txt", **cfg), KEY)  # type: ignore[arg-type]
    with pytest.raises(DataValidationError, match=r"label table .*cannot tell the format of .*t\.txt"):
        read_labels(LabelSource(tmp_path / "t.txt", "uid", "y"))
    assert read_labels(LabelSource(tmp_path / "t.csv.gz", "uid", "y"))[0].tolist() == ["007", "8"]
    ids, column = read_id_list(tmp_path / "t.csv.gz", "uid")  # was read as lines of gzip bytes
    assert ids.tolist() == ["007", "8"] and column == "uid"
    (tmp_path / "ids.txt").write_text("007\n8\n")
    ids, column = read_id_list(tmp_path / "ids.txt")  # not a table: one ID per line
    assert ids.tolist() == ["007", "8"] and column is None


def test_text_id_files_that_are_not_one_id_per_line_are_refused(tmp_path: Path) -> None:
    """A .tsv (its header would become an ID), a table row in a text file, or binary bytes are refused by name."""
    from partialvfl.cli.federated import read_id_list

    (tmp_path / "ids.tsv").write_text("uid\tscore\n007\t0.5\n")
    with pytest.raises(ValueError, match=r"ids\.tsv: '\.tsv' is not a format --ids reads"):
        read_id_list(tmp_path / "ids.tsv")
    (tmp_path / "rows.txt").write_text("007\n8,0.5\n")
    with pytest.raises(ValueError, match=r"rows\.txt, line 2: '8,0\.5' holds a tab or comma"):
        read_id_list(tmp_path / "rows.txt")
    (tmp_path / "blob.dat").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ValueError, match=r"blob\.dat is not UTF-8 text"):
        read_id_list(tmp_path / "blob.dat")
    (tmp_path / "ids.lst").write_text("  007 \r\n\n8\r\n")  # any other name: text, blank lines skipped
    assert read_id_list(tmp_path / "ids.lst")[0].tolist() == ["007", "8"]


# ---------------------------------------------------------------------- per-row seeds (issue 34)
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1).filter(str.strip)


@given(st.lists(st.one_of(st.integers(0, 10**6), TEXT), min_size=1, max_size=30, unique_by=lambda v: str(v).strip()),
       st.randoms(use_true_random=False), st.integers(0, 2**40))
@settings(max_examples=40, deadline=None)
def test_a_rows_seed_is_its_ids_whatever_the_others(ids: list[object], rnd: random.Random, seed: int) -> None:
    seeds = dict(zip(map(str, ids), id_seeds(ids, seed, "false-vfl", "predict")))
    shuffled = list(ids)
    rnd.shuffle(shuffled)
    again = id_seeds(shuffled + shuffled[:3], seed, "false-vfl", "predict")  # another order, some twice
    assert [seeds[str(i)] for i in shuffled + shuffled[:3]] == again.tolist()
    assert all(0 <= s < 2**63 for s in seeds.values())
    assert id_seeds(ids, seed + 1, "false-vfl", "predict").tolist() != list(seeds.values())  # the model's seed


def test_one_id_written_three_ways_is_one_seed_and_the_secret_keys_it() -> None:
    assert len(set(id_seeds([7, 7.0, " 7", np.int64(7)], 0).tolist())) == 1
    assert id_seeds(["007"], 0)[0] != id_seeds(["7"], 0)[0]
    # a party knows the model's seed: seeds that cross to it are keyed by a secret too (FALSE-VFL's, issue 34)
    assert id_seeds(["7"], 0, secret=b"a")[0] != id_seeds(["7"], 0)[0] != id_seeds(["7"], 0, secret=b"b")[0]
