"""A keyed party's lookup budget: how many IDs it raises to its alignment key for each coordinator, kept in a ledger
in the party's own state, over time windows and in total.

A lookup (``psu_eval``, :mod:`partialvfl.federation.trust.psu`) gives the coordinator the token of one ID of its choice
in the session's key, so it can test that ID against every party's tokens: which parties hold it.  The points are
blinded, so the party cannot tell a new user the label holder wants predicted from a guess at another party's
customers (issue 35: 1,194 of 1,194 partner-only IDs in 26 s).  What the party can do is count: every point it
evaluates is charged to the coordinator identity that asked (the SHA-256 of its certificate's public key), in
one-minute buckets, and a request that would take a window over its limit is refused before anything is computed
(:class:`~partialvfl.federation.wire.refusals.PolicyViolation` naming the ``[policy]`` rule: ``max_lookups_per_hour``,
``max_lookups_per_day`` or ``max_lookups_total``).  Like the differential-privacy ledger
(:mod:`partialvfl.federation.dp.gaussian`) the ledger is a file in the party's state directory (``lookup-ledger.json``),
written before the reply leaves: no ``hello``, resume, new session or restart resets it; a window frees up only as
its lookups age out.  A warning line goes to the party's log (stderr) when a window passes ``lookup_warn_fraction``
of its limit.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.utils.private_files import write_private_json

__all__ = ["BUCKET_SECONDS", "LOOKUP_LEDGER", "WINDOWS", "LookupLedger"]

#: the ledger's file in a party's state directory
LOOKUP_LEDGER = "lookup-ledger.json"
#: the rules with a time window, and its length in seconds (``max_lookups_total`` has none)
WINDOWS: dict[str, float] = {"max_lookups_per_hour": 3600.0, "max_lookups_per_day": 86400.0}
#: what each rule counts, in words
SPANS = {"max_lookups_per_hour": "in the last hour", "max_lookups_per_day": "in the last 24 hours",
         "max_lookups_total": "in total"}
#: lookups are counted in buckets of this many seconds (a window frees up at most this much early)
BUCKET_SECONDS = 60
log = logging.getLogger("partialvfl.party")


class LookupLedger:
    """Lookups answered per coordinator identity: one-minute buckets over the longest window, and the total.

    ``limits``: ``{rule: limit}`` for the rules of :data:`SPANS` that bound anything; ``path``: the ledger file
    (``None``: in memory); ``where``: the party, for messages; ``clock``: seconds since the epoch (a restart must
    find the same times); ``warn``: where the threshold warnings go.
    """

    def __init__(self, limits: Mapping[str, int], path: str | Path | None = None, *, where: str = "this party",
                 warn_fraction: float = 0.5, clock: Callable[[], float] = time.time,
                 warn: Callable[[str], None] | None = None) -> None:
        unknown = sorted(set(limits) - set(SPANS))
        if unknown:
            raise ValueError(f"unknown lookup rule(s) {unknown}; known: {sorted(SPANS)}")
        self.limits = {rule: int(v) for rule, v in limits.items()}
        self.path = Path(path) if path is not None else None
        self.where = where
        self.warn_fraction = float(warn_fraction)
        self.clock = clock
        self.warn = warn if warn is not None else log.warning
        self.horizon = max(WINDOWS.values())
        self._book: dict[str, dict[str, Any]] = {}
        if self.path is not None and self.path.is_file():
            self._book = self._read(self.path)

    # ------------------------------------------------------------------ reading
    def _read(self, path: Path) -> dict[str, dict[str, Any]]:
        try:
            raw = json.loads(path.read_text())
            book = {str(who): {"name": str(e.get("name", "")), "total": int(e["total"]),
                               "buckets": [[int(b), int(n)] for b, n in e["buckets"]]}
                    for who, e in raw["coordinators"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            # a ledger the party cannot read must not become an empty (fresh) one: refuse to start
            raise ValueError(f"{self.where}: its lookup ledger {path} is unreadable ({type(e).__name__}); restore it "
                             "from a backup (deleting it resets every coordinator's lookup budget)") from None
        return book

    def counts(self, who: str) -> dict[str, int]:
        """Lookups charged to ``who``, per rule of :data:`SPANS` (every rule, bounded or not)."""
        entry = self._book.get(who)
        now = self.clock()
        out = {}
        for rule in SPANS:
            if entry is None:
                out[rule] = 0
            elif rule in WINDOWS:
                start = (now - WINDOWS[rule]) // BUCKET_SECONDS
                out[rule] = sum(n for b, n in entry["buckets"] if b > start)
            else:
                out[rule] = int(entry["total"])
        return out

    # ------------------------------------------------------------------ charging
    def check(self, who: str, n: int, name: str = "") -> None:
        """Refuse (:class:`PolicyViolation`, naming the rule) ``n`` more lookups for ``who`` if any bounded window
        would then hold more than its limit; charges nothing."""
        counts = self.counts(who)
        for rule, limit in self.limits.items():
            after = counts[rule] + n
            if after > limit:
                whom = _whom(who, name or self._book.get(who, {}).get("name", ""))
                raise PolicyViolation(rule, f"{self.where} has answered {counts[rule]:,} lookups for {whom} "
                                      f"{SPANS[rule]}; {n:,} more would make {after:,}, more than its budget of "
                                      f"{limit:,} ({_frees(rule)})", after, {rule: after})

    def record(self, who: str, n: int, name: str = "") -> dict[str, int]:
        """Charge ``n`` lookups to ``who`` now, write the ledger, warn on a window passing its threshold; returns
        the counts after."""
        before = self.counts(who)
        entry = self._book.setdefault(who, {"name": name, "total": 0, "buckets": []})
        name = entry["name"] = name or entry["name"]
        now = self.clock()
        bucket = int(now // BUCKET_SECONDS)
        keep = (now - self.horizon) // BUCKET_SECONDS
        buckets = [b for b in entry["buckets"] if b[0] > keep]
        if buckets and buckets[-1][0] == bucket:
            buckets[-1][1] += int(n)
        else:
            buckets.append([bucket, int(n)])
        entry["buckets"] = buckets
        entry["total"] += int(n)
        self.save()
        after = self.counts(who)
        for rule, limit in self.limits.items():
            threshold = self.warn_fraction * limit
            if before[rule] < threshold <= after[rule]:
                self.warn(f"{self.where}: {_whom(who, name)} has made {after[rule]:,} lookups {SPANS[rule]}, past "
                          f"{self.warn_fraction:.0%} of this party's budget ([policy] {rule} = {limit:,}); it refuses "
                          "psu_eval beyond it (every lookup tests one ID against every party's customers)")
        return after

    def save(self) -> None:
        """Write the ledger atomically (readable by the party's owner only)."""
        if self.path is not None:
            write_private_json(self.path, {"version": 1, "bucket_seconds": BUCKET_SECONDS, "coordinators": self._book})


def _whom(who: str, name: str) -> str:
    key = f"key {who[:16]}" if len(who) == 64 else repr(who)
    return f"coordinator {name!r} ({key})" if name else f"coordinator {key}"


def _frees(rule: str) -> str:
    if rule in WINDOWS:
        return f"[policy] {rule}: the budget is this party's, kept in its state; it frees up as lookups age out"
    return f"[policy] {rule}: the budget is this party's, kept in its state; only the party can raise it"
