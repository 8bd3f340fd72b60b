"""Typed messages: declarations, the checks both transports run, registration rules, the generated docs."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
from partialvfl.federation.runtime import party as party_module
from partialvfl.federation.wire.schema import check_reply, check_request
from partialvfl.methods.base import get_method

ROOT = Path(__file__).resolve().parents[1]


def _request(spec: MessageSpec, tensors: dict[str, torch.Tensor], meta: dict[str, Any] | None = None,
             config: dict[str, Any] | None = None) -> None:
    check_request(spec, tensors, meta or {}, where="party 0 ('a'), program 'p'", kind="k", config=config)


def _reply(spec: MessageSpec, request: dict[str, torch.Tensor], reply: dict[str, torch.Tensor],
           config: dict[str, Any] | None = None) -> None:
    check_reply(spec, request, reply, where="party 0 ('a'), program 'p'", kind="k", config=config)


# ---------------------------------------------------------------------- declarations and checks
ENCODE = MessageSpec(request=[TensorSpec("rows", "int64", ("B",))],
                     reply=[TensorSpec("mu", "float32", ("B", "d_h"))], meta=["data"], optional_meta=["train"])


def test_a_well_formed_exchange_passes_and_symbols_bind_across_request_and_reply() -> None:
    rows = {"rows": torch.arange(5)}
    _request(ENCODE, rows, {"data": "x", "train": True, "step": 3, "round": 0}, {"d_h": 4})
    _reply(ENCODE, rows, {"mu": torch.zeros(5, 4)}, {"d_h": 4})
    with pytest.raises(MessageError, match=r"reply: tensor 'mu' dimension 0 \(B\) is 6, but B = 5 from tensor 'rows'"):
        _reply(ENCODE, rows, {"mu": torch.zeros(6, 4)}, {"d_h": 4})
    with pytest.raises(MessageError, match="dimension 1 \\(d_h\\) is 3, but d_h = 4 from the program's config"):
        _reply(ENCODE, rows, {"mu": torch.zeros(5, 3)}, {"d_h": 4})
    _reply(ENCODE, rows, {"mu": torch.zeros(5, 3)}, {"d_h": "not an int: a free symbol"})


def test_errors_name_program_kind_direction_and_tensor() -> None:
    with pytest.raises(MessageError) as e:
        _request(ENCODE, {"rows": torch.zeros(2)}, {"data": "x"})
    assert str(e.value) == "party 0 ('a'), program 'p', kind 'k', request: tensor 'rows' must be int64, got float32"
    assert (e.value.kind, e.value.direction, e.value.tensor) == ("k", "request", "rows")
    with pytest.raises(MessageError, match="missing meta key 'data'"):
        _request(ENCODE, {"rows": torch.arange(2)})
    with pytest.raises(MessageError, match="unknown meta key 'tarin'; accepted: data, train"):
        _request(ENCODE, {"rows": torch.arange(2)}, {"data": "x", "tarin": True})
    with pytest.raises(MessageError, match="missing tensor 'rows' \\(int64 shape \\(B\\)\\)"):
        _request(ENCODE, {}, {"data": "x"})
    with pytest.raises(MessageError, match="unexpected tensor 'x'; declared: rows"):
        _request(ENCODE, {"rows": torch.arange(2), "x": torch.zeros(2)}, {"data": "x"})
    with pytest.raises(MessageError, match="must have rank 1 \\(B\\), got shape \\(2, 2\\)"):
        _request(ENCODE, {"rows": torch.zeros(2, 2, dtype=torch.int64)}, {"data": "x"})


def test_name_patterns_scope_their_symbols_per_placeholder_value() -> None:
    spec = MessageSpec(request=[TensorSpec("rows:{model}", "int64", ("B",))],
                       reply=[TensorSpec("emb:{model}", "float32", ("B", 2))])
    req = {"rows:f": torch.arange(3), "rows:g": torch.arange(5)}
    _request(spec, req)
    _reply(spec, req, {"emb:f": torch.zeros(3, 2), "emb:g": torch.zeros(5, 2)})  # B is 3 for f, 5 for g
    with pytest.raises(MessageError, match="tensor 'emb:g' dimension 0 \\(B\\) is 3, but B = 5"):
        _reply(spec, req, {"emb:f": torch.zeros(3, 2), "emb:g": torch.zeros(3, 2)})
    with pytest.raises(MessageError, match="missing tensor 'emb:g' \\(the request has model 'g'\\)"):
        _reply(spec, req, {"emb:f": torch.zeros(3, 2)})
    with pytest.raises(MessageError, match="missing tensor 'rows:\\{model\\}': at least one"):
        _request(spec, {})
    with pytest.raises(MessageError, match="unexpected tensor 'rows'"):
        _request(spec, {"rows": torch.arange(3)})  # a placeholder stands for at least one character


def test_wildcards_any_rank_sums_and_config_conditions() -> None:
    state = MessageSpec(request=[TensorSpec("top.*", ("float32", "int64")), TensorSpec("n", "int64", ())])
    _request(state, {"top.0.weight": torch.zeros(2, 3), "top.1.count": torch.tensor([1]), "n": torch.tensor(4)})
    with pytest.raises(MessageError, match="'top.x' must be float32/int64, got bool"):
        _request(state, {"top.x": torch.zeros(1, dtype=torch.bool), "n": torch.tensor(4)})
    dec = MessageSpec(request=[TensorSpec("h", "float32", ("B",), optional=True),
                               TensorSpec("h_mis", "float32", ("M",), optional=True, when={"variant": 2})],
                      reply=[TensorSpec("mask", "float32", ("B+M",), optional=True, when={"variant": 2})])
    two = {"variant": 2}
    req = {"h": torch.zeros(3), "h_mis": torch.zeros(2)}
    _reply(dec, req, {"mask": torch.zeros(5)}, two)
    with pytest.raises(MessageError, match="'mask' dimension 0 \\(B\\+M\\) is 4, but B = 3, M = 2"):
        _reply(dec, req, {"mask": torch.zeros(4)}, two)
    _reply(dec, {"h_mis": torch.zeros(2)}, {"mask": torch.zeros(7)}, two)  # B unknown: the sum is not checked
    with pytest.raises(MessageError, match="unexpected tensor 'h_mis' \\(only when variant=2\\)"):
        _request(dec, req, config={"variant": 1})
    assert tensor_names({"d": dec}) == {"h", "h_mis", "mask"}
    assert tensor_names({"d": dec}, {"variant": 1}) == {"h"}


def test_declarations_refuse_unknown_dtypes_bad_dimensions_and_duplicates() -> None:
    with pytest.raises(ValueError, match="dtype"):
        TensorSpec("x", "float")
    with pytest.raises(ValueError, match="neither a size nor a symbol"):
        TensorSpec("x", "float32", ("B", -1))
    with pytest.raises(ValueError, match="twice"):
        MessageSpec(request=[TensorSpec("x", "float32"), TensorSpec("x", "int64")])
    with pytest.raises(ValueError, match="both required and optional"):
        MessageSpec(meta=["a"], optional_meta=["a"])
    with pytest.raises(ValueError, match="no message kind"):
        tensor_names({"k": ENCODE}, kinds=["nope"])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 6), st.integers(1, 5), st.sampled_from(["none", "rows", "mu0", "mu1", "dtype", "rank"]))
def test_the_check_passes_exactly_the_consistent_exchanges(b: int, d_h: int, fault: str) -> None:
    rows = torch.arange(b) if fault != "dtype" else torch.zeros(b)
    if fault == "rows":
        rows = torch.arange(b + 1)
    mu = torch.zeros(b + (fault == "mu0"), d_h + (fault == "mu1"))
    if fault == "rank":
        mu = mu.reshape(-1)
    config = {"d_h": d_h}
    try:
        _request(ENCODE, {"rows": rows}, {"data": "x"}, config)
        _reply(ENCODE, {"rows": rows}, {"mu": mu}, config)
    except MessageError as e:
        assert fault != "none" and e.tensor in ("rows", "mu") and "kind 'k'" in str(e)
    else:
        assert fault == "none"


# ---------------------------------------------------------------------- registration and the runtime
def _program(messages: Any, **handlers: Any) -> type[PartyProgram]:
    return type("P", (PartyProgram,), {"program_name": "test/schema-unregistered", "messages": messages, **handlers})


def _answer(self: PartyProgram, req: Request) -> Reply:
    return Reply({"y": req.tensors["x"].sum(-1)})


def test_registration_requires_a_declaration_for_every_handler_and_a_handler_for_every_declaration() -> None:
    with pytest.raises(ValueError, match="declares no messages"):
        register_program(_program({}, on_k=_answer))
    with pytest.raises(ValueError, match="declares kind 'k' but has no on_k"):
        register_program(_program({"k": MessageSpec()}))
    with pytest.raises(ValueError, match="answers undeclared kind\\(s\\) \\['other'\\]"):
        register_program(_program({"k": MessageSpec()}, on_k=_answer, on_other=_answer))
    with pytest.raises(ValueError, match="built-in kind 'save'"):
        register_program(_program({"save": MessageSpec()}, on_save=_answer))
    assert "test/schema-unregistered" not in party_module.PROGRAMS


@register_program
class _SumParty(PartyProgram):
    program_name = "test/schema-sum"
    messages = {"sum": MessageSpec(request=[TensorSpec("x", "float32", ("B", "feature_dim"))],
                                   reply=[TensorSpec("y", "float32", ("B",))])}

    def on_sum(self, req: Request) -> Reply:
        x = req.tensors["x"]
        return Reply({"y": x.sum(-1) if x.shape[0] != 2 else x.sum()})  # a bug for batches of two


def _two_parties() -> VerticalDataset:
    rng = np.random.default_rng(0)
    return VerticalDataset([rng.normal(size=(6, 3)), rng.normal(size=(6, 2))], np.ones((6, 2), bool),
                           y=rng.integers(0, 2, 6), task=Task.classification([0, 1]))


def test_the_local_transport_checks_requests_replies_and_kinds_before_setup() -> None:
    data = _two_parties()
    fed = LocalFederation.for_dataset(data)
    fed.transport.new_step()
    with pytest.raises(RuntimeError, match="got 'sum' before any setup"):
        fed.call(0, "sum", {"x": torch.zeros(1, 3)})
    fed.setup("test/schema-sum", [{"feature_dim": d} for d in data.feature_dims], seed=0)
    fed.transport.new_step()
    assert fed.call(0, "sum", {"x": torch.ones(4, 3)}).tensors["y"].tolist() == [3.0] * 4
    fed.transport.new_round()
    with pytest.raises(MessageError, match="program 'test/schema-sum', kind 'sum', request: tensor 'x' dimension 1 "
                                           "\\(feature_dim\\) is 3, but feature_dim = 2"):
        fed.call(1, "sum", {"x": torch.ones(4, 3)})
    fed.transport.new_round()
    with pytest.raises(MessageError, match="kind 'sum', reply: tensor 'y' must have rank 1 \\(B\\), got shape \\(\\)"):
        fed.call(0, "sum", {"x": torch.ones(2, 3)})
    fed.transport.new_round()
    with pytest.raises(MessageError, match="kind 'nope': unknown message kind; the program answers sum"):
        fed.call(0, "nope")


# ---------------------------------------------------------------------- the real programs, in a normal fit
def _fit_data() -> VerticalDataset:
    rng = np.random.default_rng(1)
    n, dims = 60, (4, 3, 5)
    y = rng.integers(0, 3, n)
    blocks = [rng.normal(size=(3, d))[y] * 2 + rng.normal(size=(n, d)) * 0.5 for d in dims]
    obs = rng.random((n, 3)) > 0.3
    obs[:20] = True  # an aligned core
    for k, b in enumerate(blocks):
        b[~obs[:, k]] = np.nan
    return VerticalDataset(blocks, obs, y=y, labeled=rng.random(n) < 0.8, task=Task.classification([0, 1, 2]))


FITS = {
    "false-vfl-2": dict(d_h=4, d_z=2, encoder_hidden=[8], decoder_hidden=[8], global_hidden=[8],
                        discriminator_hidden=[8], mask_hidden=[8], importance_samples=2,
                        predict_importance_samples=3, pretrain_epochs=1, epochs=1, pretrain_batch_size=32,
                        batch_size=32),
    "combinatorial": dict(latent_dim=4, encoder_hidden=[8], epochs=1, batch_size=32, pretrain=True, pretrain_epochs=1,
                          pretrain_batch_size=32, lr_schedule="cosine"),
    "fedhssl": dict(latent_dim=4, encoder_hidden=[8, 8], proj_dim=4, proj_hidden=8, pred_hidden=4, pretrain_epochs=1,
                    pretrain_batch_size=16, epochs=1, batch_size=16),
    "x-vfl": dict(latent_dim=4, encoder_hidden=[8], xcom_hidden=[8], top_hidden=[8], epochs=2, batch_size=16,
                  estimator="page", optimizer="sgd", lr=0.01, momentum=0.0),
}


#: a second fit where one fit cannot send every kind: the split program's generative initialisation (init_encoder)
ALSO = {"combinatorial": dict(latent_dim=4, encoder_hidden=[8], epochs=1, batch_size=32, pretrain=True,
                              pretrain_kind="false-vfl", pretrain_epochs=1,
                              generative={"pretrain_batch_size": 32, "decoder_hidden": [8], "global_hidden": [8]})}


@pytest.mark.parametrize("method", sorted(FITS))
def test_every_message_of_a_real_fit_is_checked_and_passes(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    checked: Counter[tuple[str, str]] = Counter()

    def spy(direction: str, fn: Any) -> Any:
        def wrapped(*args: Any, kind: str, **kw: Any) -> Any:
            checked[(direction, kind)] += 1
            return fn(*args, kind=kind, **kw)  # the request's typed metadata
        return wrapped

    monkeypatch.setattr(party_module, "check_request", spy("request", check_request))
    monkeypatch.setattr(party_module, "check_reply", spy("reply", check_reply))
    data = _fit_data()
    log = MessageLog()
    model = get_method(method)("fast", seed=0, **FITS[method]).fit(data, log=log)
    model.predict_proba(data)
    if method in ALSO:  # kinds another option of the same program sends
        get_method(method)("fast", seed=0, **ALSO[method]).fit(data, log=log)
    if hasattr(model, "predict_output_local"):
        model.predict_output_local(data, 0)
    sent = Counter((e.direction, e.kind) for e in log.entries)
    assert sent == checked  # every request and every reply went through its declaration (and passed)
    assert set(party_module.PROGRAMS[model.party_program].messages) <= {k for _, k in sent}  # all exercised


# ---------------------------------------------------------------------- derived artefacts
def _docs_script() -> Any:
    spec = importlib.util.spec_from_file_location("message_docs", ROOT / "scripts" / "message_docs.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docs_messages_md_is_generated_from_the_declarations() -> None:
    text = _docs_script().render()
    assert (ROOT / "docs" / "messages.md").read_text() == text, "run: python scripts/message_docs.py"
    for program in ("false-vfl/party", "splitnn/party", "x-vfl/party", "fedhssl/party"):
        assert f"## `{program}`" in text
    assert "test/" not in text  # test programs are not part of the library's documentation
    assert "[messages](messages.md)" in (ROOT / "docs" / "deployment.md").read_text()


def test_false_vfl_allowed_tensors_are_its_declaration() -> None:
    from partialvfl.methods.false_vfl import ALLOWED_TENSORS, FalseVFLParty, allowed_tensors

    common = {"rows", "next_rows", "mu", "logvar", "loglik", "grad_loglik", "grad_mu", "grad_logvar"}
    assert allowed_tensors(1, "samples") == common | {"h", "grad_h"}
    assert allowed_tensors(1, "lean") == common | {"mean", "scale", "pos", "seed", "grad_mean", "grad_scale"}
    assert allowed_tensors(2, "samples") - allowed_tensors(1, "samples") == {
        "h_mis", "seed_mis", "mask_loglik", "grad_mask_loglik", "grad_h_mis"}
    assert allowed_tensors(2, "lean") - allowed_tensors(1, "lean") == {
        "mean_mis", "scale_mis", "pos_mis", "seed_mis", "mask_loglik", "grad_mask_loglik", "grad_mean_mis",
        "grad_scale_mis"}
    assert ALLOWED_TENSORS[1] == allowed_tensors(1, "lean") | allowed_tensors(1, "samples")
    assert ALLOWED_TENSORS[2] == tensor_names(FalseVFLParty)
