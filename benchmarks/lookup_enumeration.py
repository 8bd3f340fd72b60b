"""The lookup enumeration of issue 35, measured: the label holder asks for predictions of 100,000 candidate IDs and
reads which parties hold each one, against real party processes of the issue's federation (bank 1,497 and shop 1,097
customers, the keyed parties; the insurer, the label holder, 1,200; :mod:`partialvfl.privacy.enumeration`).

One JSON line per policy: the partner-only IDs learned (of 1,194), the candidates answered, the seconds, the first
words of the refusal that stopped it.  ``default``: the policy a deployed party gets (its lookup budget);
``research``: the permissive one (the positive control).  ``--party-src`` runs the parties from another checkout's
``src`` (the attacker stays this one): the "before" figure, where the default policy answered every lookup:

    PYTHONPATH=src python benchmarks/lookup_enumeration.py
    PYTHONPATH=src python benchmarks/lookup_enumeration.py --policies default --party-src /path/to/older/src
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.privacy.enumeration import CANDIDATES, enumerate_memberships, issue_federation, outsiders


def run(policy: str, directory: Path, party_src: Path | None = None) -> dict[str, object]:
    data = issue_federation()
    targets = outsiders(data)
    dep = LocalDeployment(directory, data, deadline=300.0, start_timeout=600.0, alignment="psu", policy=policy,
                          pythonpath=[party_src] if party_src else ())
    dep.start()
    try:
        fed = dep.federation()
        try:
            found = enumerate_memberships(fed, [f"C{i:06d}" for i in range(CANDIDATES)])
        finally:
            fed.close()
    finally:
        dep.close()
    active = data.active_party
    learned = {i for i, parties in found.held.items() if parties and active not in parties}
    return {"policy": policy, "parties_from": str(party_src or "this checkout"), "candidates": CANDIDATES,
            "partner_only": len(targets), "learned": len(learned & targets), "false": len(learned - targets),
            "answered": found.tested, "seconds": round(found.seconds, 1), "refusal": (found.refusal or None)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="research,default", help="comma-separated: research, default")
    ap.add_argument("--party-src", type=Path, help="run the party processes from this src folder (another checkout)")
    ap.add_argument("--json", type=Path, help="also write the lines here")
    a = ap.parse_args(argv)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy in a.policies.split(","):
            line = run(policy, Path(tmp) / policy, a.party_src)
            print(json.dumps(line), flush=True)
            lines.append(line)
    if a.json:
        a.json.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
