"""The lookup channel (issue 35): a keyed party's lookup budget, a ledger in its own state per coordinator identity.

The ledger's arithmetic runs on a fake clock (windows that free up, the total, a restart that reads the file
back, the warning at the threshold, a refusal naming the rule); the party's aligner is driven in process (a
``hello``, a resume and a new aligner (a restart) keep the count).  The enumeration attack of the issue runs against
real ``party serve`` processes: the label holder tests 100,000 candidate IDs through the prediction lookups, first
under the permissive policy (the positive control: every ID only the passive parties hold), then under the default
policy (at most the budget's worth; a resume ``hello``, a new session and a restart do not reset it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import PATIENCE
from partialvfl.data.dataset import VerticalDataset
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.grpc.transport import PartyError
from partialvfl.federation.trust.access_log import read_access_log
from partialvfl.federation.trust.lookups import LOOKUP_LEDGER, LookupLedger
from partialvfl.federation.trust.policy import LOOKUP_FLOOR, PartyPolicy
from partialvfl.federation.trust.psu import PartyAligner, hash_to_group, points_array
from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.privacy.enumeration import CANDIDATES, Enumeration, enumerate_memberships, issue_federation, outsiders

HOUR, DAY = 3600.0, 86400.0
LIMITS = {"max_lookups_per_hour": 100, "max_lookups_per_day": 250, "max_lookups_total": 400}
ALICE, BOB = "a" * 64, "b" * 64  # two coordinators' certificate key fingerprints


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def ledger(path: Path, clock: Clock, warnings: list[str] | None = None) -> LookupLedger:
    return LookupLedger(LIMITS, path, where="party 1 ('shop')", clock=clock,
                        warn=(warnings.append if warnings is not None else None))


def refused(book: LookupLedger, who: str, n: int) -> str:
    with pytest.raises(PolicyViolation) as e:
        book.check(who, n, "coordinator")
    return e.value.rule


# ---------------------------------------------------------------------- the ledger
def test_the_ledger_counts_per_coordinator_over_windows_and_in_total_and_survives_a_restart(tmp_path: Path) -> None:
    clock, warnings = Clock(), []
    path = tmp_path / LOOKUP_LEDGER
    book = ledger(path, clock, warnings)
    book.check(ALICE, 100)
    book.record(ALICE, 100, "coordinator")
    assert refused(book, ALICE, 1) == "max_lookups_per_hour"
    book.check(BOB, 100)  # another coordinator identity has its own budget
    clock.now += HOUR + 60
    book.record(ALICE, 100)
    clock.now += HOUR + 60
    book.record(ALICE, 50)
    assert book.counts(ALICE) == {"max_lookups_per_hour": 50, "max_lookups_per_day": 250, "max_lookups_total": 250}
    assert refused(book, ALICE, 1) == "max_lookups_per_day"
    restarted = ledger(path, clock)  # a new process reads the same ledger
    assert restarted.counts(ALICE) == book.counts(ALICE) and refused(restarted, ALICE, 1) == "max_lookups_per_day"
    clock.now += DAY
    restarted.record(ALICE, 100)
    clock.now += HOUR + 60
    restarted.record(ALICE, 50)
    assert refused(restarted, ALICE, 1) == "max_lookups_total"  # 400: no window frees it
    clock.now += 30 * DAY
    assert refused(restarted, ALICE, 1) == "max_lookups_total"
    assert restarted.counts(BOB)["max_lookups_total"] == 0
    # a warning each time a window passes half of its limit: the hour at each of the first three charges (each hour
    # a new window), the day and the total at the second (200 of 250, 200 of 400); the rest went to the restarted
    # ledger's log
    assert [re.search(r"\[policy\] (\w+)", w)[1] for w in warnings] == [
        "max_lookups_per_hour", "max_lookups_per_hour", "max_lookups_per_day", "max_lookups_total",
        "max_lookups_per_hour"]
    assert warnings[0].startswith("party 1 ('shop'): coordinator 'coordinator' (key aaaaaaaaaaaaaaaa) has made 100 "
                                  "lookups in the last hour, past 50% of this party's budget")


def test_a_refusal_names_the_rule_the_count_and_what_the_party_would_accept(tmp_path: Path) -> None:
    clock = Clock()
    book = ledger(tmp_path / LOOKUP_LEDGER, clock)
    book.record(ALICE, 90, "coordinator")
    with pytest.raises(PolicyViolation) as e:
        book.check(ALICE, 20, "coordinator")
    assert e.value.rule == "max_lookups_per_hour" and e.value.accept == {"max_lookups_per_hour": 110}
    assert str(e.value) == (
        "policy rule 'max_lookups_per_hour': party 1 ('shop') has answered 90 lookups for coordinator 'coordinator' "
        "(key aaaaaaaaaaaaaaaa) in the last hour; 20 more would make 110, more than its budget of 100 ([policy] "
        "max_lookups_per_hour: the budget is this party's, kept in its state; it frees up as lookups age out) (this "
        "party would accept it with [policy] max_lookups_per_hour = 110 in its party.toml)")
    assert book.counts(ALICE)["max_lookups_total"] == 90  # a refusal charges nothing


def test_an_unreadable_ledger_stops_the_party_instead_of_starting_afresh(tmp_path: Path) -> None:
    path = tmp_path / LOOKUP_LEDGER
    path.write_text("{not json")
    with pytest.raises(ValueError, match="lookup ledger .* is unreadable .*deleting it resets"):
        ledger(path, Clock())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 2 * HOUR), st.integers(1, 60)), max_size=40))
def test_no_window_ever_holds_more_than_its_limit(steps: list[tuple[float, int]]) -> None:
    """Whatever the coordinator asks and when: every window's count equals the lookups charged within it (to the
    bucket) and never exceeds its limit."""
    clock = Clock()
    book = LookupLedger(LIMITS, None, clock=clock, warn=lambda _: None)
    charged: list[tuple[float, int]] = []
    for wait, n in steps:
        clock.now += wait
        try:
            book.check(ALICE, n)
        except PolicyViolation:
            continue
        book.record(ALICE, n)
        charged.append((clock.now, n))
        counts = book.counts(ALICE)
        for rule, limit in LIMITS.items():
            assert counts[rule] <= limit
        bucket = 60
        day = sum(k for t, k in charged if t // bucket > (clock.now - DAY) // bucket)
        assert counts["max_lookups_per_day"] == day and counts["max_lookups_total"] == sum(k for _, k in charged)


# ---------------------------------------------------------------------- the policy
def test_the_default_budget_is_a_share_of_the_partys_own_rows_with_a_floor() -> None:
    default = PartyPolicy.default()
    assert default.lookup_limits(1_497) == {"max_lookups_per_day": LOOKUP_FLOOR}
    assert default.lookup_limits(1_000_000) == {"max_lookups_per_day": 1_000_000}
    assert PartyPolicy.research().lookup_limits(1_000_000) == {}
    policy = PartyPolicy.from_table({"max_lookups_per_hour": 500, "max_lookups_per_day": "250%",
                                     "max_lookups_total": 10**6, "lookup_warn_fraction": 0.8})
    assert policy.lookup_limits(100_000) == {"max_lookups_per_hour": 500, "max_lookups_per_day": 250_000,
                                             "max_lookups_total": 10**6}
    for table, says in (({"max_lookups_per_day": "lots"}, "max_lookups_per_day must be a number of lookups or a "
                                                          "share of the party's training rows such as \"100%\""),
                        ({"max_lookups_per_day": 1.5}, "max_lookups_per_day must be an integer"),
                        ({"lookup_warn_fraction": 2}, "lookup_warn_fraction must be a number in (0, 1]")):
        with pytest.raises(ValueError, match=re.escape(says)):
            PartyPolicy.from_table(table, "party.toml: [policy]")


# ---------------------------------------------------------------------- the party's aligner
def _points(n: int, start: int = 0) -> np.ndarray:
    return points_array(hash_to_group([f"C{i:06d}" for i in range(start, start + n)]))


def test_neither_a_hello_nor_a_resume_nor_a_restart_resets_the_budget(tmp_path: Path) -> None:
    """Issue 35: the per-session counter reset on any hello, a resume included, so the same 1,950,001 points passed
    the check again."""
    def party(**kw: Any) -> PartyAligner:
        clock = Clock()
        book = LookupLedger({"max_lookups_per_day": 30}, tmp_path / LOOKUP_LEDGER, clock=clock, warn=lambda _: None)
        p = PartyAligner("shop", b"s" * 32, lambda t: ["x"], tmp_path, ledger=book, **kw)
        p.caller = ALICE
        return p

    shop = party(max_lookups=25)
    salt = [shop.open()["nonce"]]
    shop.evaluate(_points(20), salt)
    shop.new_session(resumed=True)  # a resume hello: the same session, its count goes on
    salt = [shop.open()["nonce"]]
    with pytest.raises(PolicyViolation, match="'max_lookups'"):
        shop.evaluate(_points(10, 100), salt)
    shop.new_session()  # a new session: max_lookups counts afresh, the day's budget does not
    salt = [shop.open()["nonce"]]
    with pytest.raises(PolicyViolation, match="'max_lookups_per_day'"):
        shop.evaluate(_points(11, 200), salt)
    shop.evaluate(_points(10, 300), salt)
    restarted = party()  # a restart: the ledger is read back from the party's state
    salt = [restarted.open()["nonce"]]
    with pytest.raises(PolicyViolation, match="'max_lookups_per_day'.*has answered 30 lookups"):
        restarted.evaluate(_points(1, 400), salt)
    restarted.caller = BOB  # another coordinator identity (another certificate key) has its own
    restarted.evaluate(_points(1, 400), salt)


# ---------------------------------------------------------------------- the enumeration, against real parties
@pytest.fixture(scope="module")
def issue_data() -> VerticalDataset:
    data = issue_federation()
    assert data.observed.sum(axis=0).tolist() == [1497, 1097, 1200] and len(outsiders(data)) == 1194
    return data


def _started(tmp: Path, data: VerticalDataset, policy: Any) -> LocalDeployment:
    dep = LocalDeployment(tmp, data, deadline=PATIENCE, start_timeout=600.0, alignment="psu", policy=policy)
    dep.start()
    return dep


def _partner_only(found: Enumeration) -> set[str]:
    return {i for i, parties in found.held.items() if parties and 2 not in parties}  # the insurer is party 2


@pytest.mark.slow
def test_the_enumeration_learns_every_partner_only_id_without_a_budget_and_a_budgets_worth_with_the_default(
        issue_data: VerticalDataset, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    candidates = [f"C{i:06d}" for i in range(CANDIDATES)]
    targets = outsiders(issue_data)

    # positive control: the permissive (research) policy answers every lookup: every partner-only ID, no false one
    dep = _started(tmp_path / "permissive", issue_data, "research")
    try:
        fed = dep.federation()
        try:
            control = enumerate_memberships(fed, candidates)
        finally:
            fed.close()
    finally:
        dep.close()
    assert control.refusal is None and control.tested == CANDIDATES and _partner_only(control) == targets

    # the default policy: each keyed party answers at most its day's budget for this coordinator
    dep = _started(tmp_path / "default", issue_data, "default")
    try:
        budget = sum(PartyPolicy.default().lookup_limits(int(issue_data.observed[:, k].sum()))["max_lookups_per_day"]
                     for k in (0, 1))
        assert budget == 2 * LOOKUP_FLOOR
        aligned = 1200  # the label holder's own rows, evaluated once in the session's alignment
        fed = dep.federation()
        try:
            found = enumerate_memberships(fed, candidates)
        finally:
            fed.close()
        learned = _partner_only(found)
        assert found.refusal is not None and "policy rule 'max_lookups_per_day'" in found.refusal
        assert found.tested == budget - aligned and learned <= targets and len(learned) <= found.tested
        with capsys.disabled():
            print(f"\nenumeration of {CANDIDATES:,} candidates: permissive policy {len(targets):,} of {len(targets):,} "
                  f"partner-only IDs in {control.seconds:.1f} s; default policy {len(learned):,} of {len(targets):,} "
                  f"in its first day ({found.tested:,} candidates tested in {found.seconds:.1f} s, then refused; "
                  f"budget {budget:,} lookups a day over the two keyed parties)")  # docs/deployment.md quotes it

        def refused_again(**kw: Any) -> None:
            """The budget a new ``hello`` finds is the one left, and more than that is refused."""
            fed = dep.federation(**kw)
            try:
                assert [fed.party_info[k]["lookups"]["used"]["max_lookups_per_day"] for k in (0, 1)] == used
                with pytest.raises(PartyError, match="policy rule 'max_lookups_per_day'"):
                    fed.attach_ids(candidates[found.tested:found.tested + 10_000])
            finally:
                fed.close()

        fed = dep.federation()
        used = [fed.party_info[k]["lookups"]["used"]["max_lookups_per_day"] for k in (0, 1)]
        fed.close()
        assert used == [LOOKUP_FLOOR, LOOKUP_FLOOR]  # each keyed party's day, spent to the last lookup
        refused_again()  # a new session
        secrets = tmp_path / "coordinator" / "sessions.json"
        held = dep.federation(session_file=secrets)  # a session, left open (no bye) ...
        refused_again(session_file=secrets)  # ... resumed by a hello with its secret
        held.grpc_transport.close()
        dep.kill(0)
        dep.kill(1)
        dep.start([0, 1])  # a restart of both keyed parties
        refused_again()
        for k, name in ((0, "bank"), (1, "shop")):
            entries = [e for e in read_access_log(dep.dir / "state" / name / "access.log") if e["kind"] == "psu_eval"]
            served = [e for e in entries if e["outcome"] == "served"]
            assert sum(e["request"]["points"][0][0] for e in served) == LOOKUP_FLOOR
            assert served[-1]["lookups"]["max_lookups_per_day"] == LOOKUP_FLOOR
            assert any(e["outcome"] == "refused" and "'max_lookups_per_day'" in e["reason"] for e in entries)
            log = (dep.dir / f"party-{k}.log").read_text()
            assert "past 50% of this party's budget ([policy] max_lookups_per_day = 10,000)" in log
            assert len(list((dep.dir / "state" / name).glob(LOOKUP_LEDGER))) == 1
    finally:
        dep.close()
