"""The split-network family: declarations (:mod:`.spec`), SimSiam pretraining, the party program (:mod:`.party`)
and its DP-SGD variant (:mod:`.private`), the coordinator base class, and the methods themselves: :mod:`.laser_vfl`,
:mod:`.vanilla_vfl`, :mod:`.plug_vfl`, :mod:`.local`, :mod:`.ensemble` and :mod:`.combinatorial`."""

from partialvfl.methods.splitnn.coordinator import SplitNNMethod, fit_best_of_pretraining, fuse
from partialvfl.methods.splitnn.party import SplitParty

__all__ = ["SplitNNMethod", "SplitParty", "fit_best_of_pretraining", "fuse"]
