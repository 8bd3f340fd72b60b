"""What the split-network methods share: declaration (:mod:`.spec`), SimSiam pretraining, the party program and
the coordinator base class.  The methods themselves are ``laser_vfl``, ``vanilla_vfl``, ``plug_vfl``, ``local``,
``ensemble`` and ``combinatorial`` in :mod:`partialvfl.methods`."""

from partialvfl.methods.splitnn.coordinator import SplitNNMethod, fit_best_of_pretraining, fuse
from partialvfl.methods.splitnn.party import SplitParty

__all__ = ["SplitNNMethod", "SplitParty", "fit_best_of_pretraining", "fuse"]
