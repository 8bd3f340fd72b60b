"""Running a deployment: ``party serve`` (one institution's server) and ``certs init`` (development certificates)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_commands", "run_certs_init", "run_party_serve"]


def add_commands(sub: Any) -> None:
    """Add ``party serve`` and ``certs init`` to the ``partialvfl`` sub-parsers."""
    from partialvfl.cli.vocabulary import add_old_spelling

    party = sub.add_parser("party", help="run one institution's party: `party serve`, its gRPC server (mutual TLS)")
    psub = party.add_subparsers(dest="party_command", required=True)
    serve = psub.add_parser("serve", help="serve this party over gRPC with mutual TLS until stopped",
                            description="Serve this institution's party over gRPC with mutual TLS until stopped "
                                        "(SIGTERM/SIGINT). The label holder's HTTP prediction service is another "
                                        "command: `partialvfl serve`.")
    serve.add_argument("--config", required=True, help="the party's TOML configuration file")
    serve.set_defaults(func=run_party_serve)

    certs = sub.add_parser("certs", help="development certificates for a federation")
    csub = certs.add_subparsers(dest="certs_command", required=True)
    init = csub.add_parser("init", help="make a development CA, one certificate per party, the passive parties' "
                                        "alignment key and configuration templates with the pins")
    init.add_argument("directory", help="where to write ca.pem, <name>.pem/.key, alignment.key and the templates")
    init.add_argument("--parties", nargs="+", required=True,
                      help="party identities (certificate names), in the federation file's order")
    init.add_argument("--active", default=None, metavar="PARTY",
                      help="the label holder, one of --parties: it and the coordinator get no alignment key "
                           "(default: the last party named)")
    init.add_argument("--coordinator", default="coordinator", help="the coordinator's identity (default: %(default)s)")
    init.add_argument("--hosts", nargs="*", default=["localhost", "127.0.0.1"],
                      help="extra DNS names / IPs in every certificate (default: %(default)s)")
    init.add_argument("--write-hmac-key", dest="hmac_key", action="store_true",
                      help="also write hmac.key, for alignment = 'hmac' (one trust domain only: whoever holds it can "
                           "test IDs against every party's hashes)")
    add_old_spelling(init, "--hmac-key", dest="hmac_key", new="--write-hmac-key", flag=True)
    init.add_argument("--local", action="store_true",
                      help="templates for a trial on this machine: parties listen on 127.0.0.1 at free ports "
                           "(named in federation.toml), write a port_file and carry a [policy] table")
    add_old_spelling(init, "--no-hmac-key", dest="hmac_key", flag=True, const=False,  # the old default's opt-out
                     new="nothing (without --write-hmac-key no hmac.key is written)")
    init.set_defaults(func=run_certs_init)


def run_party_serve(args: argparse.Namespace) -> int:
    """Register every method's party program (a broken method is logged, the others are served), then serve the
    party (plus the programs of the plugin modules its configuration names) until SIGTERM/SIGINT, and end the
    process as soon as it stopped (:func:`~partialvfl.federation.grpc.party_process.exit_now`).

    A configuration error, an address already in use or a plugin that does not import is one line and exit 2.
    """
    import logging
    import sys

    from partialvfl.federation.grpc.party_config import load_party_config
    from partialvfl.federation.grpc.party_process import exit_now, run
    from partialvfl.methods import load_all

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_party_config(args.config)  # a bad file fails before the methods are imported
    load_all(skip_broken=True)
    try:
        rc = run(cfg)
    except (OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    exit_now(rc)  # stopped and everything written: out within a second of SIGTERM (no interpreter teardown)


def run_certs_init(args: argparse.Namespace) -> int:
    """``certs init``: development certificates, alignment keys and config templates for a local federation."""
    from partialvfl.federation.grpc.certs import init_dev_pki
    from partialvfl.federation.grpc.templates import free_loopback_ports, write_templates
    from partialvfl.federation.trust.alignment import write_key
    from partialvfl.federation.trust.psu import write_alignment_key

    active = args.parties[-1] if args.active is None else args.active
    if active not in args.parties:
        raise ValueError(f"--active {active!r} is not one of --parties {args.parties}")
    names = [*args.parties, args.coordinator]
    made = init_dev_pki(args.directory, names, hosts=args.hosts)
    d = Path(args.directory)
    print(f"development CA: {d / 'ca.pem'} (key {d / 'ca.key'}: keep it away from the parties)")
    for name, (cert, key) in made.items():
        print(f"  {name}: {cert}, {key}")
    print(f"alignment key: {write_alignment_key(d / 'alignment.key')}: give it to the passive parties only "
          "(alignment_key_file), never to the label holder's coordinator or its own party")
    if args.hmac_key:
        print(f"HMAC key for alignment = 'hmac' (every party and the coordinator; one trust domain only): "
              f"{write_key(d / 'hmac.key')}")
    ports = free_loopback_ports(len(args.parties)) if args.local else None
    written = write_templates(d, args.parties, args.coordinator, hmac=args.hmac_key, active=active, ports=ports)
    how = "--active" if args.active is not None else "the last party named; --active PARTY chooses another"
    print(f"configuration templates with the pins (each party pins the coordinator's key, the coordinator each "
          f"party's certificate; the label holder is {active!r}: {how}): {', '.join(p.name for p in written)}")
    if ports is not None:
        print(f"loopback trial: the parties listen on 127.0.0.1, ports {', '.join(map(str, ports))}; put each "
              f"party's table at its [data] path and the labels at federation.toml's [labels] path, then start "
              f"each with: partialvfl party serve --config {d / '<party>.party.toml'}")
    return 0
