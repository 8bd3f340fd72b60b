"""Adding a method is one new family folder and no edit elsewhere (issue 37, item 1).

The test writes a toy family (a declaration and an implementation) as an installed plugin would ship it: a package
on ``sys.path`` with an entry point in the ``partialvfl.methods`` group naming its ``spec`` module. Without any edit
of the package, the method is listed by ``partialvfl methods``, its parameters are validated, and it fits, predicts,
saves and loads in process. The registry is left as it was found (other modules list the package's methods).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import partialvfl
from helpers import make_data
from partialvfl.cli import main
from partialvfl.methods.registry import ENTRY_POINT_GROUP, SPECS, get_method, load_specs, method_names, unregister

TOY = "toy-local"

SPEC = '''
"""Toy local: the label holder's own encoder and a linear head (declaration, torch-free)."""

from partialvfl.methods.registry import MethodSpec, register_spec
from partialvfl.methods.splitnn.spec import split_space

register_spec(MethodSpec("toy-local", "Toy local: the label holder's encoder and a linear head, nothing else",
                         "toy_family.method:ToyLocal", split_space("toy-local"), title="Toy local",
                         report_order=65, docs="toy_family/README.md"))
'''

METHOD = '''
"""Toy local: the active party's encoder (the split-network party program) and a linear head."""

from torch import nn

from partialvfl.methods.registry import get_spec
from partialvfl.methods.splitnn.local import Local


class ToyLocal(Local):
    """Local's training rows and prediction, a linear head of its own."""

    name = "toy-local"
    params = get_spec("toy-local").params

    def _build_heads(self):
        return nn.ModuleDict({"g": nn.Linear(self.settings_.latent_dim, self.index_.task.n_classes)})
'''


def write_plugin(root: Path) -> Path:
    """The toy family as an installed distribution: the package folder and its ``dist-info`` entry point."""
    family = root / "toy_family"
    family.mkdir(parents=True)
    (family / "__init__.py").write_text('"""A toy method family (a plugin)."""\n')
    (family / "spec.py").write_text(textwrap.dedent(SPEC))
    (family / "method.py").write_text(textwrap.dedent(METHOD))
    (family / "README.md").write_text("# Toy local\n\nThe label holder's encoder and a linear head.\n")
    info = root / "toy_family-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-family\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ntoy = toy_family.spec\n")
    return root


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The toy family on ``sys.path`` and discovered; afterwards the registry and ``sys.modules`` as before."""
    before = dict(SPECS)
    root = write_plugin(tmp_path / "site")
    monkeypatch.syspath_prepend(str(root))
    try:
        load_specs(plugins=True)
        yield root
    finally:
        unregister(TOY)
        for name in [m for m in sys.modules if m == "toy_family" or m.startswith("toy_family.")]:
            del sys.modules[name]
        assert before == SPECS


def test_a_plugin_family_is_listed_by_partialvfl_methods_in_a_fresh_process(tmp_path: Path) -> None:
    root = write_plugin(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "partialvfl", "methods", "--json"], env=env, capture_output=True,
                         text=True, check=True, timeout=300).stdout
    rows = {r["name"]: r for r in json.loads(out)}
    assert TOY in rows and "laser-vfl" in rows
    assert rows[TOY]["title"] == "Toy local" and rows[TOY]["docs"] == "toy_family/README.md"
    assert {"latent_dim", "epochs", "standardize"} <= {p["name"] for p in rows[TOY]["params"]}
    assert TOY not in method_names()  # this process never saw the plugin


def test_a_plugin_method_validates_its_parameters_fits_predicts_and_loads(plugin: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    assert TOY in method_names()
    assert main(["methods", "--method", TOY]) == 0
    assert capsys.readouterr().out.splitlines()[2].startswith(f"{TOY}: Toy local:")
    cls = get_method(TOY)
    assert cls.__module__ == "toy_family.method"
    with pytest.raises(ValueError, match="latent_dim"):
        cls("fast", latent_dim=0)
    with pytest.raises(ValueError, match="no_such_knob"):
        cls("fast", no_such_knob=1)

    train, test = make_data(48, seed=0, prefix="tr"), make_data(24, seed=1, prefix="te")
    model = cls("fast", seed=3, latent_dim=4, encoder_hidden=[8], epochs=3, batch_size=16).fit(train)
    proba = model.predict_proba(test)
    assert proba.shape == (test.n_samples, 3)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-6)
    again = cls("fast", seed=3, latent_dim=4, encoder_hidden=[8], epochs=3, batch_size=16).fit(train)
    np.testing.assert_array_equal(again.predict_proba(test), proba)  # seeded: the same model

    model.save(tmp_path / "model")
    saved = " ".join(p.read_text(errors="replace") for p in (tmp_path / "model").rglob("*.json"))
    assert TOY in saved and "toy_family" not in saved  # a model file names its method, never a module path
    from partialvfl.methods.base import VFLMethod

    loaded = VFLMethod.load(tmp_path / "model")  # the model file names the method; the registry finds the plugin
    assert type(loaded) is cls
    np.testing.assert_array_equal(loaded.predict_proba(test), proba)


def test_a_package_class_is_declared_once_by_its_spec() -> None:
    """The registry holds one declaration per method: every package method's class is found from its spec, carries
    the declared name, and no implementation module registers a class of its own."""
    src = Path(partialvfl.__file__).parent
    offenders = [p.relative_to(src).as_posix() for p in src.rglob("*.py")
                 if "@register_method" in p.read_text() or "register_method(" in p.read_text()]
    assert offenders == []
    for name, spec in load_specs().items():
        if spec.implementation.startswith("partialvfl."):
            assert get_method(name).name == name
            family = spec.implementation.split(":")[0].rsplit(".", 1)[0]
            assert family.startswith("partialvfl.methods.") and family.count(".") == 2, \
                f"{name}: implemented in {family}, not in a family folder of partialvfl.methods"


def test_schedules_reports_and_privacy_errors_read_a_methods_declaration() -> None:
    """What schedules, reports and privacy errors know of a method comes from its declaration alone."""
    from partialvfl.bench.naming import is_false_vfl, method_key, method_title
    from partialvfl.methods.private_fit import private_methods_text
    from partialvfl.methods.registry import MethodSpec, register_spec
    from partialvfl.methods.schedule import schedule_rows
    from partialvfl.methods.x_vfl.spec import XVFL_PARAMS

    space = XVFL_PARAMS  # its batch_size may be null: the method derives one at fit time
    spec = MethodSpec("toy-facts", "a declaration only", "toy_facts:Nothing", space, title="Toy Facts",
                      report_order=15, aligned_only=True, unset_batch_size=7, private=True, proposed=True)
    register_spec(spec)
    try:
        rows = schedule_rows("toy-facts", "fast", 100, aligned_share=0.2, overrides={"batch_size": None,
                                                                                     "early_stopping": "off"})
        assert rows["rows_are"] == "aligned" and rows["rows"] == 20 and rows["batch_size"] == 7
        assert rows["steps_per_epoch"] == 3
        assert method_title("toy-facts", "toy-facts") == "Toy Facts"
        assert method_key("vanilla-vfl", "a") < method_key("toy-facts", "a") < method_key("laser-vfl", "a")
        assert is_false_vfl("toy-facts") and not is_false_vfl("laser-vfl")
        assert "toy-facts" in private_methods_text() and "x-vfl" not in private_methods_text()
    finally:
        unregister("toy-facts")
    assert "toy-facts" not in method_names()


def test_no_module_outside_a_family_folder_names_a_method() -> None:
    """Method names appear as string values only in their family folders (``methods/<family>/``) and as the
    default of ``fit`` and of the scikit-learn estimators (``registry.DEFAULT_METHOD``); docstrings may name them.
    (``local`` is also an ordinary word: an executor, a prediction mode.)"""
    import ast

    src = Path(partialvfl.__file__).parent
    names = set(load_specs()) - {"local"}
    found = []
    for path in src.rglob("*.py"):
        rel = path.relative_to(src).as_posix()
        if (rel.startswith("methods/") and rel.count("/") == 2) or rel == "methods/registry.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        found += [f"{rel}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and n.value in names and id(n) not in docstrings]
    assert found == []
