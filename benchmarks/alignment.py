"""Keyless alignment (private set union) against the old HMAC path, with real party processes over gRPC (issue 24).

K parties hold ``--ids`` customers each: a core of ``overlap * ids`` every party holds, the rest each party's own.
Party 0 is the label holder (its party process holds no alignment key, as in a deployment); the coordinator's label
table labels ``--labels`` of party 0's customers.  One JSON line per run:

* ``seconds``: ``GrpcFederation.align()`` in a fresh session (every party's tokens, the coordinator's label tokens,
  matching, and attaching the rows at every party); ``hmac_seconds``: the same call with ``alignment = "hmac"``;
* ``blindings_per_second_per_core``: ristretto255 scalar multiplications per second on one core of this machine
  (``hash_to_group_per_second``: the hash into the group);
* ``bytes_per_id``: bytes on the wire (both directions, whole frames) during ``align()``, per ID a party holds;
* ``lookup_seconds``: tokens of ``--lookup`` new IDs in an aligned session (one round to one keyed party);
  ``predict_lookup_seconds``: ``attach_ids`` of those IDs from the parties' ``new-users`` prediction tables in a fresh
  session (the whole of what ``predict --table-set`` does before predicting);
* ``party_peak_rss_mb``: each party process's peak resident memory (``VmHWM``) after the alignment, and
  ``coordinator_peak_rss_mb`` this process's; ``load_before``: the machine's 1-minute load average at the start.

Before and after a change: run it with the old code first (``PYTHONPATH=OLD/src``: this script runs on both), then
with this checkout; ``--skip-hmac`` leaves out the HMAC comparison.

    PYTHONPATH=src python benchmarks/alignment.py --parties 4 --ids 100000
    PYTHONPATH=OLD/src python benchmarks/alignment.py --parties 4 --ids 1000000 --lookup 0 --skip-hmac   # before
    PYTHONPATH=src python benchmarks/alignment.py --parties 4 --ids 1000000 --lookup 0 --skip-hmac       # after

``--ray-party N --ray ADDRESS``: instead, one keyed party's ``psu_tokens`` step (the hash into the group and the
multiplication, for N IDs) with its group arithmetic on the Ray cluster at ADDRESS (``local``: Ray started here on
this machine's cores), against the same on this machine's cores: seconds and this process's peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.data.dataset import Task, VerticalDataset
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.trust import psu


def make_data(parties: int, ids: int, overlap: float, labels: float, seed: int, prefix: str = "C",
              ) -> VerticalDataset:
    core = int(round(overlap * ids))
    own = ids - core
    n = core + parties * own
    observed = np.zeros((n, parties), dtype=bool)
    observed[:core] = True
    for k in range(parties):
        observed[core + k * own: core + (k + 1) * own, k] = True
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)  # customer numbers in no particular order
    observed = observed[perm]
    labeled = observed[:, 0] & (rng.random(n) < labels)
    y = np.where(labeled, rng.integers(0, 2, n), -1)
    blocks = [np.where(observed[:, [k]], rng.normal(size=(n, 1)), np.nan).astype(np.float32) for k in range(parties)]
    return VerticalDataset(blocks, observed, ids=np.array([f"{prefix}{i:09d}" for i in range(n)], dtype=object),
                           y=y, labeled=labeled, task=Task.classification([0, 1]), active_party=0,
                           party_names=[f"p{k}" for k in range(parties)])


def per_core_rates(n: int = 20_000) -> tuple[float, float]:
    texts = [f"x{i}" for i in range(n)]
    t0 = time.perf_counter()
    points = psu.hash_to_group(texts)
    t1 = time.perf_counter()
    psu.evaluate(points, psu.random_scalar(), "benchmark")
    t2 = time.perf_counter()
    return n / (t2 - t1), n / (t1 - t0)


def peak_rss_mb(pid: int | str = "self") -> float | None:
    """A process's peak resident memory (``VmHWM``) in MB, ``None`` if it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def timed_align(dep: LocalDeployment) -> tuple[float, int, Any]:
    fed = dep.federation()
    try:
        before = fed.grpc_transport.bytes_sent + fed.grpc_transport.bytes_received
        t0 = time.perf_counter()
        view, handle = fed.align()
        seconds = time.perf_counter() - t0
        wire = fed.grpc_transport.bytes_sent + fed.grpc_transport.bytes_received - before
        fed.release(handle)
        return seconds, wire, view
    finally:
        fed.close()


def lookups(dep: LocalDeployment, new_ids: np.ndarray) -> tuple[float, float]:
    fed = dep.federation()
    try:
        view, handle = fed.align()
        fed.release(handle)
        t0 = time.perf_counter()
        fed.id_tokens(new_ids)
        lookup = time.perf_counter() - t0
    finally:
        fed.close()
    fed = dep.federation()
    try:
        t0 = time.perf_counter()
        pview, handle = fed.attach_ids(new_ids, table="new-users")
        predict = time.perf_counter() - t0
        assert pview.observed.all(), "every party serves the new users"
    finally:
        fed.close()
    return lookup, predict


def run(args: argparse.Namespace) -> dict[str, Any]:
    data = make_data(args.parties, args.ids, args.overlap, args.labels, args.seed)
    new = make_data(args.parties, max(args.lookup, 1), 1.0, 0.0, args.seed + 1, prefix="N")
    out: dict[str, Any] = {"parties": args.parties, "ids_per_party": args.ids, "overlap": args.overlap,
                           "union": data.n_samples, "labels": int(data.labeled.sum()), "cpu_cores": os.cpu_count(),
                           "party_threads": args.threads}
    out["blindings_per_second_per_core"], out["hash_to_group_per_second"] = (round(r) for r in per_core_rates())
    kw = {"deadline": 1800.0, "start_timeout": 900.0, "max_message_mb": 512.0, "threads": args.threads}
    with tempfile.TemporaryDirectory() as d:
        with LocalDeployment(Path(d) / "psu", data, predict={"new-users": new}, **kw) as dep:
            dep.start()
            seconds, wire, view = timed_align(dep)
            assert view.n_samples == data.n_samples and view.observed.sum() == data.observed.sum()
            out["seconds"] = round(seconds, 2)
            out["bytes_per_id"] = round(wire / (args.parties * args.ids), 1)
            out["party_peak_rss_mb"] = [peak_rss_mb(dep.procs[k].pid) for k in sorted(dep.procs)]
            out["coordinator_peak_rss_mb"] = peak_rss_mb()
            if args.lookup:
                lookup, predict = lookups(dep, new.ids)
                out.update(lookup_ids=args.lookup, lookup_seconds=round(lookup, 3),
                           predict_lookup_seconds=round(predict, 3))
        if args.skip_hmac:
            return out
        with LocalDeployment(Path(d) / "hmac", data, alignment="hmac", **kw) as dep:
            dep.start()
            seconds, wire, _ = timed_align(dep)
            out["hmac_seconds"] = round(seconds, 2)
            out["hmac_bytes_per_id"] = round(wire / (args.parties * args.ids), 1)
    return out


def ray_party(args: argparse.Namespace) -> dict[str, Any]:
    """One keyed party's ``psu_tokens`` of ``--ray-party`` IDs on the Ray cluster, then on this machine's cores."""
    from partialvfl.federation.trust.group_work import GroupWork

    ids = np.array([f"C{i:09d}" for i in range(args.ray_party)], dtype=object)
    out: dict[str, Any] = {"ids": args.ray_party, "ray": args.ray, "cpu_cores": os.cpu_count(),
                           "load_before": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory() as d:
        for where, work in (("ray", GroupWork(ray_address=args.ray)), ("local", GroupWork())):
            if where == "local" and args.skip_local:
                continue
            party = psu.PartyAligner("p1", b"k" * 32, lambda table: ids, Path(d) / where)
            party.work = work
            party.nonce = "ab" * 32
            t0 = time.perf_counter()
            tokens, _ = party.tokens("training", ["ab" * 32])
            out[f"{where}_seconds"] = round(time.perf_counter() - t0, 1)
            out[f"{where}_peak_rss_mb"] = peak_rss_mb()
            if where == "ray":
                import ray

                out["ray_cluster_cpus"] = ray.cluster_resources().get("CPU")
            del tokens, party
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parties", type=int, default=4)
    ap.add_argument("--ids", type=int, default=100_000, help="IDs per party")
    ap.add_argument("--overlap", type=float, default=0.6, help="share of each party's IDs every party holds")
    ap.add_argument("--labels", type=float, default=0.1, help="share of the label holder's IDs with a label")
    ap.add_argument("--lookup", type=int, default=1000, help="new IDs to look up (0: skip)")
    ap.add_argument("--threads", type=int, default=2, help="threads per party process ([party] threads)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hmac", action="store_true", help="leave out the HMAC comparison")
    ap.add_argument("--ray-party", type=int, default=0, metavar="N", help="measure one party's tokens of N IDs on Ray")
    ap.add_argument("--ray", default="local", metavar="ADDRESS", help="the Ray cluster for --ray-party")
    ap.add_argument("--skip-local", action="store_true", help="with --ray-party: not on this machine's cores too")
    args = ap.parse_args()
    for _ in range(args.repeats):
        print(json.dumps(ray_party(args) if args.ray_party else {"load_before": round(os.getloadavg()[0], 2),
                                                                   **run(args)}), flush=True)


if __name__ == "__main__":
    main()
