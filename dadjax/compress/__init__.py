"""Gradient compressors (pure functions on pytrees) and the optax transform
that communicates them: ``compressed(powersgd(rank=4), axis_name="data")``.

Every compressor is also registered by name (``get_compressor("ef_topk:0.01")``,
``dadjax methods``). Payload types, key derivation, packing and the exchange
helpers for writing new compressors are in :mod:`dadjax.extend`.
"""

from dadjax.compress._base import (
    Compressor,
    EmptyState,
    Exchanged,
    Keys,
    Traffic,
    as_keys,
    exchange,
    leaf_keys,
    leafwise,
    one_round_exchange,
    step_keys,
)
from dadjax.compress._cast import cast, identity
from dadjax.compress._error_feedback import ErrorFeedbackState, error_feedback
from dadjax._core.packing import code_bits, pack_bits, packed_words, unpack_bits
from dadjax.compress._powersgd import PowerSGDPayload, PowerSGDState, orthogonalize, powersgd
from dadjax.compress._quantize import QuantizedPayload, qsgd, scaled_sign, sign, terngrad
from dadjax.compress._sparse import SparsePayload, randomk, topk
from dadjax.compress._transform import CompressedState, compressed
from dadjax.registry import get_compressor

# The extension helpers imported above (Keys, exchange, pack_bits, ...) stay
# importable from here; their documented home is dadjax.extend.
__all__ = [
    "Compressor",
    "EmptyState",
    "compressed",
    "CompressedState",
    "get_compressor",
    "identity",
    "cast",
    "topk",
    "randomk",
    "qsgd",
    "terngrad",
    "sign",
    "scaled_sign",
    "powersgd",
    "PowerSGDState",
    "error_feedback",
    "ErrorFeedbackState",
]
