"""Gradient compressors (pure functions on pytrees) and the optax transform
that communicates them: ``compressed(powersgd(rank=4), axis_name="data")``.

Every compressor is also registered by name (``get_compressor("ef_topk:0.01")``,
``dadjax methods``). Payload types, key derivation, packing and the exchange
helpers for writing new compressors are in :mod:`dadjax.extend`.
"""

from dadjax.compress._base import (Compressor, EmptyState, Exchanged, Keys, as_keys, exchange,
                                 grouping, leaf_keys, leafwise, one_round_exchange, step_keys)
from dadjax.compress._cast import cast, identity
from dadjax.compress._error_feedback import ErrorFeedbackState, error_feedback
from dadjax.compress._powersgd import PowerSGDPayload, PowerSGDState, powersgd
from dadjax.compress._quantize import QuantizedPayload, qsgd, quantize, scaled_sign, sign, terngrad
from dadjax.compress._sparse import SparsePayload, largest_magnitude_indices, randomk, topk
from dadjax.compress._two_phase import (ROUTES, Codec, chosen_route, route_wire_bits,
                                        two_phase)
from dadjax.compress._transform import CompressedState, compressed, shardable_compressors
from dadjax.registry import get_compressor

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
    "quantize",
    "two_phase",
    "Codec",
    "ROUTES",
    "route_wire_bits",
    "chosen_route",
    "powersgd",
    "PowerSGDState",
    "error_feedback",
    "ErrorFeedbackState",
    # what other families build on: the step's keys, the exchange, shape grouping, payloads
    "Keys", "as_keys", "step_keys", "leaf_keys", "Exchanged", "exchange", "one_round_exchange",
    "leafwise", "grouping", "shardable_compressors", "PowerSGDPayload", "QuantizedPayload",
    "SparsePayload", "largest_magnitude_indices",
]
