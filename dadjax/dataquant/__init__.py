"""Quantizing data instead of gradients: data quantizers, gradient
correction, importance gate, and the batch stage that combines them:
``dataquant(bits=2, correction="ef_scaled_sign", gate=0.5, gate_mode="sample")``."""

from dadjax.dataquant._codebook import (
    codebook_bits,
    codebook_row_bits,
    decode_codebook,
    encode_codebook,
    fit_codebook,
    kmeans,
    merge_codebooks,
)
from dadjax.dataquant._correction import correction_term
from dadjax.dataquant._gate import (
    GATE_MODES,
    SCORES,
    GateDecision,
    grad_norm_scores,
    loss_scores,
    sample_gate,
    send_probabilities,
    threshold_gate,
)
from dadjax.dataquant._labels import decode_labels, encode_labels, label_bits
from dadjax.dataquant._stage import QUANTIZERS, DataQuantState, dataquant
from dadjax.dataquant import _methods  # registers the "dataquant" method
from dadjax._core.quantize import (
    SCALES,
    UniformPayload,
    dequantize_uniform,
    quantize_uniform,
    uniform_header_bits,
    uniform_row_bits,
)

__all__ = [
    "codebook_bits",
    "codebook_row_bits",
    "correction_term",
    "dataquant",
    "DataQuantState",
    "decode_codebook",
    "decode_labels",
    "dequantize_uniform",
    "encode_codebook",
    "encode_labels",
    "fit_codebook",
    "GATE_MODES",
    "GateDecision",
    "grad_norm_scores",
    "kmeans",
    "label_bits",
    "loss_scores",
    "merge_codebooks",
    "quantize_uniform",
    "QUANTIZERS",
    "sample_gate",
    "SCALES",
    "SCORES",
    "send_probabilities",
    "threshold_gate",
    "uniform_header_bits",
    "uniform_row_bits",
    "UniformPayload",
]
