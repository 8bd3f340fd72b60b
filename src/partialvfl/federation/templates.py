"""Configuration templates with the pins filled in, as ``partialvfl certs init`` writes them.

Next to the development PKI, one ``<party>.party.toml`` per party and one ``federation.toml`` for the coordinator:
the TLS files, the identities and the pins (a party pins the coordinator's public key, ``[peers.coordinator]
spki_sha256``; the coordinator pins each party's certificate, ``certificate`` in its ``[[parties]]`` table), with the
data and address lines left for the institution to fill in.  Paths are relative to the templates' folder (the PKI
folder), as the readers resolve them.  Parties are listed in the order given (the federation file's ``[[parties]]``
order, each party's ``index``: the order of the model's parties).  The label holder is ``active`` (default: the last
party): with the keyless alignment (the default) the other parties get ``alignment_key_file``, the label holder and
the coordinator never do; with ``hmac`` every file names ``hmac.key``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from partialvfl.federation.pins import spki_sha256

__all__ = ["write_templates"]


def _party(name: str, index: int, coordinator: str, pin: str, extra: str) -> str:
    return f"""# partialvfl party configuration for {name!r} (fill in the [data] table and the address)
[party]
name = "{name}"
index = {index}
address = "0.0.0.0:{50051 + index}"
state_dir = "state-{name}"
allowed_peers = ["{coordinator}"]
{extra}
[peers.{coordinator}]                 # the coordinator's certificate must carry this public key
spki_sha256 = "{pin}"

[data]
path = "{name}.csv"                   # this party's own table
id_column = "id"

[tls]
ca = "ca.pem"
cert = "{name}.pem"
key = "{name}.key"
"""


def _federation(parties: Sequence[str], coordinator: str, extra: str, active: str) -> str:
    entries = "".join(f"""
[[parties]]
name = "{name}"
address = "{name}.example.org:{50051 + k}"   # where it listens
identity = "{name}"
certificate = "{name}.pem"                   # pinned: the channel to it trusts only this certificate
""" for k, name in enumerate(parties))
    return f"""# partialvfl federation file for the coordinator {coordinator!r} (fill in [labels] and the addresses)
[coordinator]
identity = "{coordinator}"
active_party = "{active}"
{extra}
[tls]
ca = "ca.pem"
cert = "{coordinator}.pem"
key = "{coordinator}.key"

[labels]
path = "labels.csv"
id_column = "id"
label_column = "label"
{entries}"""


def _alignment_lines(hmac: bool, holds_key: bool) -> str:
    if hmac:
        return 'alignment = "hmac"\nhmac_key_file = "hmac.key"\n'
    return 'alignment = "psu"\n' + ('alignment_key_file = "alignment.key"\n' if holds_key else "")


def write_templates(directory: str | Path, parties: Sequence[str], coordinator: str, *,
                    hmac: bool = False, active: str | None = None) -> list[Path]:
    """Write the templates into ``directory`` (which holds the certificates); returns their paths.  ``hmac``: the
    files name ``alignment = "hmac"`` and ``hmac.key`` instead of the keyless alignment; ``active``: the label
    holder (default: the last party)."""
    active = parties[-1] if active is None else active
    if active not in parties:
        raise ValueError(f"the label holder {active!r} is not one of the parties {list(parties)}")
    d = Path(directory)
    pin = spki_sha256((d / f"{coordinator}.pem").read_bytes())
    out = []
    for k, name in enumerate(parties):
        p = d / f"{name}.party.toml"
        p.write_text(_party(name, k, coordinator, pin, _alignment_lines(hmac, name != active)))
        out.append(p)
    p = d / "federation.toml"
    p.write_text(_federation(parties, coordinator, _alignment_lines(hmac, False), active))
    return [*out, p]
