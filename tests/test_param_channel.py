"""One parameter channel (issue 37, item 2): every knob a user sets is a declared, typed parameter (the method's, or
the privacy parameters every method takes) or a typed run option with its own flag; ``--param`` reaches only the
declared ones, read by their declared types; each value is checked once, where it enters; the fit lifecycle runs
outside ``VFLMethod`` and ``method.fit`` is a thin call into it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.base import clone

from helpers import make_data
from partialvfl.cli import build_parser
from partialvfl.cli.params import method_from_args
from partialvfl.methods import get_method, method_names
from partialvfl.methods import params as params_module
from partialvfl.methods.params import PRIVACY_PARAMS
from partialvfl.methods.run_options import RunOptions

ROOT = Path(__file__).resolve().parents[1]


def _fit_args(*param: str) -> object:
    argv = ["fit", "--dataset", "digits", "--method", "laser-vfl", "--out", "/nonexistent/m"]
    for p in param:
        argv += ["--param", p]
    return build_parser().parse_args(argv)


# ---------------------------------------------------------------------- run options: their own type and flags
@pytest.mark.parametrize(("given", "flag"), [
    ("device=cuda", "--device"), ("precision=bf16", "--precision"), ("compile=true", "--compile"),
    ("progress=epochs", "--quiet or --log-epochs"), ("seed=3", "--seed"), ("preset=paper", "--preset"),
    ("label-dp=1", "--label-dp"),
])
def test_a_run_option_given_through_param_is_refused_naming_its_flag(given: str, flag: str) -> None:
    with pytest.raises(ValueError) as e:
        method_from_args(_fit_args(given))
    text = str(e.value)
    key = given.split("=")[0].replace("-", "_")
    assert "\n" not in text and text.startswith(f"--param {key}: ") and text.endswith(f"use {flag}")


def test_run_options_are_one_typed_frozen_object() -> None:
    run = RunOptions(progress="epochs", device="cpu", precision="fp32", compile="no")
    assert run.compile is False and str(run.torch_device) == "cpu"
    with pytest.raises(AttributeError):
        run.device = "cuda"  # type: ignore[misc]
    with pytest.raises(ValueError, match="progress must be True, False or 'epochs', got 'often'"):
        RunOptions(progress="often")
    model = get_method("laser-vfl")("fast", device="cpu", precision="fp32", compile="yes", progress="epochs")
    assert model.run_options == RunOptions("epochs", "cpu", "fp32", True)
    assert (model.compile, model.progress, model.precision) == (True, "epochs", "fp32")


# ---------------------------------------------------------------------- privacy knobs: declared and typed
def test_label_dp_and_party_dp_options_are_declared_typed_parameters() -> None:
    kinds = {p.name: (p.kind, p.optional) for p in PRIVACY_PARAMS.params}
    assert kinds == {"label_dp": ("float", True), "label_dp_seed": ("int", True), "label_dp_prior": ("bool", False),
                     "label_dp_mechanism": ("str", True), "dp_clip": ("float", False),
                     "dp_grad_clip": ("float", False), "dp_predictions": ("int", False)}
    model = get_method("laser-vfl")("fast", label_dp="2", label_dp_seed="5", dp_clip="0.5", dp_grad_clip=2,
                                    dp_predictions="1")
    assert (model.label_dp, model.label_dp_seed) == (2.0, 5)
    assert model.dp_options == {"clip": 0.5, "grad_clip": 2.0, "predictions": 1}
    assert isinstance(model.dp_options["predictions"], int)
    for bad, name in [({"label_dp": 0}, "label_dp"), ({"dp_clip": -1}, "dp_clip"), ({"dp_predictions": 0},
                                                                                    "dp_predictions"),
                      ({"dp_grad_clip": "lots"}, "dp_grad_clip"), ({"label_dp_seed": 1.5}, "label_dp_seed")]:
        with pytest.raises(ValueError, match=f"laser-vfl: parameter {name} must be"):
            get_method("laser-vfl")("fast", **bad)
    with pytest.raises(ValueError, match="unknown parameter 'dp_options'"):  # the untyped dict is gone
        get_method("laser-vfl")("fast", dp_options={"predictions": 1})


def test_methods_lists_the_privacy_parameters(capsys: pytest.CaptureFixture) -> None:
    from partialvfl.cli import main

    assert main(["methods", "--method", "local"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  dp_predictions +2 +integer in \[1, inf\]: party DP", out, re.M)
    assert re.search(r"^  label_dp +null +number in \(0, inf\] or null: label DP", out, re.M)


@pytest.mark.parametrize(("text", "expected"), [("no", False), ("off", False), ("false", False), ("yes", True)])
def test_strings_from_the_command_line_parse_by_the_declared_type(text: str, expected: bool) -> None:
    model = method_from_args(_fit_args(f"label_dp_prior={text}", "dp_predictions=1", "dp-clip=0.5"))
    assert model.label_dp_prior is expected
    assert model.dp_options["predictions"] == 1 and model.dp_options["clip"] == 0.5


# ---------------------------------------------------------------------- scikit-learn: every knob
@pytest.mark.parametrize("name", sorted(set(method_names())))
def test_get_params_holds_every_knob_and_clone_round_trips_it(name: str) -> None:
    cls = get_method(name)
    bare = cls().get_params()
    assert set(cls.RUN_OPTIONS) | set(PRIVACY_PARAMS.names) <= set(bare), "every knob, given or not"
    assert set(cls.RUN_OPTIONS) == {"preset", "seed", *RunOptions.names()}
    model = cls("fast", seed=7, progress="epochs", compile=True, label_dp=1.5, label_dp_seed=3, label_dp_prior="no",
                dp_clip=0.25, dp_grad_clip=3.0, dp_predictions=4)
    copy = clone(model)
    assert copy.get_params() == model.get_params()
    assert copy.run_options == model.run_options and copy.seed == 7
    assert (copy.label_dp, copy.label_dp_seed, copy.label_dp_prior) == (1.5, 3, False)
    assert copy.dp_options == model.dp_options == {"clip": 0.25, "grad_clip": 3.0, "predictions": 4}
    copy.set_params(dp_predictions=1, device="cpu", label_dp=None)
    assert copy.dp_options["predictions"] == 1 and copy.label_dp is None and model.dp_options["predictions"] == 4


@settings(max_examples=25, deadline=None)
@given(clip=st.floats(0.01, 100), predictions=st.integers(1, 50), prior=st.booleans(),
       eps=st.none() | st.floats(0.01, 20))
def test_clone_keeps_any_privacy_setting(clip: float, predictions: int, prior: bool, eps: float | None) -> None:
    model = get_method("vanilla-vfl")("fast", dp_clip=clip, dp_predictions=predictions, label_dp_prior=prior,
                                      label_dp=eps)
    copy = clone(model)
    assert (copy.dp_options, copy.label_dp_prior, copy.label_dp) == (model.dp_options, prior, eps)


# ---------------------------------------------------------------------- each value checked once
def test_a_given_learning_rate_is_checked_once_from_construction_to_a_fitted_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``lr`` was checked three times (the constructor, ``ParamSpace.resolve`` and the typed settings)."""
    seen: list[object] = []
    check = params_module.Param.check

    def counting(self: params_module.Param, value: object, where: str = "") -> object:
        if self.name == "lr" and value == 0.0123:
            seen.append(value)
        return check(self, value, where)

    monkeypatch.setattr(params_module.Param, "check", counting)
    model = get_method("vanilla-vfl")("fast", seed=0, lr=0.0123, epochs=1).fit(make_data(40, 0, "u"))
    assert model.settings_.lr == 0.0123 and model.params_["lr"] == 0.0123
    assert len(seen) == 1, f"lr checked {len(seen)} times"


# ---------------------------------------------------------------------- the lifecycle outside the estimator
def test_method_fit_is_the_lifecycles_fit() -> None:
    from partialvfl.methods import lifecycle

    data = make_data(40, 1, "v")
    a = get_method("vanilla-vfl")("fast", seed=2, epochs=2).fit(data)
    b = lifecycle.fit(get_method("vanilla-vfl")("fast", seed=2, epochs=2), data)
    np.testing.assert_array_equal(a.predict_proba(data), b.predict_proba(data))
    assert a.history_ == b.history_ and a.params_ == b.params_


def test_the_estimator_module_stays_within_500_lines() -> None:
    lines = (ROOT / "src" / "partialvfl" / "methods" / "base.py").read_text().count("\n")
    assert lines <= 500, f"methods/base.py has {lines} lines"


# ---------------------------------------------------------------------- the seed: a declared parameter
@pytest.mark.parametrize("bad", [1.5, 2.0, True, "3", -1, None])
def test_a_seed_that_is_not_an_integer_at_least_0_is_refused_naming_it(bad: object) -> None:
    """Before: ``int(seed)`` silently truncated 1.5 to 1 and read True as 1."""
    with pytest.raises(ValueError, match=r"^laser-vfl: parameter seed must be integer in \[0, inf\], got "):
        get_method("laser-vfl")("fast", seed=bad)
    model = get_method("laser-vfl")("fast", seed=4)
    with pytest.raises(ValueError, match="parameter seed must be"):
        model.set_params(seed=bad)
    assert model.seed == 4 and model.get_params()["seed"] == 4  # nothing changed


def test_the_seed_is_declared_once_and_clone_keeps_it_as_given() -> None:
    assert params_module.SEED.kind == "int" and params_module.SEED.low == 0 and params_module.SEED.default == 0
    seed = np.int64(9)  # numpy's integers are integers
    model = get_method("vanilla-vfl")("fast", seed=seed)
    assert model.seed == 9 and type(model.seed) is int
    assert model.get_params()["seed"] is seed  # as given: scikit-learn's clone checks identity
    copy = clone(model)
    assert copy.seed == 9 and copy.get_params() == model.get_params()
    assert copy.set_params(seed=3).seed == 3 and model.seed == 9


@pytest.mark.parametrize(("text", "expected"), [("7", 7), ("0", 0), ("1.5", None), ("-1", None), ("x", None)])
def test_the_seed_flag_is_read_by_the_declared_type(text: str, expected: int | None,
                                                    capsys: pytest.CaptureFixture) -> None:
    argv = ["fit", "--dataset", "digits", "--method", "laser-vfl", "--out", "/nonexistent/m", "--seed", text]
    if expected is None:
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        err = capsys.readouterr().err
        assert f"argument --seed: parameter seed must be integer in [0, inf], got '{text}'" in err, err
    else:
        assert method_from_args(build_parser().parse_args(argv)).seed == expected
