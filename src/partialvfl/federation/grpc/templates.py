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

from partialvfl.federation.trust.pins import spki_sha256

__all__ = ["LOCAL_POLICY", "free_loopback_ports", "write_templates"]


#: a loopback trial's ``[policy]``: the safe default a deployed party gets, its main keys written out to edit
LOCAL_POLICY = """
[policy]                              # what this party agrees to run (docs/reference.md); the safe default
preset = "default"
# max_width_ratio = 2.0               # values per row a network sends, per feature (a fit narrows its widths to it)
# allow_likelihood_release = false
# allow_weight_sharing = false
"""


def _party(name: str, index: int, coordinator: str, pin: str, extra: str, port: int | None = None) -> str:
    if port is None:
        head = f"""# partialvfl party configuration for {name!r} (fill in the [data] table and the address)
[party]
name = "{name}"
index = {index}
address = "0.0.0.0:{50051 + index}"
"""
    else:
        head = f"""# partialvfl party configuration for {name!r}: a trial on this machine (loopback only; put this
# party's table at the [data] path)
[party]
name = "{name}"
index = {index}
address = "127.0.0.1:{port}"          # loopback: reachable from this machine only
port_file = "{name}.port"             # the port, once it listens
"""
    return head + f"""state_dir = "state-{name}"
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
""" + (LOCAL_POLICY if port is not None else "")


def _federation(parties: Sequence[str], coordinator: str, extra: str, active: str,
                ports: Sequence[int] | None = None) -> str:
    addresses = [f"{name}.example.org:{50051 + k}" if ports is None else f"127.0.0.1:{ports[k]}"
                 for k, name in enumerate(parties)]
    entries = "".join(f"""
[[parties]]
name = "{name}"
address = "{addresses[k]}"   # where it listens
identity = "{name}"
certificate = "{name}.pem"                   # pinned: the channel to it trusts only this certificate
""" for k, name in enumerate(parties))
    what = "fill in [labels]" if ports is not None else "fill in [labels] and the addresses"
    return f"""# partialvfl federation file for the coordinator {coordinator!r} ({what})
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
                    hmac: bool = False, active: str | None = None, ports: Sequence[int] | None = None) -> list[Path]:
    """Write the templates into ``directory`` (which holds the certificates); returns their paths.  ``hmac``: the
    files name ``alignment = "hmac"`` and ``hmac.key`` instead of the keyless alignment; ``active``: the label
    holder (default: the last party).  ``ports``: a trial on this machine (``certs init --local``): party ``k``
    listens on ``127.0.0.1:ports[k]`` (and writes its ``port_file``), the federation file names those addresses, and
    each party file has a ``[policy]`` table."""
    active = parties[-1] if active is None else active
    if active not in parties:
        raise ValueError(f"the label holder {active!r} is not one of the parties {list(parties)}")
    if ports is not None and len(ports) != len(parties):
        raise ValueError(f"{len(ports)} ports for {len(parties)} parties")
    d = Path(directory)
    pin = spki_sha256((d / f"{coordinator}.pem").read_bytes())
    out = []
    for k, name in enumerate(parties):
        p = d / f"{name}.party.toml"
        p.write_text(_party(name, k, coordinator, pin, _alignment_lines(hmac, name != active),
                            None if ports is None else ports[k]))
        out.append(p)
    p = d / "federation.toml"
    p.write_text(_federation(parties, coordinator, _alignment_lines(hmac, False), active, ports))
    return [*out, p]


def free_loopback_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now (the OS's choice; all held open until every one is drawn)."""
    import socket

    held = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()
