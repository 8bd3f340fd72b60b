"""The privacy mechanism interface (issue 37, item 4): every mechanism the package ships is declared once, its
accounting hook agrees with the accountant the fit uses, and a new mechanism is one module plus a declaration,
listed by the registry and by ``partialvfl mechanisms`` with no edit elsewhere."""

from __future__ import annotations

import importlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import partialvfl.methods.label_dp as label_dp
from partialvfl.cli import main
from partialvfl.federation.dp import gaussian
from partialvfl.federation.dp.mechanism import (
    MechanismParam,
    PrivacyMechanism,
    get_mechanism,
    load_mechanisms,
    mechanism_epsilon,
    mechanisms,
    register_mechanism,
    unregister_mechanism,
)
from partialvfl.methods.params import PRIVACY_PARAMS

PACKAGE = {"gaussian": "partialvfl.federation.dp.gaussian", "randomized-response": "partialvfl.methods.label_dp",
           "rr-with-prior": "partialvfl.methods.label_dp"}

TOY_MODULE = '''
from partialvfl.federation.dp.mechanism import MechanismParam, PrivacyMechanism, register_mechanism


def _event(params):
    import dp_accounting as dpa

    return dpa.GaussianDpEvent(noise_multiplier=float(params["scale"]))


TOY = register_mechanism(PrivacyMechanism(
    name="toy-noise", where="release", summary="a toy Gaussian noise on every release",
    params=(MechanismParam("scale", "float", 1.0, "the noise scale over the sensitivity"),), dp_event=_event,
), __name__)
'''


def _names() -> list[str]:
    return [m.name for m in mechanisms()]


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PrivacyMechanism]:
    """A mechanism in its own module (written here, imported from ``sys.path``), forgotten afterwards."""
    load_mechanisms()
    before = _names()
    (tmp_path / "toy_privacy_mechanism.py").write_text(TOY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("toy_privacy_mechanism")
    yield module.TOY
    unregister_mechanism("toy-noise")
    sys.modules.pop("toy_privacy_mechanism", None)
    assert _names() == before  # the registry is left as it was


def test_every_package_mechanism_is_declared_once_where_it_lives() -> None:
    load_mechanisms()
    names = _names()
    assert len(names) == len(set(names))
    shipped = {m.name: m.module for m in mechanisms() if m.module.startswith("partialvfl.")}
    assert shipped == PACKAGE
    assert {m.name for m in mechanisms("label")} >= {"randomized-response", "rr-with-prior"}
    assert get_mechanism("gaussian") is gaussian.GAUSSIAN and get_mechanism("rr-with-prior") is label_dp.RR_WITH_PRIOR
    with pytest.raises(ValueError, match="'gaussian' is declared twice"):
        register_mechanism(gaussian.GAUSSIAN)
    assert _names() == names


def test_declared_parameters_are_the_ones_users_set() -> None:
    """The label mechanisms' and the Gaussian mechanism's coordinator-side parameters are the declared method
    parameters, with the same defaults; the Gaussian's budget is the party policy's dp_epsilon/dp_delta."""
    for m in (label_dp.RANDOMIZED_RESPONSE, label_dp.RR_WITH_PRIOR, gaussian.GAUSSIAN):
        for p in m.params:
            if p.name in ("dp_epsilon", "dp_delta"):
                continue
            assert p.default == PRIVACY_PARAMS.param(p.name).default, (m.name, p.name)
    assert label_dp.RANDOMIZED_RESPONSE.label == "randomized response"  # the fit's report, as before
    assert label_dp.RR_WITH_PRIOR.label == "randomized response with a prior (two stages)"


@pytest.mark.parametrize(("z", "count", "delta"), [(3.0, 13, 1e-5), (1.0, 1, 1e-6), (8.0, 40, 1e-5)])
def test_the_gaussian_hook_agrees_with_the_party_ledger(z: float, count: int, delta: float) -> None:
    by_hook = mechanism_epsilon(gaussian.GAUSSIAN, {"noise_multiplier": z}, delta, count)
    assert by_hook == pytest.approx(gaussian.gaussian_epsilon(math.sqrt(count) / z, delta), rel=1e-3)


@pytest.mark.parametrize(("eps", "k"), [(1.0, 2), (0.5, 10), (4.0, 3)])
def test_the_label_hooks_have_exactly_their_epsilon(eps: float, k: int) -> None:
    for m in (label_dp.RANDOMIZED_RESPONSE, label_dp.RR_WITH_PRIOR):
        assert mechanism_epsilon(m, {"label_dp": eps, "n_classes": k}) == pytest.approx(eps, abs=1e-3)


def test_a_new_mechanism_is_one_module_and_a_declaration(toy: PrivacyMechanism,
                                                         capsys: pytest.CaptureFixture) -> None:
    assert get_mechanism("toy-noise") is toy and toy.module == "toy_privacy_mechanism"
    assert toy in mechanisms("release") and toy not in mechanisms("label")
    # noise 2 against a replace-one sensitivity of 2: one Gaussian mechanism of mu = 1
    assert mechanism_epsilon(toy, {"scale": 2.0}, 1e-5) == pytest.approx(gaussian.gaussian_epsilon(1.0, 1e-5), rel=1e-3)
    assert main(["mechanisms"]) == 0
    out = capsys.readouterr().out
    assert "toy-noise (release): a toy Gaussian noise on every release" in out
    assert "scale (float, default 1.0): the noise scale over the sensitivity" in out
    assert "gaussian (release)" in out and "randomized-response (label)" in out
    assert main(["mechanisms", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert set(listed) >= {"toy-noise", *PACKAGE}
    assert listed["toy-noise"]["params"] == [{"name": "scale", "type": "float", "default": 1.0,
                                                "help": "the noise scale over the sensitivity"}]


def test_bad_declarations_and_unknown_names_are_refused_in_words() -> None:
    def event(params: object) -> None:
        return None

    with pytest.raises(ValueError, match="where must be one of"):
        PrivacyMechanism("x", "party", "s", (), event)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="declares a parameter twice"):
        PrivacyMechanism("x", "label", "s", (MechanismParam("a", "int", 1, "h"),) * 2, event)
    with pytest.raises(ValueError, match="no privacy mechanism 'nope'; declared: .*gaussian"):
        get_mechanism("nope")
