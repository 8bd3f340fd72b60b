"""Same data, same seed, same model, in process and federated (issue 12, items 1, 4 and 5): real party processes
(a :class:`LocalDeployment`, generous deadlines) serve the example tables; the federation aligns them by private set
union (a sample order of this session's tokens), each party standardises its own features, and the predictions equal
those of an in-process fit on the same tables in the same order.  Also: what ``predict --federation`` writes and
when it fails."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from example_tables import table_paths, write_example
from helpers import PATIENCE
from partialvfl.cli import main
from partialvfl.data.builders import from_tables
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.methods import get_method

ROOT = Path(__file__).resolve().parents[1]
KW = {"id_column": "customer_id", "label_column": "defaulted", "active_party": "bank"}
PARAMS = {"epochs": 4}


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_example(tmp_path_factory.mktemp("example"), seed=3, n_train=400, n_new=60)


def train_tables(d: Path) -> dict[str, Path]:
    return table_paths(d)


@pytest.fixture(scope="module")
def deployment(example: Path, tmp_path_factory: pytest.TempPathFactory):
    data = from_tables(train_tables(example), **KW)  # raw features: each party standardises its own
    dep = LocalDeployment(tmp_path_factory.mktemp("fed"), data, deadline=PATIENCE, start_timeout=600.0)
    try:
        dep.start()
        yield dep
    finally:
        dep.close()


@pytest.mark.slow
def test_in_process_and_federated_fits_give_identical_predictions(example: Path, deployment: LocalDeployment,
                                                                 tmp_path: Path) -> None:
    fed = deployment.federation()
    try:
        view, handle = fed.align()
        # in process: the same tables in the order the federation built from this session's tokens (the coordinator,
        # who holds every ID in this test, looks them up online through the keyed parties)
        canonical = from_tables(train_tables(example), **KW)
        tokens = fed.id_tokens(canonical.ids)
        local = canonical.subset(sorted(range(len(tokens)), key=lambda i: bytes(tokens[i])))
        assert local.ids.tolist() != canonical.ids.tolist()  # the session's tokens decide the order
        assert [bytes(t).hex() for t in fed.id_tokens(local.ids)] == view.ids.tolist()
        m_local = get_method("laser-vfl")("fast", seed=0, **PARAMS).fit(local)
        p_local = m_local.predict_proba(local)
        assert view.n_samples == local.n_samples and view.observed.sum() == local.observed.sum()
        m_fed = get_method("laser-vfl")("fast", seed=0, **PARAMS).fit_federated(fed, view, handle)
        fed.release(handle)
        assert m_fed.classes_.tolist() == m_local.classes_.tolist() == [0, 1]  # integers, not 0.0 and 1.0
        assert m_fed.preprocessing_["standardize"] is True
        pview, phandle = fed.attach_ids(local.ids, task=m_fed.index_.task)
        p_fed = m_fed.predict_output_federated(pview, phandle)
        fed.release(phandle)
        m_fed.save(tmp_path / "fed-model")
    finally:
        fed.close()
    np.testing.assert_array_equal(pview.observed, local.observed)
    assert np.abs(p_fed - p_local).max() <= 1e-6, np.abs(p_fed - p_local).max()
    # the history of losses is the same, epoch by epoch
    np.testing.assert_allclose([h["loss"] for h in m_fed.history_], [h["loss"] for h in m_local.history_], rtol=1e-6)


@pytest.mark.slow
def test_predict_federation_writes_the_users_id_column_and_integer_classes(example: Path,
                                                                          deployment: LocalDeployment,
                                                                          tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from partialvfl.methods import VFLMethod

    seen: list[int] = []
    fit_federated = VFLMethod.fit_federated

    def recording(self, *a, **kw):
        seen.append(torch.get_num_threads())
        return fit_federated(self, *a, **kw)

    monkeypatch.setattr(VFLMethod, "fit_federated", recording)
    before = torch.get_num_threads()
    want = 2 if before == 1 else 1  # a number the process does not already use
    model = tmp_path / "model"
    assert main(["fit", "--federation", str(deployment.federation_file), "--method", "vanilla-vfl", "--epochs", "2",
                 "--out", str(model), "--quiet", "--threads", str(want)]) == 0
    assert seen == [want] and torch.get_num_threads() == before  # the coordinator ran with --threads
    capsys.readouterr()
    bank = pd.read_csv(example / "train" / "bank.csv")
    bank[["customer_id"]].to_csv(tmp_path / "ids.csv", index=False)
    out = tmp_path / "pred.csv"
    assert main(["predict", "--federation", str(deployment.federation_file), "--model", str(model),
                 "--ids", str(tmp_path / "ids.csv"), "--out", str(out)]) == 0
    assert capsys.readouterr().err.strip() == f"{len(bank)} predictions written to {out}"
    df = pd.read_csv(out)
    assert list(df.columns) == ["customer_id", "prediction", "p_0", "p_1", "n_parties", "parties"]
    assert df["prediction"].dtype.kind == "i" and df["customer_id"].tolist() == bank["customer_id"].tolist()
    assert all("bank" in p.split(";") for p in df["parties"])
    # IDs no party holds would be the label prior alone: an error unless explicitly allowed
    pd.DataFrame({"customer_id": [bank["customer_id"][0], 1]}).to_csv(tmp_path / "ids2.csv", index=False)
    argv = ["predict", "--federation", str(deployment.federation_file), "--model", str(model),
            "--ids", str(tmp_path / "ids2.csv"), "--out", str(tmp_path / "p2.csv")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["error: 1 of 2 IDs (first: '1') are held by no party: their prediction would "
                                        "be the training label prior alone; pass --allow-prior-only to write such rows"]
    assert main([*argv, "--allow-prior-only"]) == 0
    written = pd.read_csv(tmp_path / "p2.csv")
    assert written["n_parties"].tolist() == [df["n_parties"][0], 0] and written["parties"].isna().tolist() == [False,
                                                                                                              True]


@pytest.mark.slow
def test_predict_fails_when_the_active_party_or_every_party_is_unreachable(example: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    data = from_tables(train_tables(example), **KW)
    with LocalDeployment(tmp_path / "dep", data, deadline=PATIENCE, start_timeout=600.0) as dep:
        dep.start()
        model = tmp_path / "model"
        assert main(["fit", "--federation", str(dep.federation_file), "--method", "vanilla-vfl", "--epochs", "1",
                     "--out", str(model), "--quiet"]) == 0
        pd.DataFrame({"customer_id": data.ids[:5]}).to_csv(tmp_path / "ids.csv", index=False)
        argv = ["predict", "--federation", str(dep.federation_file), "--model", str(model), "--ids",
                str(tmp_path / "ids.csv"), "--out", str(tmp_path / "p.csv")]
        dep.kill(0)  # the active party (bank)
        capsys.readouterr()
        assert main(argv) == 3
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "the active party 'bank'" in err[0] and "is unreachable" in err[0]
        dep.kill(1)
        dep.kill(2)
        assert main([*argv, "--allow-prior-only"]) == 3  # no party answers: never a prior-only file with exit 0
        assert not (tmp_path / "p.csv").exists()
