"""X-VFL: declaration (:mod:`.spec`), holders' updates (SGD or PAGE), party program and coordinator.

The partial setting (features missing inside a block) is a property of the data: :mod:`partialvfl.data.within_block`
(re-exported here).
"""

from partialvfl.data.within_block import (
    INFO_KEY,
    incomplete_matrix,
    with_within_block_missing,
    within_block_mask,
    x_vfl_partial_setting,
)
from partialvfl.methods.x_vfl.coordinator import XVFL, _TrainContext
from partialvfl.methods.x_vfl.party import XVFLParty
from partialvfl.methods.x_vfl.updater import _Updater

__all__ = [
    "INFO_KEY", "XVFL", "XVFLParty", "_TrainContext", "_Updater", "incomplete_matrix", "with_within_block_missing",
    "within_block_mask", "x_vfl_partial_setting",
]
