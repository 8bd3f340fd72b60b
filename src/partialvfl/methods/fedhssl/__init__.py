"""FedHSSL: declaration (:mod:`.spec`), networks, party program and coordinator."""

from partialvfl.methods.fedhssl.coordinator import FedHSSL
from partialvfl.methods.fedhssl.networks import average_state_dicts, split_encoder
from partialvfl.methods.fedhssl.party import FedHSSLParty

__all__ = ["FedHSSL", "FedHSSLParty", "average_state_dicts", "split_encoder"]
