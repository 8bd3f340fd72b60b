"""A saved model's files: written all at once or not at all, read back only if they belong together.

A model directory holds ``model.json`` (what the model is: method, parameters, parties, features, classes),
``coordinator.pt`` (the active party's label-side state) and each party's state: ``party-<k>.pt`` in the directory
(in one process) or, in a deployment, on the party's own disk (``party_states.json`` says where).

* **Atomic save** (:func:`write_model_dir`): everything is written to a fresh sibling directory, then renamed onto
  the target; a failure at any point leaves the previous model (or no directory) in place, never half of one.  Other
  entries of an existing target (``checkpoints/``) are kept; the parties' halves of the replaced model are deleted.
* **Belonging together**: ``model.json`` records the SHA-256 of ``coordinator.pt`` and the model's *digest*; every
  party file carries the digest of the model it was saved with, and a party refuses to load a file of another model
  (a swapped or stale ``party-<k>.pt``).
* **Clear failures**: a missing, corrupted, truncated or foreign file raises :class:`ModelFileError`, one line that
  names the file (the CLI prints it and exits with code 2).  Models saved before digests existed load as before.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from partialvfl.data.dataset import CoordinatorView, Task
from partialvfl.methods.run_options import RunOptions
from partialvfl.utils.jsonable import json_default

if TYPE_CHECKING:
    from partialvfl.federation.runtime.coordinator import Federation
    from partialvfl.federation.wire.messages import MessageLog

__all__ = ["FORMAT_VERSION", "MODEL_FILES", "IndexInfo", "ModelFileError", "load_model", "method_from_meta",
           "model_meta", "read_coordinator_state", "read_model_meta", "write_model_dir"]

log = logging.getLogger("partialvfl.model")
MODEL_FILES = ("model.json", "coordinator.pt", "party_states.json")
_PARTY_FILE = re.compile(r"party-\d+\.pt")
_REQUIRED = ("method", "preset", "seed", "params", "index", "label_prior")


@dataclass(frozen=True)
class IndexInfo:
    """What a fitted model remembers of its training data: task (with the class labels), party names in order,
    feature widths, shapes and names per party (``None`` in models saved before names were kept), the label holder."""

    task: Task
    party_names: tuple[str, ...]
    feature_dims: tuple[int, ...]
    feature_shapes: tuple[tuple[int, ...], ...]
    active_party: int
    feature_names: tuple[tuple[str, ...], ...] | None = None

    @property
    def n_parties(self) -> int:
        """The number of parties the model was fitted on."""
        return len(self.party_names)

    @classmethod
    def of(cls, view: CoordinatorView) -> IndexInfo:
        """What a model keeps of the data it was fitted on (no values): task, parties, shapes, feature names."""
        feature_names = view.feature_names
        names = None if feature_names is None else tuple(tuple(str(c) for c in f) for f in feature_names)
        return cls(view.task, tuple(view.party_names), tuple(view.feature_dims),
                   tuple(tuple(s) for s in view.feature_shapes), view.active_party, names)

    def to_dict(self) -> dict[str, Any]:
        """The index as plain values (what ``model.json`` stores)."""
        d = asdict(self)
        d["task"] = self.task.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IndexInfo:
        """The index stored by :meth:`to_dict`."""
        names = d.get("feature_names")
        return cls(Task.from_dict(d["task"]), tuple(d["party_names"]), tuple(d["feature_dims"]),
                   tuple(tuple(s) for s in d["feature_shapes"]), int(d["active_party"]),
                   None if names is None else tuple(tuple(f) for f in names))


class ModelFileError(ValueError):
    """A model directory or one of its files is missing, corrupted, truncated, foreign, or mixed with another's."""


def _is_model_file(name: str) -> bool:
    return name in MODEL_FILES or bool(_PARTY_FILE.fullmatch(name))


def write_model_dir(target: Path, meta: dict[str, Any], coordinator_state: dict[str, Any],
                    save_parties: Callable[[Path, str], None], forget_parties: Callable[[Path], None]) -> Path:
    """Write a model into ``target`` atomically (see the module docstring); returns ``target``.

    ``save_parties(directory, digest)`` has every party save its state for ``directory`` tagged with ``digest``;
    ``forget_parties(directory)`` has them delete the state of a replaced model.
    """
    if target.exists() and not target.is_dir():
        raise ModelFileError(f"cannot save the model: {target} exists and is not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = target.parent / f"{target.name}.saving-{tag}"
    tmp.mkdir()
    try:
        buffer = io.BytesIO()
        torch.save(coordinator_state, buffer)
        blob = buffer.getvalue()
        meta = {**meta, "coordinator_sha256": hashlib.sha256(blob).hexdigest()}
        text = json.dumps(meta, sort_keys=True, default=json_default)
        meta["digest"] = hashlib.sha256(blob + text.encode()).hexdigest()
        save_parties(tmp, meta["digest"])
        (tmp / "coordinator.pt").write_bytes(blob)
        (tmp / "model.json").write_text(json.dumps(meta, indent=2, default=json_default))
        _swap(tmp, target, tag, forget_parties)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _swap(tmp: Path, target: Path, tag: str, forget_parties: Callable[[Path], None]) -> None:
    """Put the complete model in ``tmp`` at ``target``, keeping the target's other entries (e.g. checkpoints)."""
    if not target.exists():
        os.rename(tmp, target)
        return
    for entry in list(target.iterdir()):
        if not _is_model_file(entry.name) and not (tmp / entry.name).exists():
            os.rename(entry, tmp / entry.name)
    old = target.parent / f"{target.name}.replaced-{tag}"
    os.rename(target, old)
    os.rename(tmp, target)
    if (old / "model.json").exists():
        try:  # the parties' halves of the replaced model (over gRPC they live on the parties' disks)
            forget_parties(old)
        except Exception as e:  # a party that cannot delete keeps a stale file, no more
            log.warning("parties could not delete their state of the replaced model: %s", e)
    shutil.rmtree(old, ignore_errors=True)


def read_model_meta(directory: Path) -> dict[str, Any]:
    """``model.json`` of a model directory, checked to describe a partialvfl model."""
    path = directory / "model.json"
    if not directory.is_dir():
        raise ModelFileError(f"{directory} is not a model directory (it does not exist)")
    if not path.is_file():
        raise ModelFileError(f"{directory} holds no saved model (no model.json)")
    try:
        meta = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{path} is corrupted or truncated (not valid JSON: {e})") from None
    if not isinstance(meta, dict) or any(k not in meta for k in _REQUIRED):
        missing = [k for k in _REQUIRED if not isinstance(meta, dict) or k not in meta]
        raise ModelFileError(f"{path} is not a partialvfl model description (missing {missing})")
    return meta


def read_coordinator_state(directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """``coordinator.pt``, checked against the SHA-256 that ``model.json`` recorded (models saved since digests)."""
    path = directory / "coordinator.pt"
    if not path.is_file():
        raise ModelFileError(f"{directory} has model.json but no coordinator.pt")
    blob = path.read_bytes()
    expected = meta.get("coordinator_sha256")
    if expected is not None and hashlib.sha256(blob).hexdigest() != expected:
        raise ModelFileError(f"{path} does not match {directory / 'model.json'}: the file is corrupted, truncated or "
                             "from another model")
    try:
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)  # any device it was saved on
    except Exception as e:  # whatever torch says, the file is unusable
        raise ModelFileError(f"{path} is not a readable coordinator state (corrupted, truncated or foreign: "
                             f"{type(e).__name__})") from None
    if not isinstance(state, dict):
        raise ModelFileError(f"{path} is not a partialvfl coordinator state")
    return state


# ---------------------------------------------------------------------- a method's model.json, and loading a model
#: 2: feature names, preprocessing, digests (format 1 models still load)
FORMAT_VERSION = 2


def model_meta(method: Any) -> dict[str, Any]:
    """What ``model.json`` says about a fitted ``method``."""
    schedule = getattr(method, "schedule_", None)
    privacy = getattr(method, "privacy_", None)
    calibration = getattr(method, "calibration_", None)
    return {
        "format": FORMAT_VERSION,
        "method": method.name,
        "preset": method.preset,
        "seed": method.seed,
        "overrides": method.overrides,
        "params": method.params_,
        "index": method.index_.to_dict(),
        "label_prior": [float(v) for v in method.label_prior_],
        "preprocessing": getattr(method, "preprocessing_", None),
        "data_info": method.data_info_,
        "fit_seconds": getattr(method, "fit_seconds_", None),
        "schedule": schedule.to_dict() if schedule is not None else None,
        "history": method.history_,
        **({"privacy": {**privacy, "dp_options": method.dp_options}} if privacy else {}),
        **({"calibration": calibration.to_dict()} if calibration is not None else {}),
    }


def method_from_meta(cls: Any, meta: dict[str, Any], d: Path, run: RunOptions | None = None) -> Any:
    """The estimator of method class ``cls`` that ``model.json`` (``meta``, read from directory ``d``) describes,
    running with ``run``, before any state is loaded."""
    from partialvfl.methods.private_fit import restore_privacy
    from partialvfl.methods.schedule import SchedulePlan

    run = run or RunOptions()
    space = cls.param_space()
    try:
        obj = cls(meta["preset"], seed=meta["seed"], device=run.device, precision=run.precision, compile=run.compile,
                  **space.renamed(meta["overrides"]))
        obj.index_ = IndexInfo.from_dict(meta["index"])
        saved = space.renamed(meta["params"])
        # models saved before party standardisation existed were trained on features as they are
        values = {**space.defaults(), "standardize": False, **saved}
        declared = set(space.names)
        obj._set_params({k: v for k, v in values.items() if k in declared},
                        {k: v for k, v in values.items() if k not in declared})
        obj.label_prior_ = np.asarray(meta["label_prior"], dtype=np.float64)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFileError(f"{d / 'model.json'} does not describe a usable {cls.name!r} model "
                             f"({type(e).__name__}: {e})") from None
    restore_privacy(obj, meta)
    obj.preprocessing_ = meta.get("preprocessing")
    obj.data_info_ = meta.get("data_info", {})
    obj.history_ = meta.get("history", [])
    obj.fit_seconds_ = meta.get("fit_seconds")
    obj.schedule_ = SchedulePlan.from_dict(meta["schedule"]) if meta.get("schedule") else None
    obj.calibration_ = None
    if meta.get("calibration"):
        from partialvfl.methods.calibration import Calibration

        try:
            obj.calibration_ = Calibration.from_dict(meta["calibration"])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFileError(f"{d / 'model.json'}: its calibration is unreadable ({type(e).__name__}: {e})") \
                from None
    return obj


def load_model(cls: Any, d: Path, meta: dict[str, Any], run: RunOptions, *, federation: Federation | None = None,
               log: MessageLog | None = None) -> Any:
    """The model saved in ``d`` (its ``model.json`` read as ``meta``; of method class ``cls``) with its parties'
    states loaded, running with ``run``; without ``federation`` its parties run in this process (see
    ``VFLMethod.load``)."""
    from partialvfl.federation.runtime.coordinator import LocalFederation
    from partialvfl.federation.wire.program import StateFileError
    from partialvfl.methods.private_fit import plans_for, private_parties

    obj = method_from_meta(cls, meta, d, run)
    state = read_coordinator_state(d, meta)
    fed = federation or LocalFederation(obj.index_.party_names, obj.index_.active_party, log=log,
                                        device=run.torch_device, precision=run.precision, compile=run.compile)
    fed.transport.device = run.torch_device
    obj.federation_ = fed
    fed.setup(obj.party_program, [obj._party_config(k) for k in range(obj.index_.n_parties)], obj.seed,
              plans=plans_for(obj, private_parties(obj, fed), "predict"))
    try:
        fed.load(d, model=meta.get("digest"))
    except StateFileError as e:
        raise ModelFileError(str(e)) from None
    try:
        obj._load_coordinator_state(state)
    except (KeyError, RuntimeError, TypeError, ValueError) as e:
        raise ModelFileError(f"{d / 'coordinator.pt'} does not fit the model model.json describes "
                             f"({type(e).__name__}: {str(e)[:200]})") from None
    return obj
