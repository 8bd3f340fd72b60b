"""A late party holds at most one batch per probe interval (issue 46): the batches after a late one go without it at
once, named as timed out, and one batch per ``late_probe_interval`` asks it again (used again once on time)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")


def test_a_late_party_holds_one_batch_per_probe_interval_and_the_batches_between_go_without_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a batch in which a party was late, the next batches go without it (not asked, named as timed out),
    except one per ``late_probe_interval``, which asks it and waits for it as before."""
    from partialvfl.serving import federated
    from partialvfl.serving.federated import FederationPredictor

    clock = [100.0]
    monkeypatch.setattr(federated.time, "monotonic", lambda: clock[0])
    p = object.__new__(FederationPredictor)

    class Fed:
        party_names = ["bank", "shop", "telco"]
        n_parties = 3

    p.fed, p.down, p._ready, p.late_probe_interval, p._probe_at = Fed(), set(), {}, 1.0, 0.0
    p.state = dict.fromkeys(Fed.party_names, "ok")
    p._watch = lambda: None  # type: ignore[method-assign]
    assert p._skipped_late() == set()  # every party on time: nothing skipped (the next probe is due in 1 s)
    assert p._account([(1, 2, "DEADLINE_EXCEEDED: late")]) == (["telco"], [])
    clock[0] += 0.3
    skipped = p._skipped_late()
    assert skipped == {2}  # late last time, not yet time to probe: this batch goes without it
    assert p._account([], skipped) == (["telco"], []) and p.state["telco"] == "timed_out"
    clock[0] += 0.8
    assert p._skipped_late() == set()  # probed: asked and waited for
    assert p._account([]) == ([], []) and p.state["telco"] == "ok"  # on time again: used from now on
    assert p._skipped_late() == set()
