"""Fits choose party widths within every party's announced policy (issue 37, item 6).

A party with 6 columns under the default policy (``max_width_ratio = 2``: at most 12 values per row per network,
``max_setup_width_ratio`` 4: 24 per setup) joins a LASER-VFL and a FALSE-VFL fit: the fit narrows the widths it was
not given to the narrowest party's caps and says so in one line; a width the user gave is still refused by the party,
naming the rule.
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
from partialvfl.methods import get_method

DIMS = (16, 6)  # the label holder's 16 columns and a party with 6


def make_data(n: int = 60, seed: int = 0) -> VerticalDataset:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    blocks = [rng.normal(size=(n, d)) + y[:, None] for d in DIMS]
    return VerticalDataset(blocks, np.ones((n, len(DIMS)), bool), ids=[f"u{i:03d}" for i in range(n)], y=y,
                           task=Task.classification([0, 1]), active_party=0, party_names=["bank", "shop"])


def _default_federation(data: VerticalDataset, log: MessageLog | None = None) -> LocalFederation:
    """Every party on the default policy a deployed party gets (seeded by the coordinator to be reproducible)."""
    policy = PartyPolicy.from_table({"seed": "coordinator"})
    return LocalFederation.for_dataset(data, log=log, policies={k: policy for k in range(len(DIMS))})


@pytest.mark.parametrize(("name", "key", "chosen"), [("laser-vfl", "latent_dim", 12), ("false-vfl-1", "d_h", 6),
                                                     ("false-vfl-2", "d_h", 6)])
def test_a_party_with_6_columns_joins_a_fit_under_the_default_policy(
        name: str, key: str, chosen: int, capsys: pytest.CaptureFixture) -> None:
    data = make_data()
    log = MessageLog()
    method = get_method(name)("fast", seed=0, epochs=1)
    preset = method.resolve_params(None)[key]
    assert preset > chosen  # the preset's width is beyond the 6-column party's cap
    method.fit(data, federation=_default_federation(data, log))
    assert method.params_[key] == chosen and method.history_
    assert method.predict_proba(data).shape == (len(data.y), 2)
    err = capsys.readouterr().err
    line = f"[{name}] widths chosen within every party's announced policy: {key} {preset} -> {chosen} (party 1 ('shop')"
    assert line in err and err.count("widths chosen") == 1, err
    assert method.width_choice_ in err
    assert sum(e.kind == "setup" for e in log) >= len(DIMS)  # set up once, accepted (a refusal raises)


def test_the_research_policy_changes_no_width(capsys: pytest.CaptureFixture) -> None:
    data = make_data()
    method = get_method("laser-vfl")("fast", seed=0, epochs=1).fit(data)
    assert method.params_["latent_dim"] == method.resolve_params(None)["latent_dim"]
    assert method.width_choice_ is None and "widths chosen" not in capsys.readouterr().err


@pytest.mark.parametrize(("name", "given"), [("laser-vfl", {"latent_dim": 32}), ("false-vfl-1", {"d_h": 32})])
def test_a_width_the_user_gave_beyond_a_cap_is_still_refused_naming_the_rule(name: str, given: dict) -> None:
    data = make_data()
    method = get_method(name)("fast", seed=0, epochs=1, **given)
    with pytest.raises(SetupRefused) as e:
        method.fit(data, federation=_default_federation(data))
    assert "party 1 ('shop'): policy rule 'max_width_ratio'" in str(e.value), str(e.value)
    assert method.params_[next(iter(given))] == next(iter(given.values()))  # asked as given, not narrowed


def test_the_narrowest_party_sets_the_one_width_of_every_party() -> None:
    """Equal widths for every party (LASER-VFL sums the parties' representations): the 16-column party's cap (32)
    does not raise the 6-column party's (12)."""
    data = make_data()
    method = get_method("laser-vfl")("fast", seed=0, epochs=1).fit(data, federation=_default_federation(data))
    assert [method._party_config(k)["latent_dim"] for k in range(len(DIMS))] == [12, 12]


@pytest.mark.slow
def test_over_grpc_a_6_column_party_on_the_default_policy_joins_laser_vfl_and_false_vfl(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Real party processes, each on the default policy (no ``[policy]`` table but a pinned seed), announce their caps
    in their ``hello``; both fits go through without a hand edit."""
    with LocalDeployment(tmp_path / "dep", make_data(), deadline=PATIENCE, start_timeout=600.0,
                         policy={"seed": 7}) as dep:
        dep.start()
        for name, key, chosen in (("laser-vfl", "latent_dim", 12), ("false-vfl-1", "d_h", 6)):
            out = tmp_path / name
            assert main(["fit", "--federation", str(dep.federation_file), "--method", name, "--epochs", "1",
                         "--out", str(out)]) == 0
            err = capsys.readouterr().err
            assert f"widths chosen within every party's announced policy: {key} " in err, err
            assert f"-> {chosen} (party 1 ('shop')" in err, err
            assert re.search(rf"fit {name} in [\d.]+ s across 2 parties; model saved to ", err), err  # its time
