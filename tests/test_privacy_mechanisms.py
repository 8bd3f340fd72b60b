"""The privacy mechanism interface (issue 37, item 4): every mechanism the package ships is declared once, its
accounting hook agrees with the accountant the fit uses, and a new mechanism is one module plus a declaration,
listed by the registry and by ``partialvfl mechanisms`` and **run** by the fit with no edit elsewhere: a label
mechanism by ``label_dp_mechanism`` (its own parameters through the one parameter channel), a release mechanism by
a party's ``[policy] dp_mechanism``."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import partialvfl.methods.label_dp as label_dp
from partialvfl import Task, VerticalDataset
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
import math

from partialvfl.federation.dp.mechanism import MechanismParam, PrivacyMechanism, ReleaseHooks, register_mechanism

FACTOR = 3.0  # noise FACTOR times the Gaussian's at the same noise multiplier, at 1 / FACTOR^2 of its cost
RELEASES = []  # (clipped rows in, noised rows out, z) of every release: what the test compares the wire with
SUMS = []


def _event(params):
    import dp_accounting as dpa

    return dpa.GaussianDpEvent(noise_multiplier=float(params["scale"]))


def _calibrate(charges, remaining_mu2):
    return math.sqrt(charges / remaining_mu2)


def _cost(z):
    return 1.0 / (FACTOR * z) ** 2


def _noise_release(rows, z, generator):
    import torch

    out = rows + torch.randn(tuple(rows.shape), generator=generator, dtype=torch.float64) * (2.0 * z * FACTOR)
    RELEASES.append((rows.clone(), out.clone(), z))
    return out


def _noise_sum(total, z, clip, generator):
    import torch

    SUMS.append(z)
    return total + torch.randn(tuple(total.shape), generator=generator, dtype=torch.float64) * (2.0 * z * clip * FACTOR)


TOY = register_mechanism(PrivacyMechanism(
    name="toy-noise", where="release", summary="a toy Gaussian noise on every release",
    params=(MechanismParam("scale", "float", 1.0, "the noise scale over the sensitivity"),), dp_event=_event,
    release=ReleaseHooks(_calibrate, _cost, _noise_release, _noise_sum),
), __name__)
'''

#: A label mechanism in one module: keep each label with probability ``keep``, else the next class; its declared
#: accounting says twice label_dp (a toy: the test checks the report reads the declaration).
TOY_LABEL_MODULE = '''
import numpy as np

from partialvfl.federation.dp.mechanism import LabelRelease, MechanismParam, PrivacyMechanism, register_mechanism

OUTPUTS = []


def _event(params):
    import dp_accounting as dpa
    import math

    k, eps = int(params["n_classes"]), 2.0 * float(params["label_dp"])
    keep = 1.0 / (1.0 + (k - 1) * math.exp(-eps))
    return dpa.RandomizedResponseDpEvent(noise_parameter=k * (1 - keep) / (k - 1), num_buckets=k)


def _apply(y, labeled, params, context):
    rng = context.rng("keep-or-next")
    kept = rng.random(len(y)) < float(params["keep"])
    out = np.where(labeled & ~kept, (y + 1) % context.n_classes, y)
    OUTPUTS.append(out.copy())
    return LabelRelease(out)


TOY = register_mechanism(PrivacyMechanism(
    name="keep-or-next", where="label", summary="keep each label with probability keep, else the next class",
    params=(MechanismParam("label_dp", "float", None, "the epsilon"),
            MechanismParam("keep", "float", 0.5, "the probability of keeping a label")),
    dp_event=_event, apply=_apply,
), __name__)
'''


def _names() -> list[str]:
    return [m.name for m in mechanisms()]


def _one_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str) -> Iterator[object]:
    """A mechanism in its own module (written here, imported from ``sys.path``), forgotten afterwards."""
    load_mechanisms()
    before = _names()
    (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    yield module
    unregister_mechanism(module.TOY.name)
    sys.modules.pop(name, None)
    assert _names() == before  # the registry is left as it was


@pytest.fixture
def toy_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    yield from _one_module(tmp_path, monkeypatch, "toy_privacy_mechanism", TOY_MODULE)


@pytest.fixture
def toy(toy_module: object) -> PrivacyMechanism:
    return toy_module.TOY  # type: ignore[attr-defined]


@pytest.fixture
def toy_label(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    yield from _one_module(tmp_path, monkeypatch, "toy_label_mechanism", TOY_LABEL_MODULE)


def tiny(n: int = 80) -> VerticalDataset:
    rng = np.random.default_rng(0)
    blocks = [rng.normal(size=(n, 3)).astype(np.float32), rng.normal(size=(n, 4)).astype(np.float32)]
    y = (blocks[0][:, 0] + blocks[1][:, 0] > 0).astype(np.int64)
    return VerticalDataset(blocks, np.ones((n, 2), bool), ids=[f"u{i:03d}" for i in range(n)], y=y,
                           party_names=["bank", "shop"], labeled=np.arange(n) % 4 != 3,
                           task=Task.classification([0, 1]), active_party=0)


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
    with pytest.raises(ValueError, match="label mechanism 'x' must declare apply"):
        PrivacyMechanism("x", "label", "s", (), event)
    with pytest.raises(ValueError, match="release mechanism 'x' must declare release=ReleaseHooks.*only a mu-GDP"):
        PrivacyMechanism("x", "release", "s", (), event)


# ---------------------------------------------------------------------- a label mechanism, run
def test_a_label_mechanism_in_one_module_is_what_the_fit_trains_with(toy_label: object,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """label_dp_mechanism=<toy>: the labels the coordinator trains with are the toy's output (keep=0: every
    labelled row's label is the next class, so the model learns the opposite and its accuracy collapses); its own
    parameter arrives typed; the report, model.json and a loaded model's get_params name it."""
    from partialvfl.methods import VFLMethod, get_method

    data = tiny()
    method_cls = get_method("vanilla-vfl")
    trained: list[np.ndarray] = []
    original = method_cls._fit

    def spy(self: object, view: object, handle: str, loop: object) -> None:
        trained.append(np.asarray(view.y).copy())  # type: ignore[attr-defined]
        original(self, view, handle, loop)  # type: ignore[arg-type]

    monkeypatch.setattr(method_cls, "_fit", spy)
    clean = method_cls("fast", seed=0, epochs=30).fit(data)
    model = method_cls("fast", seed=0, epochs=30, label_dp=1.0, label_dp_mechanism="keep-or-next", keep="0").fit(data)
    assert model.label_dp_params == {"keep": 0.0}  # "0" read by the declared type
    assert np.array_equal(trained[-1], toy_label.OUTPUTS[-1])  # type: ignore[attr-defined]
    flipped = np.where(data.labeled, 1 - data.y, data.y)
    np.testing.assert_array_equal(trained[-1], flipped)
    assert model.score(data) < 0.35 < 0.65 < clean.score(data)
    # no debias hook: the label prior is the plain frequencies of what it trained with
    np.testing.assert_allclose(model.label_prior_, np.bincount(flipped[data.labeled], minlength=2) / data.labeled.sum())
    labels = model.privacy_["labels"]
    assert labels["name"] == "keep-or-next" and labels["params"] == {"keep": 0.0}
    assert labels["accounted_epsilon"] == pytest.approx(2.0, abs=1e-3)  # from its dp_event, not from label_dp
    model.save(tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "model.json").read_text())["privacy"]["labels"]
    assert saved["name"] == "keep-or-next" and saved["params"] == {"keep": 0.0}
    loaded = VFLMethod.load(tmp_path / "m")
    got = loaded.get_params()
    assert (got["label_dp"], got["label_dp_mechanism"], got["keep"]) == (1.0, "keep-or-next", 0.0)


def test_a_label_mechanisms_parameters_are_checked_against_its_declaration(toy_label: object) -> None:
    from partialvfl.methods import get_method

    vanilla = get_method("vanilla-vfl")
    with pytest.raises(ValueError, match="parameter keep must be number"):
        vanilla("fast", label_dp=1.0, label_dp_mechanism="keep-or-next", keep="often")
    data = tiny(40)
    with pytest.raises(ValueError, match="label mechanism 'randomized-response' takes no parameter 'keep' "
                                         "\\(declared by keep-or-next\\)"):
        vanilla("fast", label_dp=1.0, keep=0.3).fit(data)
    with pytest.raises(ValueError, match="label_dp_prior=true means label_dp_mechanism='rr-with-prior', but "
                                         "label_dp_mechanism='keep-or-next' was given"):
        vanilla("fast", label_dp=1.0, label_dp_prior=True, label_dp_mechanism="keep-or-next").fit(data)
    with pytest.raises(ValueError, match="no label privacy mechanism 'gaussian'; declared: .*keep-or-next"):
        vanilla("fast", label_dp=1.0, label_dp_mechanism="gaussian").fit(data)
    with pytest.raises(ValueError, match="label_dp_mechanism='keep-or-next' needs label_dp"):
        vanilla("fast", label_dp_mechanism="keep-or-next").fit(data)


# ---------------------------------------------------------------------- a release mechanism, run
def test_a_release_mechanism_in_one_module_is_what_a_party_runs(toy_module: object) -> None:
    """A party whose policy names the toy releases the toy's noised values (the transport's log carries exactly
    them; their noise is FACTOR times the Gaussian's) and its ledger is charged the toy's cost."""
    from partialvfl.federation.runtime.coordinator import LocalFederation
    from partialvfl.federation.trust.policy import PartyPolicy
    from partialvfl.federation.wire.messages import MessageLog
    from partialvfl.methods import get_method

    data = tiny()
    log = MessageLog(keep_payloads=True)
    policy = PartyPolicy.research().with_dp(8.0, 1e-5, mechanism="toy-noise")
    fed = LocalFederation.for_dataset(data, policies={"shop": policy}, log=log)
    model = get_method("vanilla-vfl")("fast", seed=0, epochs=2).fit(data, federation=fed)
    privacy = fed.runtimes[1].privacy
    assert privacy is not None and privacy.mechanism.name == "toy-noise"
    assert model.privacy_["parties"]["shop"]["mechanism"] == "toy-noise"
    releases = toy_module.RELEASES  # type: ignore[attr-defined]
    sent = [t for e, ts in zip(log.entries, log.payloads) if e.sender == 1 and e.direction == "reply" and ts
            for t in ts.values()]  # every tensor the party released, in order (a reply's in its release order)
    assert releases and len(sent) == len(releases)
    clips = {*privacy.plan.clip.values(), privacy.plan.default_clip}
    for (_, noisy, _), tensor in zip(releases, sent):
        flat = tensor.double().reshape(noisy.shape[0], -1)
        clip = float((flat / noisy).flatten().median())
        assert any(math.isclose(clip, c, rel_tol=1e-4) for c in clips)
        np.testing.assert_allclose(flat.numpy(), (noisy * clip).numpy(), rtol=1e-4, atol=1e-5)
    noise = np.concatenate([((noisy - clean) / (2.0 * z)).flatten().numpy() for clean, noisy, z in releases])
    assert noise.std() == pytest.approx(3.0, rel=0.1)  # FACTOR times the Gaussian's 2 z
    assert toy_module.SUMS  # type: ignore[attr-defined]  # DP-SGD's sums went through the toy too
    mu2 = privacy.ledger._mu2
    applications = mu2 * (3.0 * privacy.z) ** 2  # each application costs 1 / (FACTOR z)^2
    np.testing.assert_allclose(applications, np.round(applications), atol=1e-6)
    assert applications.max() >= 1 and privacy.ledger.max_mu2() < privacy.budget.mu ** 2 / 9 + 1e-12


def test_a_policy_names_a_declared_release_mechanism() -> None:
    from partialvfl.federation.trust.policy import PartyPolicy

    with pytest.raises(ValueError, match=r"\[policy\]: dp_mechanism: no release privacy mechanism 'nope'; "
                                         "declared: gaussian"):
        PartyPolicy.from_table({"dp_epsilon": 8, "dp_delta": 1e-5, "dp_mechanism": "nope"})
    with pytest.raises(ValueError, match="no release privacy mechanism 'randomized-response'"):
        PartyPolicy.from_table({"dp_epsilon": 8, "dp_delta": 1e-5, "dp_mechanism": "randomized-response"})
    assert PartyPolicy.from_table({"dp_epsilon": 8, "dp_delta": 1e-5}).dp_mechanism == "gaussian"


def test_the_gaussian_mechanism_noises_as_before() -> None:
    """The default's hooks are the Gaussian code: the same draws as N(0, (2 z)^2) from the party's generator."""
    import torch

    from partialvfl.utils.seeding import torch_generator

    hooks = gaussian.GAUSSIAN.release
    assert hooks is not None
    rows = torch.randn(50, 4, dtype=torch.float64)
    got = hooks.noise_release(rows, 1.7, torch_generator(3, "dp-noise"))
    want = rows + torch.randn((50, 4), generator=torch_generator(3, "dp-noise"), dtype=torch.float64) * (2.0 * 1.7)
    assert torch.equal(got, want)
    assert hooks.cost(2.0) == 0.25 and hooks.calibrate(8, 2.0) == 2.0


# ---------------------------------------------------------------------- the CLI
def test_the_mechanisms_listing_does_not_import_torch() -> None:
    code = ("import sys; from partialvfl.cli import main; main(['mechanisms']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "gaussian (release)" in run.stdout


def test_methods_json_lists_the_privacy_parameters_of_the_methods_that_support_them(
        capsys: pytest.CaptureFixture) -> None:
    assert main(["methods", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    names = [p["name"] for p in rows["laser-vfl"]["privacy_params"]]
    assert names == PRIVACY_PARAMS.names and "label_dp_mechanism" in names
    assert rows["x-vfl"]["privacy_params"] == []



def test_a_federation_files_labels_choose_the_mechanism_and_its_parameters(toy_label: object,
                                                                          tmp_path: Path) -> None:
    """[labels] label_dp_mechanism and its label_dp_params table reach the method as --param does (typed, checked
    against the declaration, errors naming the file)."""
    import argparse

    from partialvfl.cli.privacy import federated_label_dp
    from partialvfl.federation.grpc.federation_file import LabelSource
    from partialvfl.methods import get_method

    labels = LabelSource(tmp_path / "labels.csv", "id", "y", label_dp=1.0, label_dp_mechanism="keep-or-next",
                         label_dp_params={"keep": "0.25"})
    args = argparse.Namespace(label_dp=None, federation="fed.toml", out=str(tmp_path))
    method = get_method("laser-vfl")("fast")
    federated_label_dp(args, method, labels.label_dp, labels.mechanism_params())
    assert (method.label_dp, method.label_dp_mechanism, method.label_dp_params) == (1.0, "keep-or-next",
                                                                                    {"keep": 0.25})
    bad = LabelSource(tmp_path / "labels.csv", "id", "y", label_dp=1.0, label_dp_params={"keep": "often"})
    with pytest.raises(ValueError, match=r"\[labels\] in fed.toml: .*parameter keep must be number"):
        federated_label_dp(args, get_method("laser-vfl")("fast"), bad.label_dp, bad.mechanism_params())


def test_a_federation_files_labels_table_carries_the_mechanism(tmp_path: Path) -> None:
    from partialvfl.federation.grpc.federation_file import load_federation_config

    base = ('[coordinator]\nactive_party = "a"\n[tls]\nca = "c"\ncert = "c"\nkey = "k"\n'
            '[[parties]]\nname = "a"\naddress = "x:1"\n'
            '[labels]\npath = "l.csv"\nid_column = "id"\nlabel_column = "y"\nlabel_dp = 1.0\n')
    (tmp_path / "f.toml").write_text(base + 'label_dp_mechanism = "keep-or-next"\nlabel_dp_params = {keep = 0.25}\n')
    labels = load_federation_config(tmp_path / "f.toml").labels
    assert labels is not None
    assert labels.mechanism_params() == {"label_dp_mechanism": "keep-or-next", "keep": 0.25}
    (tmp_path / "f.toml").write_text(base + "label_dp_params = 3\n")
    with pytest.raises(ValueError, match=r"\[labels\] label_dp_params must be a table"):
        load_federation_config(tmp_path / "f.toml")
