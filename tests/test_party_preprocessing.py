"""Preprocessing that belongs to each party (issue 12, item 1): every method standardises each party's features by
default with statistics that party fits on its own training rows; they stay at the party, are saved with its state,
are applied at prediction, and ``standardize=false`` turns them off.  Protocol data (already standardised) passes
through unchanged, so the benchmark numbers do not move."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from example_tables import PARTIES, write_example
from partialvfl.cli import main
from partialvfl.data.builders import from_tables
from partialvfl.data.preprocessing import ColumnScaler
from partialvfl.data.protocol import ProtocolConfig, make_protocol
from partialvfl.federation.wire.messages import MessageLog
from partialvfl.methods import VFLMethod, get_method
from partialvfl.methods.registry import load_specs

ROOT = Path(__file__).resolve().parents[1]
KW = {"id_column": "customer_id", "label_column": "defaulted", "active_party": "bank"}


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worked example's tables (bank income: std ~600; shop shares: max 0.76), smaller."""
    return write_example(tmp_path_factory.mktemp("example"), seed=1, n_train=600, n_new=200)


def raw_tables(d: Path, split: str) -> dict[str, pd.DataFrame]:
    if split == "train":
        return {p: pd.read_csv(d / "train" / f"{p}.csv") for p in PARTIES}
    return {"bank": pd.read_csv(d / "outcomes" / "bank.csv"), **{p: pd.read_csv(d / "new" / f"{p}.csv")
                                                                 for p in PARTIES[1:]}}


def by_hand(tables: dict[str, pd.DataFrame], train: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """Each party's columns standardised with the mean and (population) std of its own training rows."""
    out = {}
    for p, t in tables.items():
        t = t.copy()
        for c in t.columns:
            if c not in ("customer_id", "defaulted"):
                t[c] = (t[c] - train[p][c].mean()) / train[p][c].std(ddof=0)
        out[p] = t
    return out


@pytest.mark.slow
def test_badly_scaled_tables_default_settings_match_hand_standardisation(example: Path) -> None:
    train, new = raw_tables(example, "train"), raw_tables(example, "new")
    assert train["bank"]["income_eur"].std() > 500 and train["shop"]["share_online"].max() <= 0.76
    data = {"raw": (from_tables(train, **KW), from_tables(new, **KW)),
            "hand": (from_tables(by_hand(train, train), **KW), from_tables(by_hand(new, train), **KW))}
    acc, proba = {}, {}
    for name, (fit_on, test_on), params in (("default", data["raw"], {}), ("raw", data["raw"], {"standardize": False}),
                                            ("hand", data["hand"], {"standardize": False})):
        model = get_method("laser-vfl")("fast", seed=0, **params).fit(fit_on)
        acc[name], proba[name] = model.score(test_on), model.predict_proba(test_on)
    # the party's own statistics are the hand-made ones: the same model, up to float32 rounding of the inputs
    assert abs(acc["default"] - acc["hand"]) <= 0.01 and np.abs(proba["default"] - proba["hand"]).max() < 1e-3
    assert acc["default"] > 0.75 and acc["raw"] < acc["default"] - 0.08  # raw scales: ~the majority class


def test_statistics_are_the_partys_own_training_rows_and_stay_there(example: Path) -> None:
    train = from_tables(raw_tables(example, "train"), **KW)
    log = MessageLog(keep_payloads=True)
    model = get_method("vanilla-vfl")("fast", seed=0, epochs=2).fit(train, log=log)
    for k, runtime in enumerate(model.federation_.runtimes):
        x = train.party(k).features.astype(np.float64)
        np.testing.assert_allclose(runtime.scaler.mean, x.mean(axis=0), rtol=1e-12)
        np.testing.assert_allclose(runtime.scaler.scale, x.std(axis=0), rtol=1e-12)
    kinds = [e.kind for e in log.entries if e.kind == "preprocess"]
    assert len(kinds) == 2 * 3  # one request and one reply per party, before training
    replies = [p for e, p in zip(log.entries, log.payloads) if e.kind == "preprocess"]
    assert all(not p for p in replies)  # no tensor crosses: the statistics never leave the party
    assert model.preprocessing_ == {"standardize": True, "how": "each party, on its own training rows"}


def test_statistics_are_saved_with_the_party_and_applied_at_prediction(example: Path, tmp_path: Path) -> None:
    train, new = from_tables(raw_tables(example, "train"), **KW), from_tables(raw_tables(example, "new"), **KW)
    model = get_method("vanilla-vfl")("fast", seed=0, epochs=2).fit(train)
    model.save(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "model.json").read_text())
    assert "mean" not in json.dumps(meta) and meta["preprocessing"]["standardize"] is True
    saved = torch.load(tmp_path / "m" / "party-0.pt", weights_only=True)
    np.testing.assert_allclose(saved["preprocessing"]["mean"], model.federation_.runtimes[0].scaler.mean)
    loaded = VFLMethod.load(tmp_path / "m")
    np.testing.assert_array_equal(loaded.predict_proba(new), model.predict_proba(new))
    # prediction uses the training statistics, not the new rows' own
    np.testing.assert_array_equal(loaded.federation_.runtimes[0].scaler.mean, model.federation_.runtimes[0].scaler.mean)


def test_standardize_false_turns_it_off(example: Path) -> None:
    train = from_tables(raw_tables(example, "train"), **KW)
    model = get_method("vanilla-vfl")("fast", seed=0, epochs=1, standardize=False).fit(train)
    assert all(rt.scaler is None for rt in model.federation_.runtimes)
    assert model.preprocessing_ == {"standardize": False, "how": "none (standardize=false)"}


def test_protocol_data_passes_through_unchanged() -> None:
    train, _ = make_protocol(ProtocolConfig(dataset="digits", parties=4, n_labels=100, n_aligned=20, seed=0,
                                            max_train=300, max_test=50))
    model = get_method("vanilla-vfl")("fast", seed=0, epochs=1).fit(train)
    assert all(rt.scaler is None for rt in model.federation_.runtimes)
    assert model.preprocessing_["standardize"] is False and "protocol" in model.preprocessing_["how"]


def test_constant_columns_are_centred_not_scaled_and_large_values_stay_finite() -> None:
    x = np.array([[5.0, 1e30, 0.1], [5.0, 2e30, 0.1], [5.0, 3e30, 0.1]], dtype=np.float32)
    scaler = ColumnScaler.fit(x)
    assert scaler.scale[0] == 1.0 and scaler.scale[2] == 1.0  # constant (0.1 in float64 too): scale 1
    out = scaler.transform(x)
    assert np.all(np.isfinite(out)) and np.allclose(out[:, 0], 0) and np.allclose(out[:, 1], [-1.2247, 0, 1.2247],
                                                                                  atol=1e-4)
    restored = ColumnScaler.from_state(json.loads(json.dumps(scaler.state_dict())))
    np.testing.assert_array_equal(restored.transform(x), out)


def test_every_method_declares_standardize_once(capsys: pytest.CaptureFixture) -> None:
    for name, spec in load_specs().items():
        assert spec.params.param("standardize").default is True, name
        assert get_method(name).param_space().param("standardize").default is True, name
    assert main(["methods", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all("standardize" in {p["name"] for p in r["params"]} for r in rows)
    declared = [p for p in (ROOT / "src" / "partialvfl" / "methods").rglob("*.py")
                if 'Param("standardize"' in p.read_text()]
    assert [p.name for p in declared] == ["params.py"]
