"""What crosses a party boundary, measured: attacks that a curious party or coordinator can run on what it receives
(label inference, which rows are labelled, feature reconstruction; and, in :mod:`partialvfl.privacy.enumeration`,
which needs the gRPC extra, the label holder's enumeration of other parties' customers through online lookups), the
recorder they read from, and the runs of the privacy-utility report. The mechanisms that bound them live with the
code they protect: the label holder's label DP in :mod:`partialvfl.methods.label_dp`, each party's own budget in
:mod:`partialvfl.federation.dp.gaussian`.

Layer: above ``methods`` (it fits models to attack them), below ``bench`` and ``cli``.
"""

from partialvfl.privacy.label_attacks import (
    GradientObservation,
    gradient_observations,
    label_attack,
    labeled_rows_attack,
    row_counts,
)
from partialvfl.privacy.reconstruction import (
    decode_oracle,
    direct_release_attack,
    known_row_attack,
    relative_rmse,
    released_per_row,
    ridge,
)
from partialvfl.privacy.recording import Recorded, Recorder

__all__ = [
    "GradientObservation", "Recorded", "Recorder", "decode_oracle", "direct_release_attack", "gradient_observations",
    "known_row_attack", "label_attack", "labeled_rows_attack", "relative_rmse", "released_per_row", "ridge",
    "row_counts",
]

#: names spelt the other way until this release, kept for one release with a DeprecationWarning
_RENAMED = {"labelled_rows_attack": "labeled_rows_attack"}


def __getattr__(name: str) -> object:
    if name in _RENAMED:
        import warnings

        warnings.warn(f"partialvfl.privacy.{name} is now {_RENAMED[name]}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module 'partialvfl.privacy' has no attribute {name!r}")
