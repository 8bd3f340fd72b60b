"""A party's policy refusing a setup (issue 21, item 2): the refusal names the party, the ``party.toml`` key and the
value that would accept it; the coordinator asks every party and reports every refusal at once, before anything is
trained (``fit --federation``: exit 3); the party's start-up line says what its file changed from the preset.

The default policy is kept as it is: ``max_width_ratio = 2`` refuses a model sending 32 values per row from 3
features; what changes is that one attempt says, for every party, what would let it through.  (A fit that is not
given its widths chooses them within every party's announced caps, ``tests/test_width_choice.py``: these fits ask for
``latent_dim = 32``, the ``fast`` preset's, explicitly.)
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from helpers import PATIENCE
from partialvfl import Task, VerticalDataset
from partialvfl.cli import main
from partialvfl.federation import LocalFederation, MessageLog
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.runtime.coordinator import SetupRefused
from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.methods import get_method

DIMS = (3, 2, 3)  # few columns per party: the default policy refuses every built-in preset's widths
SENDS = re.compile(r"party (\d) \('(\w+)'\): policy rule 'max_width_ratio': model 'f' would send (\d+) values per "
                   r"row computed from (\d+) features: more than 2 x \d+ \(this party would accept it with \[policy\] "
                   r"max_width_ratio = ([\d.]+) in its party.toml\)")


def fully_observed_data(n: int = 60, seed: int = 0) -> VerticalDataset:
    """Three parties of widths ``DIMS``, two classes, every block held, every row labelled."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    blocks = [rng.normal(size=(n, d)) + y[:, None] for d in DIMS]
    return VerticalDataset(blocks, np.ones((n, 3), bool), ids=[f"u{i:03d}" for i in range(n)], y=y,
                           task=Task.classification([0, 1]), active_party=0, party_names=["bank", "shop", "telco"])


def test_a_refused_setup_names_every_rule_and_the_value_that_accepts_it() -> None:
    policy = PartyPolicy.default()
    config = {"feature_shape": [6], "models": ["f"], "latent_dim": 32, "encoder_hidden": [],
              "optimizer": {"lr": 1e-8}}
    from partialvfl.methods.splitnn.party import SplitParty

    with pytest.raises(PolicyViolation) as e:
        policy.check_setup("splitnn/party", config, registered={"splitnn/party": SplitParty}, n_features=6)
    text = str(e.value)
    assert e.value.rules == ("min_hidden_layers", "max_width_ratio", "min_lr"), text
    assert "model 'f' would send 32 values per row computed from 6 features: more than 2 x 6" in text
    assert text.endswith("(this party would accept it with [policy] min_hidden_layers = 0, max_width_ratio = 5.34, "
                         "min_lr = 1e-08 in its party.toml)"), text
    accepting = PartyPolicy.from_table(e.value.accept)  # what it names is enough, and 5.34 is the least of 2 decimals
    assert accepting.check_setup("splitnn/party", config, registered={"splitnn/party": SplitParty}, n_features=6)
    narrower = PartyPolicy.from_table({**e.value.accept, "max_width_ratio": 5.33})
    with pytest.raises(PolicyViolation, match="max_width_ratio = 5.34"):
        narrower.check_setup("splitnn/party", config, registered={"splitnn/party": SplitParty}, n_features=6)


def test_the_start_up_line_says_when_the_file_changed_the_preset() -> None:
    assert PartyPolicy.default().describe().startswith("policy default (the preset unchanged): the package's own "
                                                       "programs; seeds drawn by the party (secret)")
    changed = PartyPolicy.from_table({"max_width_ratio": 16, "min_lr": 0, "programs": ["builtin", "acme/party"]})
    assert changed.describe().startswith('policy default changed by party.toml (programs = ["builtin", '
                                         '"acme/party"], max_width_ratio = 16, min_lr = 0): the package\'s own '
                                         'programs, acme/party;'), changed.describe()
    assert PartyPolicy.from_table({"preset": "research"}).describe().startswith("policy research (the preset "
                                                                                "unchanged): any program")


def test_in_process_every_refusing_party_is_named_at_once_and_nothing_is_trained() -> None:
    data = fully_observed_data()
    log = MessageLog()
    fed = LocalFederation.for_dataset(data, log=log)
    for k in (1, 2):  # two deployed parties, with the default policy; the active party runs the research one
        fed.runtimes[k].policy = PartyPolicy.default()
    method = get_method("laser-vfl")("fast", seed=0, epochs=1, latent_dim=32)
    with pytest.raises(SetupRefused) as e:
        method.fit(data, federation=fed)
    text = str(e.value)
    assert text.startswith("2 of 3 parties refused to set up 'splitnn/party'; nothing was trained:\n"), text
    found = {m[1]: (int(m[2]), int(m[3]), float(m[4])) for m in SENDS.findall(text)}
    assert found.keys() == {"shop", "telco"}, text
    assert {k: v[1] for k, v in found.items()} == {"shop": 2, "telco": 3}
    assert {e.kind for e in log} == {"setup"} and len(log) == 4  # one setup round (one reply), nothing after it
    for k in (1, 2):  # the values named are each party's own, and they accept the same request
        accept = e.value.errors[k].accept
        assert set(accept) == {"max_width_ratio"}
        fed.runtimes[k].policy = PartyPolicy.from_table(accept)
    method.fit(data, federation=fed)
    assert method.history_


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    dep = LocalDeployment(tmp_path_factory.mktemp("refusals"), fully_observed_data(), deadline=PATIENCE,
                          start_timeout=600.0, policy="default")
    dep.policy[0] = {"max_width_ratio": 16}  # the bank agreed to wide outputs in its party.toml
    try:
        dep.start()
        yield dep
    finally:
        dep.close()


def _fit(dep: LocalDeployment, out: Path) -> list[str]:
    return ["fit", "--federation", str(dep.federation_file), "--method", "laser-vfl", "--epochs", "1",
            "--param", "latent_dim=32", "--out", str(out), "--quiet"]


@pytest.mark.slow
def test_fit_over_grpc_reports_every_refusing_party_once_before_training_and_exits_3(
        deployment: LocalDeployment, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    logs = [deployment.dir / f"party-{k}.log" for k in range(3)]
    assert "policy default changed by party.toml (max_width_ratio = 16)" in logs[0].read_text()
    assert "policy default (the preset unchanged)" in logs[1].read_text()
    assert main(_fit(deployment, tmp_path / "model")) == 3
    err = capsys.readouterr().err
    assert err.count("parties refused to set up") == 1 and "2 of 3 parties refused to set up 'splitnn/party'" in err
    found = {m[1]: (int(m[3]), m[4]) for m in SENDS.findall(err)}
    assert found == {"shop": (2, "16"), "telco": (3, "10.67")}, err
    assert not (tmp_path / "model").exists()
    for k, refused in ((0, 0), (1, 1), (2, 1)):  # each party was asked once, and nothing was trained
        text = logs[k].read_text()
        assert text.count("refused 'setup': PERMISSION_DENIED") == refused, text[-2000:]
    for k, value in ((1, 16), (2, 10.67)):  # the values the refusal named let the same fit through
        deployment.kill(k)
        deployment.policy[k] = {"max_width_ratio": value}
        deployment.start([k])
    assert main(_fit(deployment, tmp_path / "model")) == 0
    assert f"changed by party.toml (max_width_ratio = {10.67:g})" in logs[2].read_text()
