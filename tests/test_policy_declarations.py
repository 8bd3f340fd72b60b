"""The policy reads what a party program declares, never a method's name or config keys (issue 22, item 1).

A toy program defined here, outside the package, declares its setup (``describe_setup``) and its messages' roles;
the party's policy checks it from those declarations alone: a too-wide setup, weight sharing by role, learning rates
by declared metadata, and the prediction-table guard by role.  And the federation layer's source names no method.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from partialvfl.federation import MessageSpec, PartyProgram, PartyRuntime, Reply, Request, TensorSpec
from partialvfl.federation.runtime import party as party_module
from partialvfl.federation.trust.guards import InferenceGuard
from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.federation.wire.program import register_program
from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.federation.wire.schema import INFERS, SHARES_WEIGHTS, TRAINS, Messages, kinds_with_role
from partialvfl.federation.wire.setup_shape import Network, SetupShape
from partialvfl.methods import load_all

D = 4  # the toy party's feature count
FEDERATION = Path(__file__).resolve().parents[1] / "src" / "partialvfl" / "federation"


@register_program
class ToyPolicyParty(PartyProgram):
    """A one-layer projection of the party's rows, declared for the policy like any program of the package."""

    program_name = "test/toy-policy"
    messages: ClassVar[Messages] = {
        "project": MessageSpec(request=[TensorSpec("rows", "int64", ("B",))],
                               reply=[TensorSpec("out", "float32", ("B", "width"))], meta=["data"],
                               optional_meta=["train"], role=INFERS, releases=["out"]),
        "learn": MessageSpec(request=[TensorSpec("grad", "float32", ("B", "width"))], optional_meta=["rate"],
                             learning_rates=["rate"]),
        "weights": MessageSpec(reply=[TensorSpec("w", "float32", ("width", "feature_dim"))], role=SHARES_WEIGHTS),
    }

    @classmethod
    def describe_setup(cls, config: Mapping[str, Any]) -> SetupShape:
        d, width = int(config["feature_dim"]), int(config["width"])
        net = Network("projection", "mlp", tuple(int(h) for h in config["hidden"]), (d,), width, width)
        return SetupShape((net,), {"lr": float(config["lr"])}, feature_shape=(d,))

    def __init__(self, runtime: PartyRuntime, config: dict[str, Any], seed: int) -> None:
        super().__init__(runtime, config, seed)
        self.w = torch.zeros(int(config["width"]), int(config["feature_dim"]))

    def on_project(self, req: Request) -> Reply:
        return Reply({"out": torch.zeros(len(req.tensors["rows"]), self.w.shape[0])})

    def on_learn(self, req: Request) -> Reply:
        return Reply()

    def on_weights(self, req: Request) -> Reply:
        return Reply({"w": self.w.clone()})


def _runtime(**policy: Any) -> PartyRuntime:
    table = {"programs": ["builtin", "test/toy-policy"], **policy}
    return PartyRuntime(0, "bank", policy=PartyPolicy.from_table(table), feature_shape=(D,))


def _setup(rt: PartyRuntime, **change: Any) -> None:
    config = {"feature_dim": D, "width": 2 * D, "hidden": [8], "lr": 1e-3, **change}
    rt.handle(Request("setup", {}, {"program": "test/toy-policy", "config": config, "seed": 1}))


def test_a_program_outside_the_package_is_not_on_the_default_allowlist_and_the_refusal_says_how_to_add_it() -> None:
    rt = PartyRuntime(0, "bank", policy=PartyPolicy.default(), feature_shape=(D,))
    with pytest.raises(PolicyViolation) as e:
        _setup(rt)
    assert e.value.rule == "programs" and e.value.accept == {"programs": ["builtin", "test/toy-policy"]}
    assert '[policy] programs = ["builtin", "test/toy-policy"]' in str(e.value)
    load_all()  # every program of the package is registered: all of them are on the default allowlist, no other
    default = PartyPolicy.default()
    assert {n for n, c in party_module.PROGRAMS.items() if default.runs(n, c)} == {
        "false-vfl/party", "fedhssl/party", "splitnn/party", "x-vfl/party"}

    from partialvfl.methods.splitnn.party import SplitParty

    class Subclassed(SplitParty):  # a plugin's subclass of a package program is not the package's own
        program_name = "plugin/split"

    assert default.runs("splitnn/party", SplitParty) and not default.runs("plugin/split", Subclassed)


def test_the_policy_checks_a_toy_setup_from_its_description_alone() -> None:
    rt = _runtime()
    with pytest.raises(PolicyViolation) as e:
        _setup(rt, width=2 * D + 1)  # 9 values per row from 4 features
    assert e.value.rule == "max_width_ratio" and "projection would send 9 values per row" in str(e.value)
    assert e.value.accept == {"max_width_ratio": 2.25} and rt.program is None
    with pytest.raises(PolicyViolation) as e:
        _setup(rt, hidden=[], lr=0.0)  # every rule it breaks, at once
    assert e.value.rules == ("min_hidden_layers", "min_lr") and e.value.accept == {"min_hidden_layers": 0,
                                                                                   "min_lr": 0.0}
    with pytest.raises(PolicyViolation, match="cannot read the 'test/toy-policy' config"):
        _setup(rt, hidden="wide")
    _setup(_runtime(max_width_ratio=2.25), width=2 * D + 1)  # the value the refusal named accepts it
    _setup(rt)
    assert isinstance(rt.program, ToyPolicyParty)


def test_weight_sharing_and_learning_rates_are_checked_by_the_declared_roles() -> None:
    rt = _runtime()
    _setup(rt)
    with pytest.raises(PolicyViolation) as e:
        rt.handle(Request("weights", {}, {}))
    assert e.value.rule == "allow_weight_sharing" and "'weights' would send this party's weights" in str(e.value)
    with pytest.raises(PolicyViolation, match="learn rate 1e-09 is under this party's floor of 1e-06"):
        rt.handle(Request("learn", {"grad": torch.zeros(2, 2 * D)}, {"rate": 1e-9}))
    rt.handle(Request("learn", {"grad": torch.zeros(2, 2 * D)}, {"rate": 1e-3}))
    sharing = _runtime(allow_weight_sharing=True)
    _setup(sharing)
    assert sharing.handle(Request("weights", {}, {})).tensors["w"].shape == (2 * D, D)


def test_the_prediction_table_guard_lets_inference_kinds_through_and_refuses_training_kinds() -> None:
    guard = InferenceGuard()
    messages = ToyPolicyParty.messages
    assert kinds_with_role(ToyPolicyParty, INFERS) == {"project"}
    guard.check(messages, "project", {"data": "new"}, {"new"}, "test/toy-policy")  # inference on new rows: fine
    guard.accepted({"data": "new"}, {"new"})
    for kind, meta in (("project", {"data": "new", "train": True}), ("learn", {}), ("weights", {})):
        with pytest.raises(PolicyViolation) as e:
            guard.check(messages, kind, meta, {"new"}, "test/toy-policy")
        assert e.value.rule == "prediction_tables" and "inference kinds of 'test/toy-policy': ['project']" in str(
            e.value)
    guard.check(messages, "learn", {"data": "train"}, {"new"}, "test/toy-policy")  # back on training rows


def test_message_declarations_refuse_unknown_roles_releases_and_learning_rate_keys() -> None:
    assert MessageSpec().role == TRAINS  # undeclared: the safe assumption (never used on prediction rows)
    with pytest.raises(ValueError, match="role must be one of trains, infers, shares_weights"):
        MessageSpec(role="predicts")
    with pytest.raises(ValueError, match=r"releases names \['emb'\], which are not reply tensors"):
        MessageSpec(reply=[TensorSpec("out", "float32")], releases=["emb"])
    with pytest.raises(ValueError, match=r"learning_rates names \['lr'\], which are not meta keys"):
        MessageSpec(meta=["rate"], learning_rates=["lr"])
    with pytest.raises(ValueError, match="'builtin' names the package's own programs"):
        register_program(type("Bad", (ToyPolicyParty,), {"program_name": "builtin"}))


def test_the_federation_layer_names_no_method_and_reads_no_method_config_key() -> None:
    load_all()
    names = {n for n, c in party_module.PROGRAMS.items() if c.__module__.startswith("partialvfl.methods.")}
    assert names  # the package's programs are registered
    kinds = {k for n in names for k in party_module.PROGRAMS[n].messages}
    for path in sorted(FEDERATION.glob("*.py")):
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        code = re.sub(r'"""(.|\n)*?"""', "", code)  # docstrings may give examples
        for name in names:
            assert name not in code, (path.name, name)
        for key in ("latent_dim", "d_h", "embed_dim", "xcom", "simsiam", "proj_dim", "encoder_hidden", "aggregate"):
            assert f'"{key}"' not in code, (path.name, key)
        # kinds such as get_top or set_lr (generic words like "step" are also the transports' stamps)
        assert not {f'"{k}"' for k in kinds if "_" in k} & set(re.findall(r'"[a-z_]+"', code)), path.name
