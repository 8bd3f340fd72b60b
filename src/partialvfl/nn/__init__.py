"""Layer 2: neural building blocks and log-space helpers."""

from partialvfl.nn.blocks import MLP, CNNEncoder, ResNet18, TransposedCNNDecoder, build_decoder, build_encoder
from partialvfl.nn.stats import bernoulli_log_prob, gaussian_log_prob, log_mean_exp, normalized_weights

__all__ = [
    "CNNEncoder", "MLP", "ResNet18", "TransposedCNNDecoder", "bernoulli_log_prob", "build_decoder", "build_encoder",
    "gaussian_log_prob", "log_mean_exp", "normalized_weights",
]
