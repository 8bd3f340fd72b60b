"""FALSE-VFL I (MAR) and II (MNAR): declaration (:mod:`.spec`), formulas, party program and coordinator."""

from partialvfl.methods.false_vfl.coordinator import FalseVFL1, FalseVFL2
from partialvfl.methods.false_vfl.formulas import (
    fuse_posteriors,
    gaussian_log_density,
    latent_log_weights,
    predictive_log_probs,
    reparameterize,
    snis_weights,
    split_gaussian,
)
from partialvfl.methods.false_vfl.party import ALLOWED_TENSORS, FalseVFLParty, allowed_tensors
from partialvfl.methods.false_vfl.spec import FUSION_RULES, PAPER_ROWS, paper_row

__all__ = [
    "ALLOWED_TENSORS", "FUSION_RULES", "FalseVFL1", "FalseVFL2", "FalseVFLParty", "PAPER_ROWS", "allowed_tensors",
    "fuse_posteriors",
    "gaussian_log_density", "latent_log_weights", "paper_row", "predictive_log_probs", "reparameterize",
    "snis_weights", "split_gaussian",
]
