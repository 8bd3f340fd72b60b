"""Typed party set-up configs (issue 37, item 3): every package party program declares its set-up config (keys,
types, ranges); the party reads it once on arrival and refuses a wrong type, an out-of-range value, an unknown or a
missing key in one line naming the party, the program, the key and the value; the coordinators send exactly what the
declarations admit; and no party module casts a config value (an AST check, so that it stays true).

A real party process refusing a malformed config: tests/test_party_hardening.py (its deployment is already up)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partialvfl import Task
from partialvfl.federation import LocalFederation, PartyRuntime, Request
from partialvfl.federation.runtime.coordinator import SetupRefused
from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.federation.wire.program import PROGRAMS, PartyProgram
from partialvfl.federation.wire.schema import MessageError
from partialvfl.federation.wire.setup_config import SetupConfig, SetupConfigError
from partialvfl.methods import get_method, load_all, method_names
from partialvfl.methods.model_files import IndexInfo

load_all()
SRC = Path(__file__).resolve().parents[1] / "src"
DIMS = (6, 4)  # two parties, 6 and 4 features


def package_programs() -> dict[str, type[PartyProgram]]:
    return {n: c for n, c in PROGRAMS.items() if c.__module__.startswith("partialvfl.")}


def method_configs(name: str, preset: str = "fast", dims: tuple[int, ...] = DIMS, **params: Any
                   ) -> list[dict[str, Any]]:
    """The set-up configs a fit of method ``name`` sends its parties (the research policy: nothing narrowed)."""
    m = get_method(name)(preset, seed=0, **params)
    m.index_ = IndexInfo(Task.classification([0, 1, 2]), tuple(f"p{k}" for k in range(len(dims))), dims,
                         tuple((d,) for d in dims), 0)
    m.params_ = m.resolve_params(None)
    announced = [PartyPolicy.research().announced()] * len(dims)
    m._plan(SimpleNamespace(announced_policies=lambda: announced))
    return [m._party_config(k) for k in range(len(dims))]


def valid_config(program: str) -> dict[str, Any]:
    """A config party 0 (6 features) accepts, as a method using ``program`` sends it."""
    name = next(m for m in sorted(method_names()) if get_method(m).party_program == program)
    return method_configs(name)[0]


def setup(rt: PartyRuntime, program: str, config: Any) -> None:
    rt.handle(Request("setup", {}, {"program": program, "config": config, "seed": 0}))


def changed(config: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """``config`` with the dotted ``key`` set to ``value`` (``...``: removed)."""
    out = json.loads(json.dumps(config))
    *path, last = key.split(".")
    inner = out
    for part in path:
        inner = inner[part]
    if value is ...:
        del inner[last]
    else:
        inner[last] = value
    return out


# ---------------------------------------------------------------------- the declarations
def test_every_package_program_declares_its_setup_config() -> None:
    programs = package_programs()
    assert set(programs) == {"false-vfl/party", "splitnn/party", "x-vfl/party", "fedhssl/party"}
    for name, cls in programs.items():
        assert isinstance(cls.setup_config, type) and issubclass(cls.setup_config, SetupConfig), name


@pytest.mark.parametrize("name", sorted(method_names()))
@pytest.mark.parametrize("preset", ["fast", "paper"])
def test_every_methods_party_configs_are_what_its_programs_declaration_admits(name: str, preset: str) -> None:
    """What the coordinator sends reads back as the same typed object, over JSON too (the wire), and is exactly
    that object's wire form: the coordinator built it with the same declaration."""
    cls = PROGRAMS[get_method(name).party_program]
    for config in method_configs(name, preset):
        typed = cls.read_config(json.loads(json.dumps(config)))
        assert isinstance(typed, cls.setup_config)
        assert typed.to_wire() == config
        assert cls.read_config(config) == typed


#: (method, parameter) of every numeric parameter a user may set
NUMERIC = [(name, p.name) for name in sorted(method_names()) for p in get_method(name).param_space().params
           if p.kind in ("int", "float") and not p.optional]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(NUMERIC), st.data())
def test_any_value_a_user_may_give_a_sent_parameter_passes_the_partys_declaration(case: tuple[str, str],
                                                                                    data: st.DataObject) -> None:
    """The parties' declarations are no narrower than the methods' declared parameters: a value within a
    parameter's range (its bounds included) reaches the party and is accepted."""
    name, param = case
    p = get_method(name).param_space().param(param)
    low = p.low if p.low is not None else -1e3
    high = p.high if p.high is not None else low + 1e3
    value = (data.draw(st.integers(int(math.ceil(low)), int(min(high, low + 64)))) if p.kind == "int"
             else data.draw(st.floats(low, high, allow_nan=False)))
    cls = PROGRAMS[get_method(name).party_program]
    for config in method_configs(name, **{param: value}):
        cls.read_config(json.loads(json.dumps(config)))


# ---------------------------------------------------------------------- refusals
#: (program, key, value): each refused by the declaration, naming the key and the value
REFUSED = [
    ("splitnn/party", "latent_dim", "wide"),  # a string for an integer
    ("splitnn/party", "latent_dim", 0),  # under its range
    ("splitnn/party", "latent_dim", 4.0),  # a number that is not an integer
    ("splitnn/party", "latent_dim", True),  # a boolean is not an integer
    ("splitnn/party", "encoder", "transformer"),  # not one of its choices
    ("splitnn/party", "encoder_hidden", [8, -1]),  # an element out of range
    ("splitnn/party", "encoder_hidden", "8,8"),  # a string for a list
    ("splitnn/party", "optimizer.lr", -0.1),  # a nested key out of range
    ("splitnn/party", "optimizer.weight_decay", -1.0),  # torch refuses it too; the declaration says why first
    ("splitnn/party", "optimizer.name", "lbfgs"),
    ("splitnn/party", "optimizer", "adam"),  # a string for an object
    ("splitnn/party", "feature_dim", 7),  # disagrees with feature_shape [6]
    ("false-vfl/party", "variant", 3),
    ("false-vfl/party", "d_h", "32"),  # JSON carries numbers as numbers: "32" is text
    ("false-vfl/party", "pretrain_lr", float("nan")),
    ("false-vfl/party", "encoder_logvar_range", [6.0, -8.0]),  # a clamp whose low is over its high
    ("false-vfl/party", "decoder_logvar_range", [-5.0]),  # not a pair
    ("false-vfl/party", "wire", "auto"),  # the coordinator resolves auto; a party runs one wire
    ("false-vfl/party", "latent_scale_floor", -1.0),
    ("x-vfl/party", "estimator", "adam"),
    ("x-vfl/party", "optimizer.momentum", 1.5),
    ("fedhssl/party", "pool_ratio", 1.5),
    ("fedhssl/party", "simsiam.proj_dim", 0),
]


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and "Traceback" not in text, text
    return text


@pytest.mark.parametrize(("program", "key", "value"), REFUSED, ids=[f"{p}:{k}={v!r}" for p, k, v in REFUSED])
def test_a_party_refuses_a_wrong_type_or_out_of_range_value_naming_program_key_and_value(program: str, key: str,
                                                                                         value: Any) -> None:
    rt = PartyRuntime(0, "bank", policy=PartyPolicy.research(), feature_shape=(6,))
    with pytest.raises(SetupConfigError) as e:
        setup(rt, program, changed(valid_config(program), key, value))
    text = _one_line(e.value)
    assert text.startswith(f"party 0 ('bank'), program {program!r}: setup config "), text
    assert f"key {key!r}" in text and repr(value) in text, text
    assert e.value.key == key
    assert rt.program is None  # nothing was built


@pytest.mark.parametrize("program", sorted(package_programs()))
def test_a_party_refuses_an_unknown_or_a_missing_key_naming_it(program: str) -> None:
    rt = PartyRuntime(0, "bank", policy=PartyPolicy.research(), feature_shape=(6,))
    with pytest.raises(SetupConfigError, match=r"setup config has unknown key 'latent_width'; the program reads "):
        setup(rt, program, changed(valid_config(program), "latent_width", 8))
    required = [f.name for f in dataclasses.fields(PROGRAMS[program].setup_config)
                if f.default is dataclasses.MISSING]
    assert required
    for key in required:
        with pytest.raises(SetupConfigError, match=rf"setup config lacks key '{key}' \("):
            setup(rt, program, changed(valid_config(program), key, ...))
    with pytest.raises(MessageError, match=r"built-in, kind 'setup', request: meta key 'config' must be an object, "
                                           r"got \[1, 2\]"):  # the setup message's declaration types its config
        setup(rt, program, [1, 2])
    with pytest.raises(SetupConfigError, match=r"setup config must be an object, got list"):
        PROGRAMS[program].read_config([1, 2])  # type: ignore[arg-type]
    assert rt.program is None
    setup(rt, program, valid_config(program))  # and the party still sets up a good one
    assert isinstance(rt.program.config, PROGRAMS[program].setup_config)


def test_the_in_process_federation_gathers_every_partys_refusal_naming_the_key() -> None:
    fed = LocalFederation(["bank", "shop"], 0)
    good = method_configs("laser-vfl")
    bad = [changed(good[0], "optimizer.lr", "fast"), changed(good[1], "models", "f")]
    with pytest.raises(SetupRefused) as e:
        fed.setup("splitnn/party", bad, seed=0)
    text = str(e.value)
    assert "2 of 2 parties refused to set up 'splitnn/party'" in text
    assert "party 0 ('bank'): " in text and "party 1 ('shop'): " in text, text
    assert "program 'splitnn/party': setup config key 'optimizer.lr' must be a number >= 0, got 'fast'" in text, text
    assert "key 'models' must be a list of texts, got 'f'" in text, text
    fed.setup("splitnn/party", good, seed=0)  # the same parties take a good config
    assert [rt.program.config.latent_dim for rt in fed.runtimes] == [good[0]["latent_dim"]] * 2


def test_the_policy_describes_the_typed_config_the_party_read() -> None:
    """The policy's check reads the program's typed config (``describe_setup``), the one the program is built from;
    a plain dict handed to the policy directly is read by the same declaration."""
    cls = PROGRAMS["splitnn/party"]
    config = method_configs("laser-vfl", dims=(16, 16), latent_dim=8)[0]  # within the default policy
    typed = cls.read_config(config)
    shape = PartyPolicy.default().check_setup("splitnn/party", typed, registered=PROGRAMS, n_features=16)
    assert shape == PartyPolicy.default().check_setup("splitnn/party", config, registered=PROGRAMS, n_features=16)
    assert shape is not None and shape.learning_rates == {"optimizer.lr": typed.optimizer.lr}
    with pytest.raises(SetupConfigError, match="key 'latent_dim' must be an integer >= 1, got -3"):
        PartyPolicy.default().check_setup("splitnn/party", changed(config, "latent_dim", -3), registered=PROGRAMS)


@settings(max_examples=40, deadline=None)
@given(latent=st.integers(1, 512), hidden=st.lists(st.integers(1, 512), max_size=4),
       lr=st.floats(0, 10, allow_nan=False), momentum=st.floats(0, 1), name=st.sampled_from(["adam", "sgd"]),
       shape=st.lists(st.integers(1, 9), min_size=1, max_size=3))
def test_a_typed_config_travels_as_json_and_reads_back_equal(latent: int, hidden: list[int], lr: float,
                                                              momentum: float, name: str, shape: list[int]) -> None:
    from partialvfl.federation.wire.setup_config import OptimiserSetup
    from partialvfl.methods.splitnn.party import SplitSetup

    typed = SplitSetup(feature_shape=shape, models=("f", "g"), latent_dim=latent, encoder_hidden=hidden,
                       optimizer=OptimiserSetup(name=name, lr=lr, momentum=momentum))
    assert typed.feature_dim == math.prod(shape) and typed.encoder_hidden == tuple(hidden)
    wire = json.loads(json.dumps(typed.to_wire()))
    assert SplitSetup.read(wire) == typed


# ---------------------------------------------------------------------- no casts of a config value
_CASTS = {"int", "float", "bool", "str"}


def party_modules() -> list[Path]:
    """The modules of the package's party programs, the modules of their own family package they import, and the
    federation modules that read a program's config (its description, the runtime)."""
    federation = SRC / "partialvfl" / "federation"
    files = {federation / "wire" / "setup_shape.py", federation / "wire" / "program.py",
             federation / "runtime" / "party.py"}
    for cls in package_programs().values():
        module = sys.modules[cls.__module__]
        package = cls.__module__.rsplit(".", 1)[0]
        files.add(Path(module.__file__))
        for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package + "."):
                files.add(Path(importlib.import_module(node.module).__file__))
    return sorted(files)


def _mentions(node: ast.AST, tainted: set[str], program_class: bool) -> bool:
    """Whether ``node`` reads the program's set-up config: ``config``, ``self.config`` in a party program class,
    ``program.config``, or a name bound from one of those."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and (sub.id in tainted or sub.id == "config"):
            return True
        if isinstance(sub, ast.Attribute) and sub.attr == "config" and isinstance(sub.value, ast.Name) \
                and (sub.value.id == "program" or (sub.value.id == "self" and program_class)):
            return True
    return False


def _mentions_meta(node: ast.AST, tainted: set[str], program_class: bool) -> bool:
    """Whether ``node`` is a request's metadata value: ``meta``, ``req.meta``, ``request.meta``,
    ``wire.request.meta``, a name bound from one of those, an item of one (``[...]``, ``.get(...)``), or ``a or b``
    / ``a if c else b`` of such values (not what a call computes from one: a path, a view of the data it names)."""
    if isinstance(node, ast.Name):
        return node.id in tainted or node.id == "meta"
    if isinstance(node, ast.Attribute) and node.attr == "meta":
        return (isinstance(node.value, ast.Name) and node.value.id in ("req", "request")) \
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "request")
    if isinstance(node, ast.Subscript):
        return _mentions_meta(node.value, tainted, program_class)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return _mentions_meta(node.func.value, tainted, program_class)
    if isinstance(node, ast.BoolOp):
        return any(_mentions_meta(v, tainted, program_class) for v in node.values)
    if isinstance(node, ast.IfExp):
        return any(_mentions_meta(v, tainted, program_class) for v in (node.body, node.orelse))
    return False


def _names(target: ast.AST) -> set[str]:
    """The names a target binds (``a``, ``a, b``; not the object of ``self.a = ...``)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Tuple | ast.List):
        return set().union(*(_names(t) for t in target.elts))
    return set()


def _casts(source: str, mentions: Any) -> list[tuple[int, str]]:
    """``(line, code)`` of every ``int()``/``float()``/``bool()``/``str()`` of a value ``mentions`` reads, or of a
    name bound from one (in the same function), in ``source``."""
    tree = ast.parse(source)
    found = []

    def scan(scope: ast.AST, program_class: bool) -> None:
        tainted: set[str] = set()
        body = [n for n in ast.walk(scope) if not isinstance(n, ast.ClassDef) or n is scope]
        for _ in range(3):  # names bound from names bound from the value
            for node in body:
                if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                    for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        pairs = (zip(t.elts, node.value.elts) if isinstance(t, ast.Tuple) and isinstance(
                            node.value, ast.Tuple) and len(t.elts) == len(node.value.elts) else [(t, node.value)])
                        for target, value in pairs:  # a, b = x, y: a from x, b from y
                            if mentions(value, tainted, program_class):
                                tainted |= _names(target)
                elif isinstance(node, ast.For | ast.comprehension) and mentions(node.iter, tainted, program_class):
                    tainted |= _names(node.target)
        for node in body:
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CASTS \
                    and any(mentions(a, tainted, program_class) for a in node.args):
                found.append((node.lineno, ast.unparse(node)))

    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            cls = next((c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and node in c.body), None)
            program = cls is not None and any(isinstance(s, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "program_name" for t in s.targets) for s in cls.body)
            scan(node, program)
    return sorted(set(found))


def config_casts(source: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every ``int()``/``float()``/``bool()``/``str()`` of a config value in ``source``."""
    return _casts(source, _mentions)


def meta_casts(source: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every ``int()``/``float()``/``bool()``/``str()`` of a request's metadata value in
    ``source``."""
    return _casts(source, _mentions_meta)


def test_the_cast_check_finds_the_casts_it_is_for() -> None:
    source = '''
class P:
    program_name = "p"
    def __init__(self, runtime, config, seed):
        self.d = int(config["d_h"])
        opt = config["optimizer"]
        lr = float(opt["lr"])
        shape = tuple(int(s) for s in config["feature_shape"])
    def on_k(self, req):
        return int(self.config["d_h"]) + int(req.meta["samples"])
def private(program):
    return str(program.config.get("wire"))
'''
    assert [code for _, code in config_casts(source)] == [
        "int(config['d_h'])", "float(opt['lr'])", "int(s)", "int(self.config['d_h'])",
        "str(program.config.get('wire'))"]


def test_no_party_module_casts_a_config_value() -> None:
    """The programs read typed attributes of their declared config; an ``int()``/``float()``/``bool()``/``str()``
    of a config value means a value the declaration does not type."""
    modules = party_modules()
    assert len(modules) >= 8, modules
    casts = {str(p.relative_to(SRC)): config_casts(p.read_text()) for p in modules}
    assert not {p: c for p, c in casts.items() if c}, casts


# ---------------------------------------------------------------------- no casts of a metadata value
def meta_modules() -> list[Path]:
    """The party modules, and the server's modules whose built-in handlers read a request's metadata."""
    federation = SRC / "partialvfl" / "federation"
    return sorted({*party_modules(), federation / "grpc" / "party.py", federation / "grpc" / "party_tables.py",
                   federation / "trust" / "psu.py"})


def test_the_meta_cast_check_finds_the_casts_it_is_for() -> None:
    source = '''
class P:
    program_name = "p"
    def shared(self, meta, d):
        return noise(int(meta["noise_seed"]), (int(meta["samples"]), d))
    def on_k(self, req):
        t, meta = req.tensors, req.meta
        n = int(t["rows"].shape[0])
        train = bool(req.meta.get("train", False))
        hidden = [int(h) for h in req.meta["top_hidden"]]
        view = self.data(req.meta["data"])
        rows = int(view.n_observed)
        handle = req.meta.get("data") or "train"
        return str(handle), float(request.meta["lr"]), str(wire.request.meta["dir"])
'''
    assert [code for _, code in meta_casts(source)] == [
        "int(meta['noise_seed'])", "int(meta['samples'])", "bool(req.meta.get('train', False))", "int(h)",
        "float(request.meta['lr'])", "str(handle)", "str(wire.request.meta['dir'])"]


def test_no_party_module_casts_a_metadata_value() -> None:
    """The handlers read the typed values their message declarations give (:mod:`.meta_keys`); an ``int()``/
    ``float()``/``bool()``/``str()`` of a metadata value means a value the declaration does not type (33 on the
    code before the declarations typed their keys)."""
    modules = meta_modules()
    assert len(modules) >= 11, modules
    casts = {str(p.relative_to(SRC)): meta_casts(p.read_text()) for p in modules}
    assert not {p: c for p, c in casts.items() if c}, casts
