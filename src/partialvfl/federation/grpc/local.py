"""A real multi-process deployment of a :class:`VerticalDataset` on this machine (tests, benchmarks, trying it).

:class:`LocalDeployment` writes what each institution would have (its own Parquet table, its certificate, the
shared HMAC key, its party configuration), starts one ``party serve`` process per
party on 127.0.0.1 with an OS-chosen port, and writes the coordinator's federation file.  Processes are killed when
the deployment is closed (use it as a context manager).

Each party's ``[policy]`` is ``policy``: ``"research"`` (the default: the in-process simulation's permissive policy,
seeded by the coordinator, so federated runs reproduce in-process ones), ``"default"`` (no ``[policy]`` table: the
safe policy a deployed party gets) or a table of ``[policy]`` keys.  ``predict`` adds prediction tables: name ->
dataset whose rows every party serves as ``[[data.predict]]`` (they are never in its training table).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.data.dataset import VerticalDataset
from partialvfl.federation.grpc.launcher import LAUNCHERS, PartyHandle, default_launcher, launch_party
from partialvfl.federation.trust.alignment import write_key
from partialvfl.federation.trust.psu import write_alignment_key

__all__ = ["LocalDeployment", "write_party_tables"]


def write_party_tables(data: VerticalDataset, directory: str | Path, id_column: str = "id",
                       extra: Sequence[VerticalDataset] = ()) -> list[Path]:
    """One Parquet table per party (its observed rows of ``data`` and of ``extra``: ID + features) and
    ``labels.parquet`` (ID + label of ``data``'s labelled samples)."""
    import pandas as pd

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def text_ids(ds: VerticalDataset) -> np.ndarray:
        return np.array([str(v.item() if isinstance(v, np.generic) else v) for v in ds.ids], dtype=object)

    sets = [data, *extra]
    all_ids = np.concatenate([text_ids(ds) for ds in sets])
    if len(set(all_ids)) != len(all_ids):
        raise ValueError("the datasets of a deployment must not share IDs")
    paths = []
    for k in range(data.n_parties):
        frames = []
        for ds in sets:
            rows = ds.observed[:, k]
            df = pd.DataFrame(ds.blocks[k][rows], columns=[f"f{j}" for j in range(data.feature_dims[k])])
            df.insert(0, id_column, text_ids(ds)[rows])
            frames.append(df)
        p = d / f"party-{k}.parquet"
        pd.concat(frames, ignore_index=True).to_parquet(p, index=False)
        paths.append(p)
    lab = data.labeled
    y = data.y[lab]
    if data.task.is_classification:
        y = np.array([data.task.classes[int(v)] for v in y])
    pd.DataFrame({id_column: text_ids(data)[lab], "label": y}).to_parquet(d / "labels.parquet", index=False)
    return paths


def _q(p: Path | str) -> str:
    return '"' + str(p).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str | Path):
        return _q(v)
    if isinstance(v, Sequence):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as a TOML value")


def policy_table(table: Mapping[str, Any]) -> str:
    """A ``[policy]`` table of a party file with these keys."""
    return "\n[policy]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in table.items())


def _policy_dict(policy: str | Mapping[str, Any]) -> dict[str, Any]:
    """``"research"``, ``"default"`` or explicit keys, as ``[policy]`` keys."""
    if policy == "research":
        return {"preset": "research"}
    return {} if policy == "default" else dict(policy)  # type: ignore[arg-type]


class LocalDeployment:
    """Party processes for ``data`` under ``directory``; ``federation_file`` is the coordinator's file.

    Each party's table holds its observed rows of ``data`` and of the ``extra`` datasets (e.g. the test set: an
    institution holds all its users); the coordinator's label table holds ``data``'s labels.  ``alignment``:
    ``"psu"`` (the passive parties hold ``alignment.key``, the active party and the coordinator no key) or ``"hmac"``
    (everyone holds ``hmac.key``).
    """

    def __init__(
        self,
        directory: str | Path,
        data: VerticalDataset,
        *,
        extra: Sequence[VerticalDataset] = (),
        plugins: Sequence[str] = (),
        pythonpath: Sequence[str | Path] = (),
        deadline: float = 10.0,
        max_message_mb: float = 64.0,
        start_timeout: float = 60.0,
        policy: str | Mapping[str, Any] = "research",
        predict: Mapping[str, VerticalDataset] | None = None,
        session_idle_seconds: float | None = None,
        extra_cas: Sequence[str | Path] = (),
        pins: bool = False,
        alignment: str = "psu",
        threads: int = 1,
        launcher: str | None = None,
        resume_sessions: bool = True,
    ) -> None:
        self.dir = Path(directory)
        self.resume_sessions = resume_sessions  # [party] resume_sessions of the parties started from now on
        self.data = data
        self.extra = tuple(extra)
        self.plugins = tuple(plugins)
        self.pythonpath = [str(p) for p in pythonpath]
        self.deadline = deadline
        self.max_message_mb = max_message_mb
        self.start_timeout = start_timeout
        self.policy: dict[int, str | Mapping[str, Any]] = {k: policy for k in range(data.n_parties)}
        self.predict = dict(predict or {})
        self.names = list(data.party_names)
        self.launcher = default_launcher() if launcher is None else launcher
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {LAUNCHERS}, got {self.launcher!r}")
        self.procs: dict[int, PartyHandle] = {}
        self.ports: dict[int, int] = {}
        self.certs = self.dir / "certs"
        self.alignment = alignment
        self.threads = threads
        self.key_file = self.dir / "hmac.key"  # alignment = "hmac" only: every party and the coordinator
        self.alignment_key_file = self.dir / "alignment.key"  # the passive parties only
        self.federation_file = self.dir / "federation.toml"
        self.session_idle_seconds = session_idle_seconds
        self.extra_cas = [Path(c) for c in extra_cas]  # other institutions' CAs in everyone's bundle
        self.pins = pins  # parties pin the coordinator's key, the coordinator each party's certificate
        self._prepare()

    def _prepare(self) -> None:
        from partialvfl.federation.grpc.certs import init_dev_pki  # cryptography: only where a deployment is made

        self.dir.mkdir(parents=True, exist_ok=True)
        init_dev_pki(self.certs, [*self.names, "coordinator"])
        self.ca_bundle = self.certs / "ca.pem"
        if self.extra_cas:  # as the docs advise for several institutions: their CA certificates concatenated
            self.ca_bundle = self.certs / "bundle.pem"
            self.ca_bundle.write_bytes(b"".join(p.read_bytes() for p in [self.certs / "ca.pem", *self.extra_cas]))
        if self.alignment == "hmac":
            write_key(self.key_file)
        else:
            write_alignment_key(self.alignment_key_file)
        write_party_tables(self.data, self.dir / "data", extra=self.extra)
        for name, ds in self.predict.items():
            write_party_tables(ds, self.dir / "data" / name)

    def _predict_tables(self, k: int) -> str:
        return "".join(f"""
[[data.predict]]
name = {_q(name)}
path = {_q(self.dir / "data" / name / f"party-{k}.parquet")}
""" for name in self.predict)

    def party_config_file(self, k: int) -> Path:
        """The path of party ``k``'s configuration file."""
        return self.dir / f"party-{k}.toml"

    def _write_party_config(self, k: int, port: int = 0) -> Path:
        name = self.names[k]
        plugins = ", ".join(_q(p) for p in self.plugins)
        shape = ", ".join(str(s) for s in self.data.feature_shapes[k])
        text = f"""[party]
name = {_q(name)}
index = {k}
address = "127.0.0.1:{port}"
port_file = {_q(self.dir / f"party-{k}.port")}
state_dir = {_q(self.dir / "state" / name)}
{self._alignment_lines(k)}
allowed_peers = ["coordinator"]
plugins = [{plugins}]
threads = {self.threads}
resume_sessions = {"true" if self.resume_sessions else "false"}
{self._idle_line()}
[data]
path = {_q(self.dir / "data" / f"party-{k}.parquet")}
id_column = "id"
feature_shape = [{shape}]
{self._predict_tables(k)}
[tls]
ca = {_q(self.ca_bundle)}
cert = {_q(self.certs / f"{name}.pem")}
key = {_q(self.certs / f"{name}.key")}
{self._peers_table()}{policy_table({"max_request_mb": self.max_message_mb, **_policy_dict(self.policy[k])})}"""
        p = self.party_config_file(k)
        p.write_text(text)
        return p

    def _idle_line(self) -> str:
        return "" if self.session_idle_seconds is None else f"session_idle_seconds = {self.session_idle_seconds}\n"

    def _peers_table(self) -> str:
        if not self.pins:
            return ""
        from partialvfl.federation.trust.pins import spki_sha256  # cryptography: only where a deployment is made

        return f'\n[peers.coordinator]\nspki_sha256 = "{spki_sha256((self.certs / "coordinator.pem").read_bytes())}"\n'

    def _alignment_lines(self, k: int | None) -> str:
        """A party's (``k``) or the coordinator's (``None``) alignment settings: the passive parties hold the
        alignment key, the label holder's institution (coordinator and its own party) never does."""
        if self.alignment == "hmac":
            return f'alignment = "hmac"\nhmac_key_file = {_q(self.key_file)}'
        if k is None or k == self.data.active_party:
            return 'alignment = "psu"'
        return f'alignment = "psu"\nalignment_key_file = {_q(self.alignment_key_file)}'

    def write_federation_file(self) -> Path:
        """Write the coordinator's federation file for the parties; its path."""
        parts = [f"""[coordinator]
identity = "coordinator"
active_party = {self.data.active_party}
{self._alignment_lines(None)}
deadline_seconds = {self.deadline}
max_message_mb = {self.max_message_mb}

[tls]
ca = {_q(self.ca_bundle)}
cert = {_q(self.certs / "coordinator.pem")}
key = {_q(self.certs / "coordinator.key")}

[labels]
path = {_q(self.dir / "data" / "labels.parquet")}
id_column = "id"
label_column = "label"
task = {_q(self.data.task.kind)}
"""]
        for k, name in enumerate(self.names):
            parts.append(f"""
[[parties]]
name = {_q(name)}
address = "127.0.0.1:{self.ports.get(k, 0)}"
identity = {_q(name)}
""" + (f"certificate = {_q(self.certs / f'{name}.pem')}\n" if self.pins else ""))
        self.federation_file.write_text("".join(parts))
        return self.federation_file

    def env(self) -> dict[str, str]:
        """The environment the party processes run in (one torch thread, ended with this process)."""
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = "1"
        env["PARTIALVFL_EXIT_WITH_PARENT"] = "1"  # parties stop if this process dies without closing them
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join([*self.pythonpath, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return env

    def start(self, parties: Sequence[int] | None = None) -> dict[int, int]:
        """Start the given parties (default all; a restarted party keeps its port); wait until they listen."""
        parties = list(range(len(self.names))) if parties is None else list(parties)
        for k in parties:
            if k in self.procs and self.procs[k].poll() is None:
                raise RuntimeError(f"party {k} is already running")
            port_file = self.dir / f"party-{k}.port"
            port_file.unlink(missing_ok=True)
            cfg = self._write_party_config(k, self.ports.get(k, 0))
            self.procs[k] = launch_party(self.launcher, ["party", "serve", "--config", str(cfg)],
                                         self.dir / f"party-{k}.log", self.env())
        t0 = time.monotonic()
        for k in parties:
            port_file = self.dir / f"party-{k}.port"
            while not port_file.exists():
                if self.procs[k].poll() is not None:
                    log = (self.dir / f"party-{k}.log").read_text()[-3000:]
                    raise RuntimeError(f"party {k} exited with {self.procs[k].returncode} before listening:\n{log}")
                if time.monotonic() - t0 > self.start_timeout:
                    raise TimeoutError(f"party {k} did not start within {self.start_timeout} s")
                time.sleep(0.05)
            self.ports[k] = int(port_file.read_text())
        self.write_federation_file()
        return {k: self.ports[k] for k in parties}

    def kill(self, k: int, sig: int = signal.SIGKILL) -> None:
        """Stop party ``k`` abruptly (a crash) or politely (``SIGTERM``)."""
        p = self.procs.get(k)
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)

    def close(self) -> None:
        """Kill every party process of the deployment."""
        for k in list(self.procs):
            self.kill(k, signal.SIGKILL)
        self.procs.clear()

    def federation(self, **kwargs: Any) -> Any:
        """A connected :class:`~partialvfl.federation.grpc.federation.GrpcFederation` to these parties."""
        from partialvfl.federation.grpc.federation import GrpcFederation

        return GrpcFederation.from_config(self.federation_file, **kwargs)

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
