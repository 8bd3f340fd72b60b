"""A development certificate authority and per-identity certificates (``partialvfl certs init``).

For trying a deployment on one machine or a test network only: the CA key sits next to the certificates.  Between
institutions use certificates from the institutions' own PKI (see ``docs/deployment.md``): all that partialvfl needs
is a CA bundle that signs every peer, and for each identity a certificate whose CN or a DNS SAN is the identity
name listed in the configuration files.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["init_dev_pki", "issue_certificate", "make_ca"]

_VALID_DAYS = 365


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)


def make_ca(directory: str | Path, name: str = "partialvfl development CA") -> tuple[Path, Path]:
    """Write ``ca.pem`` and ``ca.key`` (a self-signed P-256 CA) into ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=_VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write(d / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
    _write(d / "ca.key", _key_pem(key), private=True)
    return d / "ca.pem", d / "ca.key"


def issue_certificate(
    directory: str | Path, identity: str, *, ca_cert: str | Path, ca_key: str | Path,
    hosts: Sequence[str] = ("localhost", "127.0.0.1"),
) -> tuple[Path, Path]:
    """Write ``<identity>.pem``/``<identity>.key``: CN and a DNS SAN = ``identity`` (plus ``hosts``), usable as
    both TLS server and client certificate, signed by the given CA."""
    if not identity or any(c in identity for c in "/\\ "):
        raise ValueError(f"identity {identity!r} must be a non-empty name without spaces or slashes")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca = x509.load_pem_x509_certificate(Path(ca_cert).read_bytes())
    ca_private = serialization.load_pem_private_key(Path(ca_key).read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(identity)]
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            if h != identity:
                sans.append(x509.DNSName(h))
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity)]))
        .issuer_name(ca.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=_VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .sign(ca_private, hashes.SHA256())
    )
    _write(d / f"{identity}.pem", cert.public_bytes(serialization.Encoding.PEM))
    _write(d / f"{identity}.key", _key_pem(key), private=True)
    return d / f"{identity}.pem", d / f"{identity}.key"


def init_dev_pki(
    directory: str | Path, identities: Sequence[str], *, hosts: Sequence[str] = ("localhost", "127.0.0.1"),
) -> dict[str, tuple[Path, Path]]:
    """A fresh CA plus one certificate per identity (parties and the coordinator) in ``directory``."""
    if len(set(identities)) != len(identities):
        raise ValueError(f"identities must be unique, got {list(identities)}")
    ca_cert, ca_key = make_ca(directory)
    return {name: issue_certificate(directory, name, ca_cert=ca_cert, ca_key=ca_key, hosts=hosts)
            for name in identities}
