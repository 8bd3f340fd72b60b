"""The values of a party's ``[policy]`` table, type-checked one by one (a wrong type names the key), and its
differential-privacy budget's pair of values; :meth:`~partialvfl.federation.trust.policy.PartyPolicy.from_table`
reads a table through them."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["LOOKUP_RULES", "check_dp_budget", "check_dp_mechanism", "policy_value"]

#: the lookup budget's rules (:mod:`partialvfl.federation.trust.lookups`)
LOOKUP_RULES = ("max_lookups_per_hour", "max_lookups_per_day", "max_lookups_total")


def check_dp_budget(eps: float | None, delta: float | None, where: str) -> None:
    """``dp_epsilon`` and ``dp_delta`` come together: epsilon > 0, 0 < delta < 1."""
    if eps is None and delta is None:
        return
    if eps is None or delta is None:
        missing = "dp_delta" if delta is None else "dp_epsilon"
        raise ValueError(f"{where}: a differential-privacy budget needs both dp_epsilon and dp_delta; {missing} is "
                         "missing (e.g. dp_epsilon = 8, dp_delta = 1e-5)")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"{where}: dp_epsilon must be a positive number, got {eps!r}")
    if not 0 < delta < 1:
        raise ValueError(f"{where}: dp_delta must lie strictly between 0 and 1, got {delta!r}")


def check_dp_mechanism(name: str, eps: float | None, where: str) -> None:
    """``dp_mechanism`` names a declared release mechanism (the package's or a plug-in's of the entry point group
    ``partialvfl.mechanisms``), and one other than the default comes with a budget."""
    from partialvfl.federation.dp.mechanism import get_mechanism, load_mechanisms

    load_mechanisms()
    try:
        get_mechanism(name, "release")
    except ValueError as e:
        raise ValueError(f"{where}: dp_mechanism: {e}") from None
    if eps is None and name != "gaussian":
        raise ValueError(f"{where}: dp_mechanism = {name!r} needs a differential-privacy budget (dp_epsilon, "
                         "dp_delta)")


_INT_KEYS = {"min_hidden_layers", "max_parameters", "max_handles", "max_rewinds", "max_peer_rpcs", "max_lookups",
             *LOOKUP_RULES}
_FLOAT_KEYS = {"max_width_ratio", "min_lr", "max_config_kb", "max_request_mb", "max_setup_width_ratio", "max_lr",
               "max_weight_decay", "max_momentum", "max_grad_norm", "max_peer_mb", "min_latent_scale", "dp_epsilon",
               "dp_delta", "lookup_warn_fraction", "require_label_dp"}
_BOOL_KEYS = {"allow_weight_sharing", "allow_likelihood_release", "persist_alignment", "resume_alignment_by_name",
              "accept_coordinator_features", "allow_explanations"}
_LIST_KEYS = {"programs", "unchecked_programs", "encoders"}


def policy_value(key: str, value: Any, where: str) -> Any:
    """One ``[policy]`` value, type-checked (a wrong type names the key)."""
    if key in _LIST_KEYS:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where}: {key} must be a list of names, got {value!r}")
        return tuple(value)
    if key in _BOOL_KEYS:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
        return value
    if key in LOOKUP_RULES and isinstance(value, str):
        share = value.strip()
        try:
            ok = share.endswith("%") and 0 < float(share[:-1]) < math.inf
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"{where}: {key} must be a number of lookups or a share of the party's training rows "
                             f"such as \"100%\", got {value!r}")
        return share
    if key == "require_label_dp" and not (isinstance(value, int | float) and not isinstance(value, bool)
                                          and 0 < value < math.inf):
        raise ValueError(f"{where}: require_label_dp must be a positive epsilon (the largest label-DP epsilon a fit "
                         f"may use), got {value!r}")
    if key == "lookup_warn_fraction" and not (isinstance(value, int | float) and not isinstance(value, bool)
                                              and 0 < value <= 1):
        raise ValueError(f"{where}: lookup_warn_fraction must be a number in (0, 1], got {value!r}")
    if key == "dp_mechanism":
        if not isinstance(value, str):
            raise ValueError(f"{where}: dp_mechanism must be the name of a release mechanism, got {value!r}")
        return value
    if key == "seed":
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"{where}: seed must be 'secret', 'coordinator' or an integer, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{where}: {key} must be a non-negative number, got {value!r}")
    if key in _INT_KEYS:
        if int(value) != value:
            raise ValueError(f"{where}: {key} must be an integer, got {value!r}")
        return int(value)
    if key in _FLOAT_KEYS:
        return float(value)
    raise ValueError(f"{where}: unknown key {key!r}")  # pragma: no cover - from_table checks the names first
