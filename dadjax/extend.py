"""Building blocks for writing new methods (not needed to use the existing ones).

- **Registering a method**: :func:`register_compressor` / :func:`register_method`
  with typed :class:`Arg` s, where the method is defined; :data:`COMPRESSOR` /
  :data:`METHOD` arguments take nested specs; :func:`parse_spec`,
  :func:`format_spec`, :class:`Spec`, :func:`resolve`.
- **Bit arithmetic** (exact 64-bit counts without x64): :class:`Bits`,
  :func:`bits_const`, :func:`bits_add`, :func:`bits_sum`, :func:`bits_reduce`,
  :func:`bits_from_count`, :func:`bits_zero`, :func:`bits_to_int`,
  :func:`host_array`, :func:`tree_bits`.
- **Metered collectives**: :func:`metered_psum`, :func:`metered_pmean`,
  :func:`metered_all_gather` return ``(result, Traffic)``; :class:`Traffic`, :data:`NO_TRAFFIC`,
  :func:`traffic_add`. Every new collective goes through them, so the
  ledger counts what was sent.
- **Sharded parameters**: nothing to do. The step places sharded state with
  ``NamedSharding`` and XLA partitions the program, so a method sees whole
  logical tensors (:class:`~dadjax.parallel.SiteMesh`). The slice helpers
  of earlier versions (:func:`whole_sum`, :func:`whole_max`,
  :func:`whole_size`, :func:`slice_uniform`, :func:`leaf_shard`,
  :func:`shard_axes`, :func:`require_whole_leaves`) and a compressor's
  ``shardable`` flag are kept until the next minor version as plain local
  computations (:mod:`dadjax._core.shards`).
- **Sites**: :func:`axis_size`, :func:`site_index`, :func:`sum_over_sites`,
  :func:`mean_over_sites`, :func:`gather_sites`.
- **The ledger**: :func:`ledger_init`, :func:`ledger_record`,
  :func:`tree_dense_bits`, :func:`find_comm_stats`, :data:`FP32_BITS`.
- **Packing**: :func:`pack_bits`, :func:`unpack_bits`, :func:`pack_rows` /
  :func:`unpack_rows` (per row, a sharding kept), :func:`packed_words`,
  :func:`code_bits`.
- **Keys**: :class:`Keys`, :func:`step_keys`, :func:`as_keys`.
- **Exchange helpers** for compressors: :func:`leafwise`, :func:`exchange`,
  :func:`one_round_exchange`, :class:`Exchanged`; payload types
  :class:`SparsePayload`, :class:`QuantizedPayload`, :class:`PowerSGDPayload`;
  :func:`orthogonalize`, :func:`largest_magnitude_indices`.
- **Batch stages** (data-side methods): :class:`BatchStage`,
  :class:`StageContext`, :class:`StageOutput`, :class:`GradResult`.
- **dAD kernels**: :func:`factorize`, :class:`Factors`,
  :func:`product_route`, :func:`layer_route`, :func:`layer_bits`,
  :func:`current_state`.

Stability: every name in ``__all__`` here is public API. Its signature and
behaviour change only with a minor version bump and a note in the
changelog, and a name is removed only after a release in which it warned;
everything else in dadjax whose module or name starts with ``_``
(``dadjax._core`` included) may change in any release. Names here are the
same objects as where they are implemented (no wrappers), so a method
written against them composes with the built-in ones.
"""

from dadjax._core.bits import (Bits, bits_add, bits_const, bits_from_count, bits_reduce,
                               bits_sum, bits_to_int, bits_zero, host_array, tree_bits)
from dadjax._core.linalg import orthogonalize
from dadjax._core.packing import (code_bits, pack_bits, pack_rows, packed_words, unpack_bits,
                                  unpack_rows)
from dadjax._core.shards import (leaf_shard, require_whole_leaves, shard_axes, slice_uniform,
                                 whole_max, whole_size, whole_sum)
from dadjax.comm import (FP32_BITS, NO_TRAFFIC, Traffic, axis_size, find_comm_stats,
                         gather_sites, ledger_init, ledger_record, mean_over_sites,
                         metered_all_gather, metered_pmean, metered_psum, site_index,
                         sum_over_sites, traffic_add, tree_dense_bits)
from dadjax.compress import (Exchanged, Keys, PowerSGDPayload, QuantizedPayload, SparsePayload,
                             as_keys, exchange, largest_magnitude_indices, leafwise,
                             one_round_exchange, step_keys)
from dadjax.dad import Factors, current_state, factorize, layer_bits, layer_route, product_route
from dadjax.registry import (
    COMPRESSOR,
    METHOD,
    Arg,
    Spec,
    format_spec,
    parse_spec,
    register_compressor,
    register_method,
    resolve,
)
from dadjax._core.protocols import BatchStage, GradResult, StageContext, StageOutput

__all__ = [
    # registering methods
    "Arg", "COMPRESSOR", "METHOD", "Spec", "format_spec", "parse_spec", "register_compressor",
    "register_method", "resolve",
    # bit arithmetic
    "Bits", "bits_add", "bits_const", "bits_from_count", "bits_reduce", "bits_sum", "bits_to_int",
    "bits_zero", "host_array", "tree_bits",
    # metered collectives
    "Traffic", "NO_TRAFFIC", "metered_all_gather",
    "metered_pmean", "metered_psum", "traffic_add",
    # parameters sharded within a site
    "require_whole_leaves", "shard_axes", "leaf_shard", "whole_sum", "whole_max", "whole_size",
    "slice_uniform",
    # sites
    "axis_size", "gather_sites", "mean_over_sites", "site_index", "sum_over_sites",
    # the ledger
    "FP32_BITS", "find_comm_stats", "ledger_init", "ledger_record", "tree_dense_bits",
    # packing
    "code_bits", "pack_bits", "packed_words", "unpack_bits", "pack_rows", "unpack_rows",
    # keys
    "Keys", "as_keys", "step_keys",
    # exchange helpers and payloads
    "Exchanged", "exchange", "leafwise", "one_round_exchange", "orthogonalize",
    "largest_magnitude_indices", "PowerSGDPayload",
    "QuantizedPayload", "SparsePayload",
    # batch stages
    "BatchStage", "GradResult", "StageContext", "StageOutput",
    # dAD kernels
    "Factors", "current_state", "factorize", "layer_bits", "layer_route", "product_route",
]
