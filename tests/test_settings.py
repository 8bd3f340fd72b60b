"""Typed parameters (:mod:`partialvfl.methods.settings`, issue 22 item 2): each method's resolved parameters as one
frozen object read as attributes, equal to the plain ``params_`` dict that model files, reports and the wire keep."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partialvfl.data.builders import from_tables
from partialvfl.data.dataset import Task
from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.methods import VFLMethod, get_method
from partialvfl.methods.base import method_names
from partialvfl.methods.model_files import IndexInfo, method_from_meta
from partialvfl.methods.params import Param, ParamSpace, inferred_space
from partialvfl.methods.settings import ParamsDict, settings_class

DATASETS = (None, "isolet", "hapt", "fashion-mnist", "modelnet10", "cifar10")
BUILTIN = ("combinatorial", "ensemble", "false-vfl-1", "false-vfl-2", "fedhssl", "laser-vfl", "local", "plug-vfl",
           "vanilla-vfl", "x-vfl")

EVERY_KIND = ParamSpace((
    Param("n", 3, "int", "an int", low=1),
    Param("rate", 0.5, "float", "a float", low=0, high=1),
    Param("on", True, "bool", "a bool"),
    Param("how", "a", "str", "a choice", choices=("a", "b")),
    Param("text", "x", "str", "free text"),
    Param("widths", [4, 2], "ints", "widths"),
    Param("span", [-1.0, 1.0], "range", "a range"),
    Param("blob", {"k": 1}, "any", "anything"),
    Param("maybe", None, "int", "an optional int", low=1, optional=True),
), groups={"pair": {"count": "n", "share": "rate"}})


def _bare(name: str, preset: str = "fast", dataset: str | None = None, **overrides: Any) -> VFLMethod:
    m = get_method(name)(preset, seed=0, **overrides)
    shapes = ((5,), (7,), (9,))
    m.index_ = IndexInfo(Task.classification([0, 1, 2]), ("a", "b", "c"), (5, 7, 9), shapes, 0)
    m.params_ = m.resolve_params(dataset)
    return m


# ---------------------------------------------------------------------- the generated class
def test_fields_are_typed_by_kind() -> None:
    cls = settings_class(EVERY_KIND, "toy")
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    assert types == {"n": int, "rate": float, "on": bool, "how": Literal["a", "b"], "text": str,
                     "widths": tuple[int, ...], "span": tuple[float, float], "blob": Any, "maybe": int | None}


def test_values_are_converted_once_to_the_declared_type() -> None:
    s = settings_class(EVERY_KIND, "toy")._of({"n": "7", "rate": 1, "on": "no", "how": "b", "text": "t",
                                                "widths": ["3", 5.0], "span": ("0", 2), "blob": [1], "maybe": None})
    assert (s.n, s.rate, s.on, s.how, s.widths, s.span, s.blob, s.maybe) == (7, 1.0, False, "b", (3, 5), (0.0, 2.0),
                                                                           [1], None)
    assert type(s.n) is int and type(s.rate) is float and type(s.span[0]) is float
    assert s._asdict() == {"n": 7, "rate": 1.0, "on": False, "how": "b", "text": "t", "widths": [3, 5],
                           "span": [0.0, 2.0], "blob": [1], "maybe": None}


def test_settings_are_frozen_and_replace_checks_the_new_values() -> None:
    s = settings_class(EVERY_KIND, "toy")._of(EVERY_KIND.defaults())
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.n = 4
    with pytest.raises(AttributeError):
        s.new_name = 1
    assert s._replace(n=9).n == 9 and s.n == 3
    with pytest.raises(ValueError, match="toy: parameter rate must be number in"):
        s._replace(rate=2)


def test_an_unknown_attribute_names_the_method_and_the_parameter() -> None:
    m = _bare("false-vfl-1")
    with pytest.raises(AttributeError, match=r"false-vfl-1: no parameter 'd_hh'; did you mean 'd_h'\?"):
        _ = m.settings_.d_hh
    with pytest.raises(AttributeError, match="x-vfl: no parameter 'kappa'"):
        _ = _bare("x-vfl").settings_.kappa


def test_missing_and_unknown_parameters_are_refused_by_name() -> None:
    cls = settings_class(EVERY_KIND, "toy")
    with pytest.raises(ValueError, match="toy: missing parameter.s. maybe"):
        cls._of({k: v for k, v in EVERY_KIND.defaults().items() if k != "maybe"})
    with pytest.raises(ValueError, match="toy: unknown parameter 'nn'; did you mean 'n'"):
        cls._of({**EVERY_KIND.defaults(), "nn": 1})


def test_groups_are_typed_frozen_sub_objects() -> None:
    s = settings_class(EVERY_KIND, "toy")._of({**EVERY_KIND.defaults(), "n": 5})
    assert s.pair.count == 5 and s.pair._asdict() == {"count": 5, "share": 0.5}
    assert {f.name: f.type for f in dataclasses.fields(s.pair)} == {"count": int, "share": float}
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.pair.count = 1
    opt = _bare("laser-vfl", lr=0.25, optimizer="sgd").settings_.optim
    assert opt._asdict() == {"name": "sgd", "lr": 0.25, "weight_decay": 1e-4, "momentum": 0.9}  # make_optimizer's


def test_a_group_must_name_declared_parameters_and_not_shadow_one() -> None:
    with pytest.raises(ValueError, match="group 'g' names 'nope'"):
        ParamSpace((Param("a", 1, "int", "a"),), groups={"g": {"x": "nope"}})
    with pytest.raises(ValueError, match="group 'a' has the name of a parameter"):
        ParamSpace((Param("a", 1, "int", "a"),), groups={"a": {"x": "a"}})


# ---------------------------------------------------------------------- every method, every preset
@pytest.mark.parametrize("name", BUILTIN)
def test_presets_resolve_to_the_same_values_as_the_dict(name: str) -> None:
    cls = get_method(name)
    fields = {f.name for f in dataclasses.fields(cls.settings_class())}
    assert fields == set(cls.param_space().names)
    for preset in cls.presets:
        for dataset in DATASETS:
            m = _bare(name, preset, dataset)
            plain = m.resolve_params(dataset)
            assert m.params_ == plain and json.dumps(m.params_) == json.dumps(plain)  # same values, types, order
            for p in cls.param_space().params:
                want = tuple(plain[p.name]) if p.kind in ("ints", "range") else plain[p.name]
                assert getattr(m.settings_, p.name) == want, (preset, dataset, p.name)


@pytest.mark.parametrize("name", BUILTIN)
def test_party_configs_are_plain_json(name: str) -> None:
    """What setup sends a party: JSON values only (lists, never tuples), so the wire and the policy see a dict."""
    m = _bare(name)
    announced = [PartyPolicy.research().announced()] * 3  # a fit plans first (FALSE-VFL resolves wire = auto)
    m._plan(SimpleNamespace(announced_policies=lambda: announced))
    for k in range(3):
        cfg = m._party_config(k)
        assert json.loads(json.dumps(cfg)) == cfg


def _values(p: Param) -> st.SearchStrategy:
    """Any value the declaration of ``p`` accepts (numbers also as the text the CLI passes)."""
    if p.choices is not None:
        out = st.sampled_from(p.choices)
    elif p.kind == "int":
        lo = -10**6 if p.low is None else math.ceil(p.low)
        out = st.integers(lo, 10**6 if p.high is None else math.floor(p.high))
        out = out | out.map(str)
    elif p.kind == "float":
        out = st.floats(p.low, p.high, allow_nan=False, allow_infinity=False)
        out = out | out.map(repr)
    elif p.kind == "bool":
        out = st.booleans() | st.sampled_from(["true", "no", "on", "0"])
    elif p.kind == "ints":
        out = st.lists(st.integers(1, 512), max_size=3)
    elif p.kind == "range":
        pair = st.tuples(st.floats(-50, 50), st.floats(-50, 50)).filter(lambda t: t[0] < t[1])
        out = pair | pair.map(list)
    else:
        out = st.text(max_size=4) if p.kind == "str" else st.integers() | st.text(max_size=3)
    return st.none() | out if p.optional else out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.slow
def test_for_any_valid_overrides_the_typed_object_equals_the_dict(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(BUILTIN))
    cls = get_method(name)
    space = cls.param_space()
    overrides = data.draw(st.fixed_dictionaries({}, optional={p.name: _values(p) for p in space.params}))
    preset = data.draw(st.sampled_from(cls.presets))
    plain = cls(preset, **overrides).resolve_params(data.draw(st.sampled_from(DATASETS)))
    s = cls.settings_class()._of(plain)
    assert s._asdict() == plain and json.dumps(s._asdict()) == json.dumps(plain)
    assert cls.settings_class()._of(json.loads(json.dumps(plain))) == s  # as model.json gives it back
    types = {"int": int, "float": float, "bool": bool, "str": str, "ints": tuple, "range": tuple, "any": object}
    for p in space.params:
        value = getattr(s, p.name)
        assert (value is None and p.optional) or isinstance(value, types[p.kind]), (p.name, value)


# ---------------------------------------------------------------------- params_ and settings_ on a model
def test_params_is_a_read_only_view_and_assigning_a_dict_sets_both() -> None:
    m = _bare("false-vfl-1")
    with pytest.raises(TypeError, match=r"false-vfl-1: params_ is read-only .* model.params_ = \{\*\*model.params_"):
        m.params_["epochs"] = 2
    for mutate in (lambda d: d.update(epochs=2), lambda d: d.pop("epochs"), lambda d: d.setdefault("x", 1)):
        with pytest.raises(TypeError):
            mutate(m.params_)
    with pytest.warns(DeprecationWarning, match="'kappa' is now called 'importance_samples'"):
        m.params_ = {**m.params_, "epochs": 2, "kappa": 3}  # an alias, as everywhere else
    assert m.settings_.epochs == 2 and m.params_["epochs"] == 2 and m.settings_.importance_samples == 3
    with pytest.raises(ValueError, match="unknown parameter 'epoch'"):
        m.params_ = {**m.params_, "epoch": 1}
    with pytest.raises(ValueError, match="missing parameter.s. d_h"):
        m.params_ = {k: v for k, v in m.params_.items() if k != "d_h"}
    for twin in (copy.copy(m.params_), copy.deepcopy(m.params_), pickle.loads(pickle.dumps(m.params_))):
        assert isinstance(twin, ParamsDict) and twin == m.params_
    assert type(dict(m.params_)) is dict and json.loads(json.dumps(m.params_)) == m.params_
    assert not hasattr(get_method("local")("fast"), "params_")  # set by fit or load


def test_a_plugin_that_lists_only_defaults_keeps_working() -> None:
    class Plugin(VFLMethod):
        name = "settings-plugin"

        @classmethod
        def default_params(cls) -> dict[str, Any]:
            return {"steps": 3, "widths": [1, 2], "lambda": 0.5}

        def _party_config(self, party: int) -> dict[str, Any]:
            return {}

        def _fit(self, view, handle, loop) -> None:
            pass

        def _predict(self, view, handle, rows) -> np.ndarray:
            return np.zeros(len(rows))

    m = Plugin("fast", steps="4")
    m.params_ = m.resolve_params(None)
    assert m.params_ == {"steps": "4", "widths": [1, 2], "lambda": 0.5, "standardize": True}  # 'any': as given
    assert (m.settings_.steps, m.settings_.widths, m.settings_.lambda_, m.settings_.standardize) == ("4", [1, 2],
                                                                                                     0.5, True)
    assert Plugin.param_space().params[0].kind == "any" and inferred_space({"a": 1}, {}).params[0].kind == "any"


def test_saved_models_give_back_the_same_params_and_settings(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 60)
    tables = {"a": pd.DataFrame({"uid": np.arange(60), "x": y + rng.normal(0, 0.3, 60), "label": y}),
              "b": pd.DataFrame({"uid": np.arange(60), "z": y * 0.5 + rng.normal(0, 0.3, 60)})}
    data = from_tables(tables, id_column="uid", label_column="label", active_party="a")
    fitted = get_method("vanilla-vfl")("fast", seed=1, epochs=2, latent_dim=4, encoder_hidden=[8]).fit(data)
    fitted.save(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "model.json").read_text())
    assert meta["params"] == fitted.params_
    loaded = VFLMethod.load(tmp_path / "m")
    assert loaded.params_ == fitted.params_ and list(loaded.params_) == list(fitted.params_)
    assert loaded.settings_ == fitted.settings_ and loaded.settings_.encoder_hidden == (8,)
    np.testing.assert_array_equal(loaded.predict_proba(data), fitted.predict_proba(data))
    # a parameter a later version no longer declares stays in params_ (model.json), but is no attribute
    old = method_from_meta(type(fitted), {**meta, "params": {**meta["params"], "retired": 7}}, tmp_path / "m")
    assert old.params_["retired"] == 7 and old.settings_ == fitted.settings_
    with pytest.raises(AttributeError, match="vanilla-vfl: no parameter 'retired'"):
        _ = old.settings_.retired


def test_every_builtin_method_is_covered() -> None:
    assert set(BUILTIN) <= set(method_names())
