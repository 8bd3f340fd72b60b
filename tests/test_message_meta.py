"""Typed message metadata (issue 37, the rest of item 3): every message declaration types its metadata keys; the
party reads a request's metadata once, on arrival, strictly as JSON carries it, refusing a value its key does not
admit in one line naming the party, the program, the kind and the key; the handlers get typed values (the AST check
that no party module casts a metadata value: tests/test_setup_config.py).

A real party process refusing a string count: tests/test_party_hardening.py."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import test_setup_config as configs
from partialvfl.federation import LocalFederation, PartyRuntime, Request
from partialvfl.federation.grpc.party import SERVER_MESSAGES
from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.federation.trust.psu import PSU_MESSAGES
from partialvfl.federation.wire.meta_keys import MetaKey
from partialvfl.federation.wire.program import RUNTIME_MESSAGES
from partialvfl.federation.wire.schema import MessageError, MessageSpec, check_request
from partialvfl.methods.x_vfl.party import WithinBlock


def every_declaration() -> dict[str, MessageSpec]:
    """``{"<owner> <kind>": declaration}`` of every message the package declares."""
    out = {f"runtime {k}": s for k, s in RUNTIME_MESSAGES.items()}
    out.update({f"server {k}": s for k, s in {**SERVER_MESSAGES, **PSU_MESSAGES}.items()})
    for name, cls in configs.package_programs().items():
        out.update({f"{name} {k}": s for k, s in cls.messages.items()})
    return out


def test_every_package_declaration_types_every_metadata_key() -> None:
    untyped = [f"{where}: {key}" for where, spec in every_declaration().items() for key, mk in spec.meta_types
               if not mk.typed]
    assert not untyped, untyped
    keys = sum(len(spec.meta_types) for spec in every_declaration().values())
    assert keys >= 60, keys


def test_a_declaration_keeps_the_key_names_and_a_list_still_declares_untyped_keys() -> None:
    spec = MessageSpec(meta={"data": MetaKey(str)}, optional_meta=["note"])
    assert spec.meta == ("data",) and spec.optional_meta == ("note",)
    assert dict(spec.meta_types)["note"].typed is False
    typed = check_request(spec, {}, {"data": "h", "note": [1, {"x": None}]}, where="p", kind="k")
    assert typed == {"data": "h", "note": [1, {"x": None}]}
    with pytest.raises(TypeError, match="meta key 'data' is declared as <class 'str'>, not a MetaKey"):
        MessageSpec(meta={"data": str})
    with pytest.raises(TypeError, match="unsupported metadata type"):
        MetaKey(list)
    with pytest.raises(ValueError, match="meta key 'choice' must be text, got 3"):
        MetaKey(str, choices=("a", 3))


# ---------------------------------------------------------------------- refusals at a party
def party(program: str) -> PartyRuntime:
    """A party that set up ``program`` with a config a method sends it."""
    rt = PartyRuntime(0, "bank", policy=PartyPolicy.research(), feature_shape=(6,))
    configs.setup(rt, program, configs.valid_config(program))
    return rt


#: (program or None for a built-in, kind, meta, key, value): ``meta`` a valid request's, ``value`` refused
REFUSED = [
    ("false-vfl/party", "decode", {"batch": 2, "samples": 4, "noise_seed": 0}, "samples", "4"),  # text, not a count
    ("false-vfl/party", "decode", {"batch": 2, "samples": 4, "noise_seed": 0}, "samples", 4.0),
    ("false-vfl/party", "decode", {"batch": 2, "samples": 4, "noise_seed": 0}, "samples", 0),  # out of range
    ("false-vfl/party", "decode", {"batch": 2, "samples": 4, "noise_seed": 0}, "noise_seed", -1),
    ("false-vfl/party", "decode", {"batch": 2, "samples": 4, "noise_seed": 0}, "batch", True),  # a flag is no count
    ("false-vfl/party", "encode", {"data": "train"}, "train", 1),  # 1 is not true
    ("false-vfl/party", "encode", {"data": "train"}, "data", 3),
    ("splitnn/party", "set_lr", {"lr": 0.1}, "lr", "0.1"),
    ("splitnn/party", "pretrain", {"data": "train", "simsiam": {}, "epoch": 0}, "epoch", "0"),
    ("splitnn/party", "pretrain", {"data": "train", "simsiam": {}, "epoch": 0}, "models", "f"),
    ("splitnn/party", "pretrain", {"data": "train", "simsiam": {}, "epoch": 0}, "simsiam", [1]),
    ("x-vfl/party", "step", {"mode": "sgd"}, "mode", "adam"),  # not one of its choices
    ("x-vfl/party", "share_top", {"top_hidden": [8], "n_classes": 3}, "top_hidden", [8, 0]),
    ("x-vfl/party", "embed", {"data": "train"}, "wb", {"rate": 0.5}),  # a nested key missing
    ("x-vfl/party", "embed", {"data": "train"}, "wb", {"rate": "0.5", "seed": 1}),
    ("fedhssl/party", "local_ssl", {"data": "train", "batch_size": 8, "local_weight": 1.0, "guidance_weight": 0.5,
                                    "augment": {}}, "batch_size", "8"),
    ("fedhssl/party", "local_ssl", {"data": "train", "batch_size": 8, "local_weight": 1.0, "guidance_weight": 0.5,
                                    "augment": {}}, "local_weight", math.nan),  # never NaN
    ("fedhssl/party", "get_top", {"aggregate": "top"}, "aggregate", "everything"),
    (None, "setup", {"program": "splitnn/party"}, "seed", 0.5),  # a float seed is not truncated
    (None, "preprocess", {"data": "train"}, "standardize", "yes"),
    (None, "save", {"dir": "d"}, "model", 12),
]


@pytest.mark.parametrize(("program", "kind", "meta", "key", "value"), REFUSED,
                         ids=[f"{p}:{k}:{key}={v!r}" for p, k, _, key, v in REFUSED])
def test_a_party_refuses_a_metadata_value_its_key_does_not_admit_naming_party_program_kind_and_key(
        program: str | None, kind: str, meta: dict[str, Any], key: str, value: Any) -> None:
    rt = party(program) if program else PartyRuntime(0, "bank", policy=PartyPolicy.research(), feature_shape=(6,))
    with pytest.raises(MessageError) as e:
        rt.check(Request(kind, {}, {**meta, key: value}))
    text = configs._one_line(e.value)
    owner = f"program {program!r}" if program else "built-in"
    assert text.startswith(f"party 0 ('bank'), {owner}, kind {kind!r}, request: meta key '{key}"), text
    assert repr(value) in text or key == "wb", text


def test_stamps_are_counts_and_an_unknown_or_missing_key_is_named() -> None:
    rt = party("x-vfl/party")
    with pytest.raises(MessageError, match=r"meta key 'step' must be an integer >= 0 or null, got '3'"):
        rt.check(Request("step", {}, {"mode": "sgd", "step": "3"}))
    with pytest.raises(MessageError, match=r"missing meta key 'mode' \(one of 'sgd', 'page-fresh', 'page-correct'\)"):
        rt.check(Request("step", {}, {}))
    with pytest.raises(MessageError, match=r"unknown meta key 'modus'; accepted: mode"):
        rt.check(Request("step", {}, {"mode": "sgd", "modus": "sgd"}))


def test_the_handler_gets_typed_values() -> None:
    """An integer sent for a number arrives as a float; a list as a list; a nested declaration as its object."""
    rt = party("x-vfl/party")
    req = rt.check(Request("embed", {"rows": torch.zeros(0, dtype=torch.int64)},
                           {"data": "train", "wb": {"rate": 1, "seed": 4}, "train": False}))
    assert req.meta["wb"] == WithinBlock(rate=1.0, seed=4) and isinstance(req.meta["wb"].rate, float)
    rt = party("splitnn/party")
    req = rt.check(Request("set_lr", {}, {"lr": 1}))
    assert req.meta["lr"] == 1.0 and isinstance(req.meta["lr"], float)
    req = rt.check(Request("pretrain", {}, {"data": "train", "simsiam": {"lr": 0.1}, "epoch": 0,
                                            "models": ("f",)}))
    assert req.meta["models"] == ["f"] and req.meta["simsiam"] == {"lr": 0.1}


@settings(max_examples=40, deadline=None)
@given(st.one_of(st.integers(-3, 10), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                 st.text(max_size=3), st.none(), st.lists(st.integers(0, 3), max_size=2)))
def test_a_count_admits_exactly_the_integers_at_least_its_low_bound(value: Any) -> None:
    spec = MessageSpec(meta={"n": MetaKey(int, low=1)})
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if ok:
        assert check_request(spec, {}, {"n": value}, where="p", kind="k") == {"n": value}
    else:
        with pytest.raises(MessageError, match="meta key 'n' must be an integer >= 1, got "):
            check_request(spec, {}, {"n": value}, where="p", kind="k")


def test_a_coordinator_sending_a_string_count_is_refused_by_the_party() -> None:
    """The in-process federation: a ``decode`` whose sample count is text (as a careless coordinator might send
    it) reaches no handler; every party refuses it naming the key.  The same request with the count an integer,
    through JSON (the wire), passes the declaration."""
    fed = LocalFederation(["bank", "shop"], 0)
    fed.setup("false-vfl/party", configs.method_configs("false-vfl-1"), seed=0)
    fed.transport.new_step()
    meta = {"train": False, "noise_seed": 7, "batch": 0, "samples": "4"}
    with pytest.raises(MessageError, match=r"party 1 \('shop'\), program 'false-vfl/party', kind 'decode', request: "
                                           r"meta key 'samples' must be an integer >= 1, got '4'"):
        fed.call(1, "decode", {}, **meta)
    typed = fed.runtimes[1].check(Request("decode", {}, json.loads(json.dumps({**meta, "samples": 4}))))
    assert typed.meta["samples"] == 4
