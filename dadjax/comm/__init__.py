"""Collectives over named axes, the bit ledger and the network cost model.

* metered collectives (``metered_psum`` / ``metered_pmean`` /
  ``metered_all_gather``): every collective in dadjax returns its result and
  the payload it moved (:class:`Traffic`);
* the ledger (:class:`CommStats`, :func:`comm_stats`): payload bits per
  collective kind, per site and step;
* wire bits per topology (:func:`wire_bits`) and the alpha-beta
  :class:`NetworkModel`;
* the compiled program's collective ops (:func:`hlo_collectives`; the branch a
  step takes: :func:`taken_collectives`, :func:`match_branches`);
* :func:`accumulate`: gradient accumulation with one collective per
  optimizer step;
* variance typing under ``shard_map`` and the shared collection names.

The end of ``__all__`` lists the mechanics the method families build on
(bit counts, the metered collectives, the sites' axis, the ledger's
recording helpers and the collection names); people writing a method
outside dadjax find them, with a stability promise, in
:mod:`dadjax.extend`.
"""

from dadjax._core.bits import (
    Bits,
    bits_add,
    bits_const,
    bits_from_count,
    bits_reduce,
    bits_to_int,
    bits_zero,
    host_array,
)
from dadjax.comm._accumulate import AccumulateState, accumulate
from dadjax.comm._collectives import AllReduceState, allreduce
from dadjax.comm._cost import GLOO_TCP, HierarchicalNetwork, NetworkModel, TransportFit
from dadjax.comm._hlo import (CollectiveOps, collective_ops, hlo_collectives, match_branches,
                             taken_collectives, type_bytes)
from dadjax.comm._ledger import (
    FP32_BITS,
    CommStats,
    CommSummary,
    IntraSiteStats,
    PeriodicStats,
    comm_stats,
    find_comm_stats,
    ledger_init,
    ledger_record,
    periodic_init,
    periodic_record,
    tree_dense_bits,
)
from dadjax.comm._report import Report, compiled_intra, gradient_baseline, report
from dadjax.comm._metered import (
    NO_TRAFFIC,
    Traffic,
    metered_all_gather,
    metered_all_to_all,
    metered_pmean,
    metered_psum,
    traffic_add,
)
from dadjax.comm._sites import (axis_size, compiling_for, gather_sites, in_site_axes,
                               in_site_devices, mean_over_sites, ring_gather, site_index,
                               sites_of_devices, sum_over_sites, target_platform)
from dadjax.comm._vma import COMM_COLLECTION, STATE_COLLECTION
from dadjax.comm._wire import TOPOLOGIES, wire_bits

__all__ = [
    "comm_stats",
    "CommStats",
    "CommSummary",
    "NetworkModel",
    "TransportFit",
    "GLOO_TCP",
    "HierarchicalNetwork",
    "IntraSiteStats",
    "PeriodicStats",
    "allreduce",
    "AllReduceState",
    "FP32_BITS",
    "accumulate",
    "AccumulateState",
    "wire_bits",
    "TOPOLOGIES",
    "hlo_collectives",
    "collective_ops",
    "type_bytes",
    "taken_collectives",
    "match_branches",
    "CollectiveOps",
    "report",
    "compiled_intra",
    "Report",
    "gradient_baseline",
    # the mechanics the method families build on (stable for outside authors via dadjax.extend)
    "Bits", "bits_add", "bits_const", "bits_from_count", "bits_reduce", "bits_to_int", "bits_zero",
    "host_array", "Traffic", "NO_TRAFFIC", "traffic_add", "metered_psum", "metered_pmean",
    "metered_all_gather", "metered_all_to_all", "axis_size", "site_index", "gather_sites",
    "mean_over_sites", "sum_over_sites", "find_comm_stats", "ring_gather", "compiling_for",
    "target_platform", "sites_of_devices", "in_site_axes", "in_site_devices",
    "ledger_init", "ledger_record", "periodic_init", "periodic_record", "tree_dense_bits",
    "COMM_COLLECTION", "STATE_COLLECTION",
]
