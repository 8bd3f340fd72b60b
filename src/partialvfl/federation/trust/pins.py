"""Peers pinned, not named: what each side of a federation trusts for each other's identity.

A CA bundle that concatenates several institutions' CAs lets *any* of them issue a certificate named
"coordinator" (or "bank"), and a name check alone would accept it.  So a name is bound to what its owner's
certificate must be:

* a party pins each allowed peer (``[peers.<name>]`` in ``party.toml``) to its certificate's public-key fingerprint
  (``spki_sha256``: SHA-256 of the DER SubjectPublicKeyInfo, hex; it survives a certificate renewal with the same
  key) and/or to the CA that must have issued it (``ca``: a PEM file; an intermediate CA counts);
* the coordinator pins each party (``[[parties]]`` of the federation file) to the CA that issued its certificate
  (``ca``) or to the certificate itself (``certificate``): the channel to that party then trusts only that anchor,
  so the TLS handshake itself fails for a certificate of another CA (gRPC's Python client exposes no hook to check
  a server's key fingerprint, so the coordinator pins by anchor).

A name without a pin is accepted only when the CA bundle holds exactly one CA certificate (then that CA is the only
one that can issue it); with several, the configuration is refused at start, naming the peer and the keys to add.
``partialvfl certs init`` writes the pins into the templates it writes.  Fingerprints and signature checks come from
``cryptography``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

__all__ = ["PeerPin", "bundle_size", "issued_by", "load_certificates", "read_pins", "require_pins", "spki_sha256"]

_HEX = set("0123456789abcdef")


def spki_sha256(cert: x509.Certificate | bytes) -> str:
    """The SHA-256 fingerprint (hex) of a certificate's public key (DER SubjectPublicKeyInfo)."""
    if isinstance(cert, bytes):
        cert = x509.load_pem_x509_certificate(cert)
    der = cert.public_key().public_bytes(serialization.Encoding.DER,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def load_certificates(path: str | Path, what: str) -> list[x509.Certificate]:
    """The PEM certificates in ``path`` (a readable error naming the file and ``what`` it is for)."""
    p = Path(path)
    try:
        certs = x509.load_pem_x509_certificates(p.read_bytes())
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: certificate file not found: {p}") from None
    except ValueError as e:
        raise ValueError(f"{what}: {p} holds no readable PEM certificate ({e})") from None
    return certs


def bundle_size(path: str | Path) -> int:
    """How many certificates a CA bundle holds."""
    return len(load_certificates(path, "CA bundle"))


def issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """Whether ``ca`` signed ``cert`` (its issuer name and its signature)."""
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


@dataclass(frozen=True)
class PeerPin:
    """What a peer's certificate must be: one of these key fingerprints and/or issued by one of these CAs."""

    name: str
    spki_sha256: frozenset[str] = frozenset()
    cas: tuple[x509.Certificate, ...] = ()
    ca_files: tuple[Path, ...] = ()

    def refusal(self, cert_pem: bytes | None) -> str | None:
        """Why ``cert_pem`` is not this peer's certificate (``None``: it is)."""
        if not cert_pem:
            return f"no certificate for peer {self.name!r}"
        cert = x509.load_pem_x509_certificate(cert_pem)
        got = spki_sha256(cert)
        if self.spki_sha256 and got not in self.spki_sha256:
            return (f"the certificate presented as {self.name!r} has public key SHA-256 {got[:16]}..., not the one "
                    f"pinned for it ([peers.{self.name}] spki_sha256)")
        if self.cas and not any(issued_by(cert, ca) for ca in self.cas):
            return (f"the certificate presented as {self.name!r} (issuer {cert.issuer.rfc4514_string()!r}) was not "
                    f"issued by the CA pinned for it ([peers.{self.name}] ca = "
                    f"{', '.join(str(f) for f in self.ca_files)})")
        return None


def _fingerprints(value: Any, where: str) -> frozenset[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values:
        raise ValueError(f"{where}: spki_sha256 must be a hex SHA-256 or a list of them")
    out = set()
    for v in values:
        h = str(v).lower().replace(":", "")
        if len(h) != 64 or not set(h) <= _HEX:
            raise ValueError(f"{where}: spki_sha256 {v!r} is not a hex SHA-256 (64 hex digits)")
        out.add(h)
    return frozenset(out)


def read_pins(table: Mapping[str, Any], allowed: Iterable[str], rel: Any, where: str) -> dict[str, PeerPin]:
    """``[peers]`` of a party file: ``{name: {spki_sha256 = ..., ca = FILE}}`` for names on ``allowed_peers``."""
    allowed = set(allowed)
    pins = {}
    for name, entry in table.items():
        here = f"{where} [peers.{name}]"
        if name not in allowed:
            raise ValueError(f"{here}: {name!r} is not on allowed_peers {sorted(allowed)}")
        if not isinstance(entry, dict) or not entry or set(entry) - {"spki_sha256", "ca"}:
            raise ValueError(f"{here}: give spki_sha256 (the peer certificate's public-key SHA-256) and/or ca (the "
                             "CA file that issues it), nothing else")
        fps = _fingerprints(entry["spki_sha256"], here) if "spki_sha256" in entry else frozenset()
        files = [entry["ca"]] if isinstance(entry.get("ca"), str) else list(entry.get("ca", []))
        paths = tuple(rel(f) for f in files)
        cas = tuple(c for f in paths for c in load_certificates(f, here))
        pins[name] = PeerPin(name, fps, cas, paths)
    return pins


def require_pins(names: Iterable[str], pinned: Iterable[str], bundle: Path, where: str, how: str) -> None:
    """Refuse names without a pin when the CA bundle holds several CAs (any of them could issue those names)."""
    loose = sorted(set(names) - set(pinned))
    if loose and bundle_size(bundle) > 1:
        raise ValueError(f"{where}: the CA bundle {bundle} holds {bundle_size(bundle)} certificates, so any of "
                         f"those CAs could issue a certificate named {loose[0]!r}: pin it ({how})")
