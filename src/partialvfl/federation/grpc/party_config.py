"""A party's configuration file (``party.toml``): who it is, where it listens, its tables, TLS files, its policy and
its access log.  Every key is documented in ``docs/deployment.md``; relative paths are resolved against the file's
folder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partialvfl.federation.grpc.sessions import DEFAULT_IDLE_SECONDS
from partialvfl.federation.grpc.transport import DEFAULT_MAX_MESSAGE_BYTES, TlsFiles
from partialvfl.federation.trust.access_log import AccessLogConfig
from partialvfl.federation.trust.pins import PeerPin, read_pins, require_pins
from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.utils.devices import check_precision, resolve_device
from partialvfl.utils.tomlfile import check_keys, read_toml

__all__ = ["PARTY_KEYS", "TRAINING_TABLE", "PartyConfig", "PredictTable", "load_party_config"]

#: The name of the party's training table in ``ids``/``attach`` (prediction tables have their own names).
TRAINING_TABLE = "training"


@dataclass(frozen=True)
class PredictTable:
    """A table of users to predict (``[[data.predict]]``): served beside the training table, never trained on."""

    name: str
    path: Path
    id_column: str | None = None


@dataclass(frozen=True)
class PartyConfig:
    """A party process's configuration file, paths resolved against the file's folder."""

    name: str
    index: int
    address: str
    data_path: Path
    id_column: str
    tls: TlsFiles
    state_dir: Path
    hmac_key_file: Path | None = None  # alignment = "hmac" only
    allowed_peers: tuple[str, ...] = ("coordinator",)
    feature_columns: tuple[str, ...] | None = None
    exclude_columns: tuple[str, ...] = ()
    feature_shape: tuple[int, ...] | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    port_file: Path | None = None
    plugins: tuple[str, ...] = ()
    threads: int = 1
    alignment_threads: int = 0  # threads of alignment's group arithmetic (0: every usable core)
    ray_address: str | None = None  # run alignment's group arithmetic on this Ray cluster (the party's own)
    device: str = "cpu"  # where the party's programs compute (its own choice): cpu, cuda, cuda:N, mps, auto
    precision: str = "fp32"  # or bf16 (autocast)
    extra: dict[str, Any] = field(default_factory=dict)
    policy: PartyPolicy = field(default_factory=PartyPolicy.default)
    predict_tables: tuple[PredictTable, ...] = ()
    access_log: AccessLogConfig | None = None  # default: access.log in the state directory
    max_concurrent_rpcs: int = 4
    peers: dict[str, PeerPin] = field(default_factory=dict)  # [peers.<name>]: what each allowed peer must present
    session_idle_seconds: float = DEFAULT_IDLE_SECONDS
    resume_sessions: bool = True  # keep the session on disk (state_dir/session/): a restarted party continues it
    alignment: str = "psu"  # or "hmac" (one trust domain only)
    alignment_key_file: Path | None = None  # the passive parties' shared alignment secret (never the label holder's)


#: every section and key of a party file (docs/deployment.md); anything else is an error naming it ([policy] keys are
#: checked by :meth:`PartyPolicy.from_table`)
PARTY_KEYS: dict[str, tuple[str, ...] | None] = {
    "party": ("name", "index", "address", "port_file", "state_dir", "hmac_key_file", "alignment",
              "alignment_key_file", "allowed_peers", "max_message_mb", "plugins", "threads", "max_concurrent_rpcs",
              "session_idle_seconds", "resume_sessions", "device", "precision", "alignment_threads",
              "ray_address"),
    "data": ("path", "id_column", "feature_columns", "exclude_columns", "feature_shape", "predict"),
    "tls": ("ca", "cert", "key"),
    "policy": PartyPolicy.keys(),
    "access_log": ("path", "max_mb", "backups"),
    "peers": None,  # one table per allowed peer name, checked by read_pins
}


def _need(table: dict[str, Any], key: str, where: str, path: Path) -> Any:
    if key not in table:
        raise ValueError(f"{path}: [{where}] needs '{key}'")
    return table[key]


def _predict_tables(data: dict[str, Any], p: Path, rel: Callable[[str], Path]) -> tuple[PredictTable, ...]:
    entries = data.get("predict", [])
    if not isinstance(entries, list):
        raise ValueError(f"{p}: list prediction tables as [[data.predict]] tables with 'name' and 'path'")
    out: list[PredictTable] = []
    for i, t in enumerate(entries):
        if not isinstance(t, dict) or "name" not in t or "path" not in t:
            raise ValueError(f"{p}: [[data.predict]] entry {i} needs 'name' and 'path'")
        name = str(t["name"])
        if name == TRAINING_TABLE or name in {o.name for o in out}:
            raise ValueError(f"{p}: prediction table name {name!r} is reserved or used twice")
        out.append(PredictTable(name, rel(t["path"]), str(t["id_column"]) if "id_column" in t else None))
    return tuple(out)


def _message_bytes(party: dict[str, Any], policy_table: dict[str, Any], policy: PartyPolicy, p: Path) -> int:
    """The request size limit: ``[policy] max_request_mb`` (or its older name ``[party] max_message_mb``)."""
    if "max_message_mb" in party and "max_request_mb" in policy_table:
        raise ValueError(f"{p}: give the request size limit once, as [policy] max_request_mb")
    mb = float(party.get("max_message_mb", policy.max_request_mb))
    return int(mb * 2**20)


def _device(party: dict[str, Any], p: Path) -> str:
    """``[party] device`` (default ``cpu``), refused if this machine lacks it."""
    device = str(party.get("device", "cpu"))
    resolve_device(device, what=f"{p}: [party] device")
    return device


def _alignment_threads(party: dict[str, Any], p: Path) -> int:
    """``[party] alignment_threads``: threads of alignment's group arithmetic, ``"auto"`` or 0 (the default) for
    every usable core."""
    value = party.get("alignment_threads", 0)
    if value == "auto":
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{p}: [party] alignment_threads must be an integer >= 0 or 'auto' (0 and 'auto': every "
                         f"core), got {value!r}")
    return value


def _alignment(party: dict[str, Any], p: Path) -> str:
    """``[party] alignment``: "psu" (the default, keyless) or "hmac" (explicit, needs ``hmac_key_file``)."""
    mode = party.get("alignment", "psu")
    if mode not in ("psu", "hmac"):
        raise ValueError(f"{p}: [party] alignment must be 'psu' or 'hmac', got {mode!r}")
    if mode == "hmac" and "hmac_key_file" not in party:
        raise ValueError(f"{p}: [party] alignment = 'hmac' needs 'hmac_key_file'")
    return str(mode)


def load_party_config(path: str | Path) -> PartyConfig:
    """Read a party's TOML configuration (see ``docs/deployment.md`` for every key)."""
    p = Path(path)
    raw = read_toml(p, "party configuration")
    check_keys(raw, PARTY_KEYS, p)
    base = p.parent

    def rel(v: str) -> Path:
        q = Path(v).expanduser()
        return q if q.is_absolute() else (base / q)

    party = _need(raw, "party", "party", p)
    data = _need(raw, "data", "data", p)
    tls = _need(raw, "tls", "tls", p)
    policy_table = raw.get("policy", {})
    policy = PartyPolicy.from_table(policy_table, f"{p}: [policy]")
    access = raw.get("access_log", {})
    state_dir = rel(party.get("state_dir", f"state-{party.get('name', 'party')}"))
    allowed = tuple(party.get("allowed_peers", ["coordinator"]))
    tls_files = TlsFiles(rel(_need(tls, "ca", "tls", p)), rel(_need(tls, "cert", "tls", p)),
                         rel(_need(tls, "key", "tls", p)))
    peers = read_pins(raw.get("peers", {}), allowed, rel, str(p))
    if tls_files.ca.is_file():
        require_pins(allowed, peers, tls_files.ca, str(p), "[peers.NAME] spki_sha256 = the SHA-256 of its "
                     "certificate's public key, or ca = the CA file that issues it; partialvfl certs init writes "
                     "them")
    idle = float(party.get("session_idle_seconds", DEFAULT_IDLE_SECONDS))
    if not idle > 0:
        raise ValueError(f"{p}: [party] session_idle_seconds must be a positive number of seconds")
    resume = party.get("resume_sessions", True)
    if not isinstance(resume, bool):
        raise ValueError(f"{p}: [party] resume_sessions must be true or false, got {resume!r}")
    fc = data.get("feature_columns")
    shape = data.get("feature_shape")
    return PartyConfig(
        name=str(_need(party, "name", "party", p)),
        index=int(_need(party, "index", "party", p)),
        address=str(party.get("address", "127.0.0.1:0")),
        data_path=rel(_need(data, "path", "data", p)),
        id_column=str(_need(data, "id_column", "data", p)),
        tls=tls_files,
        state_dir=state_dir,
        hmac_key_file=rel(party["hmac_key_file"]) if "hmac_key_file" in party else None,
        alignment=_alignment(party, p),
        alignment_key_file=rel(party["alignment_key_file"]) if "alignment_key_file" in party else None,
        allowed_peers=allowed,
        feature_columns=tuple(fc) if fc is not None else None,
        exclude_columns=tuple(data.get("exclude_columns", [])),
        feature_shape=tuple(int(s) for s in shape) if shape is not None else None,
        max_message_bytes=_message_bytes(party, policy_table, policy, p),
        port_file=rel(party["port_file"]) if "port_file" in party else None,
        plugins=tuple(party.get("plugins", [])),
        threads=int(party.get("threads", 1)),
        alignment_threads=_alignment_threads(party, p),
        ray_address=str(party["ray_address"]) if party.get("ray_address") else None,
        device=_device(party, p),
        precision=check_precision(str(party.get("precision", "fp32")), what=f"{p}: [party] precision"),
        extra=raw,
        policy=policy,
        predict_tables=_predict_tables(data, p, rel),
        access_log=AccessLogConfig(rel(access["path"]) if "path" in access else state_dir / "access.log",
                                   int(float(access.get("max_mb", 10)) * 2**20), int(access.get("backups", 5))),
        max_concurrent_rpcs=max(1, int(party.get("max_concurrent_rpcs", 4))),
        peers=peers,
        session_idle_seconds=idle,
        resume_sessions=resume,
    )
