"""The coordinator's federation file (``federation.toml``: its identity, TLS files, the parties' addresses and pins,
its label table) and the label table itself, read as :func:`~partialvfl.data.builders.from_tables` reads labels."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.data.dataset import DataValidationError, Task
from partialvfl.data.labels import encode_labels
from partialvfl.data.tables import columns_hint, read_table, table_ids
from partialvfl.federation.grpc.psu_session import ALIGNMENT_MODES
from partialvfl.federation.grpc.transport import DEFAULT_MAX_MESSAGE_BYTES, PartyEndpoint, TlsFiles
from partialvfl.federation.trust.pins import require_pins
from partialvfl.utils.tomlfile import check_keys, read_toml

__all__ = ["FEDERATION_KEYS", "FederationConfig", "LabelSource", "load_federation_config", "read_labels"]

#: every section and key of a federation file (docs/deployment.md); anything else is an error naming it
FEDERATION_KEYS: dict[str, tuple[str, ...]] = {
    "coordinator": ("identity", "active_party", "alignment", "hmac_key_file", "deadline_seconds", "max_message_mb",
                    "state_dir"),
    "tls": ("ca", "cert", "key"),
    "labels": ("path", "id_column", "label_column", "task", "classes", "label_dp", "label_dp_mechanism",
               "label_dp_params"),
    "parties": ("name", "address", "identity", "ca", "certificate"),
}


@dataclass(frozen=True)
class LabelSource:
    """The active party's label table: a CSV/Parquet file with an ID column and a label column."""

    path: Path
    id_column: str
    label_column: str
    task: str = "classification"
    classes: tuple[Any, ...] | None = None
    label_dp: float | None = None  # the label holder's label DP (randomized response at this epsilon)
    # the declared label mechanism that runs it (None: the method's, randomized response by default) and that
    # mechanism's own parameters, checked against its declaration by the method (partialvfl mechanisms)
    label_dp_mechanism: str | None = None
    label_dp_params: Mapping[str, Any] = field(default_factory=dict)

    def mechanism_params(self) -> dict[str, Any]:
        """The label mechanism's choice and parameters as the method's parameters (``label_dp_mechanism``, then the
        ``label_dp_params`` table's keys)."""
        return {**({"label_dp_mechanism": self.label_dp_mechanism} if self.label_dp_mechanism else {}),
                **self.label_dp_params}


@dataclass(frozen=True)
class FederationConfig:
    """The coordinator's federation file, paths resolved against the file's folder."""

    identity: str
    parties: tuple[PartyEndpoint, ...]
    active_party: int
    tls: TlsFiles
    hmac_key_file: Path | None
    labels: LabelSource | None
    deadline: float = 30.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    state_dir: Path | None = None
    alignment: str = "psu"


def load_federation_config(path: str | Path) -> FederationConfig:
    """Read a federation TOML file (see ``docs/deployment.md``)."""
    p = Path(path)
    raw = read_toml(p, "federation file")
    check_keys(raw, FEDERATION_KEYS, p)

    def rel(v: str) -> Path:
        q = Path(v).expanduser()
        return q if q.is_absolute() else p.parent / q

    coord = raw.get("coordinator", {})
    tls = raw.get("tls")
    if not tls or not all(k in tls for k in ("ca", "cert", "key")):
        raise ValueError(f"{p}: [tls] needs 'ca', 'cert' and 'key'")
    parties = raw.get("parties")
    if not parties:
        raise ValueError(f"{p}: list the parties as [[parties]] tables with 'name' and 'address'")
    eps = []
    for i, t in enumerate(parties):
        if "name" not in t or "address" not in t:
            raise ValueError(f"{p}: party {i} needs 'name' and 'address'")
        if "ca" in t and "certificate" in t:
            raise ValueError(f"{p}: party {t['name']!r}: pin its CA (ca) or its certificate (certificate), not both")
        pin = t.get("ca", t.get("certificate"))
        eps.append(PartyEndpoint(str(t["name"]), str(t["address"]), str(t.get("identity", t["name"])),
                                 rel(str(pin)) if pin is not None else None))
    tls_files = TlsFiles(rel(tls["ca"]), rel(tls["cert"]), rel(tls["key"]))
    for ep in eps:
        if ep.pin is not None and not ep.pin.is_file():
            raise FileNotFoundError(f"{p}: party {ep.name!r}: pinned file not found: {ep.pin}")
    if tls_files.ca.is_file():
        require_pins([e.name for e in eps], [e.name for e in eps if e.pin is not None], tls_files.ca, str(p),
                     "ca = the CA file that issues its certificate, or certificate = its certificate, in its "
                     "[[parties]] table; partialvfl certs init writes them")
    names = [e.name for e in eps]
    active = coord.get("active_party")
    if active is None:
        raise ValueError(f"{p}: [coordinator] needs 'active_party' (the name or index of the label holder)")
    if isinstance(active, str):
        if active not in names:
            raise ValueError(f"{p}: active_party {active!r} is not one of the parties {names}")
        active = names.index(active)
    if not 0 <= int(active) < len(eps):
        raise ValueError(f"{p}: active_party index {active} out of range for {len(eps)} parties")
    lab = raw.get("labels")
    labels = None
    if lab is not None:
        for k in ("path", "id_column", "label_column"):
            if k not in lab:
                raise ValueError(f"{p}: [labels] needs '{k}'")
        if lab.get("task", "classification") not in ("classification", "regression"):
            raise ValueError(f"{p}: [labels] task must be 'classification' or 'regression', got {lab['task']!r}")
        label_dp = lab.get("label_dp")
        if label_dp is not None and (isinstance(label_dp, bool) or not isinstance(label_dp, int | float)
                                     or not 0 < label_dp < float("inf")):
            raise ValueError(f"{p}: [labels] label_dp must be a positive number (an epsilon), got {label_dp!r}")
        mechanism = lab.get("label_dp_mechanism")
        if mechanism is not None and not isinstance(mechanism, str):
            raise ValueError(f"{p}: [labels] label_dp_mechanism must be a mechanism's name (partialvfl mechanisms), "
                             f"got {mechanism!r}")
        mechanism_params = lab.get("label_dp_params", {})
        if not isinstance(mechanism_params, dict):
            raise ValueError(f"{p}: [labels] label_dp_params must be a table of the label mechanism's parameters, "
                             f"got {mechanism_params!r}")
        labels = LabelSource(rel(lab["path"]), str(lab["id_column"]), str(lab["label_column"]),
                             str(lab.get("task", "classification")),
                             tuple(lab["classes"]) if "classes" in lab else None,
                             None if label_dp is None else float(label_dp), mechanism, dict(mechanism_params))
    alignment = coord.get("alignment", "psu")
    if alignment not in ALIGNMENT_MODES:
        raise ValueError(f"{p}: [coordinator] alignment must be one of {list(ALIGNMENT_MODES)}, got {alignment!r}")
    if alignment == "hmac" and "hmac_key_file" not in coord:
        raise ValueError(f"{p}: [coordinator] alignment = 'hmac' needs 'hmac_key_file'")
    return FederationConfig(
        alignment=str(alignment),
        identity=str(coord.get("identity", "coordinator")),
        parties=tuple(eps),
        active_party=int(active),
        tls=tls_files,
        hmac_key_file=rel(coord["hmac_key_file"]) if alignment == "hmac" else None,
        labels=labels,
        deadline=float(coord.get("deadline_seconds", 30.0)),
        max_message_bytes=int(float(coord.get("max_message_mb", DEFAULT_MAX_MESSAGE_BYTES / 2**20)) * 2**20),
        state_dir=rel(coord["state_dir"]) if "state_dir" in coord else None,
    )


def read_labels(src: LabelSource) -> tuple[np.ndarray, np.ndarray, Task]:
    """The label table as (normalised IDs, labels (class indices or floats), task); rows without a label dropped.

    Read and encoded exactly as :func:`~partialvfl.data.builders.from_tables` reads the active party's label column
    (:mod:`partialvfl.data.labels`): integer labels stay integers (``0``..``9``, never ``0.0``..``9.0``), classes are
    sorted unless ``classes`` lists them, IDs follow the one rule of :mod:`partialvfl.data.ids`.
    """
    where = f"label table {src.path}"
    if not src.path.is_file():
        raise FileNotFoundError(f"label table not found: {src.path}")
    df, _ = read_table(where, src.path, src.id_column)
    ids, _ = table_ids(where, df, src.id_column)
    if src.label_column not in df.columns:
        raise DataValidationError(f"{where}: label column {src.label_column!r} not found; {columns_hint(df)}")
    task = Task.regression() if src.task == "regression" else None
    ids_arr = np.array(ids, dtype=object)
    out_task, y, labeled = encode_labels(df[src.label_column].to_numpy(dtype=object), task, src.classes, ids_arr,
                                         f"{where}, column {src.label_column!r}")
    return ids_arr[labeled], np.asarray(y)[labeled], out_task
