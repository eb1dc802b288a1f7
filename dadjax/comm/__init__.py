"""The bit ledger, the fp32 all-reduce baseline and the network cost model.

Bit arithmetic (``Bits``), the metered collectives, the per-site
collectives and the ledger's recording helpers are for writing new
methods: their documented home is :mod:`dadjax.extend`, and they stay
importable from here.
"""

from dadjax.comm._bits import (
    Bits,
    bits_add,
    bits_const,
    bits_from_count,
    bits_reduce,
    bits_sum,
    bits_to_int,
    bits_zero,
    host_array,
    tree_bits,
)
from dadjax.comm._collectives import (
    AllReduceState,
    allreduce,
    axis_size,
    gather_sites,
    mean_over_sites,
    site_index,
    sum_over_sites,
)
from dadjax.comm._cost import NetworkModel
from dadjax.comm._metered import (
    NO_TRAFFIC,
    Traffic,
    metered_all_gather,
    metered_pmean,
    metered_psum,
    traffic_add,
)
from dadjax.comm._ledger import (
    FP32_BITS,
    CommStats,
    CommSummary,
    comm_stats,
    find_comm_stats,
    ledger_init,
    ledger_record,
    tree_dense_bits,
)

__all__ = [
    "comm_stats",
    "CommStats",
    "CommSummary",
    "NetworkModel",
    "allreduce",
    "AllReduceState",
    "FP32_BITS",
]
