"""dadjax: communication-efficient distributed training in JAX.

Gradient compressors as optax transformations that perform their own
collectives, distributed auto-differentiation (dAD / rank-dAD dense
layers), one registry of methods by spec string (``dadjax methods``), one
SPMD train step (``shard_map``, ``pmap`` or ``vmap``-simulated sites) and
one bit ledger with a network cost model. :mod:`dadjax.extend` holds the
building blocks for writing new methods.
"""

# Every family package is imported here: each registers its methods in the catalog
# (dadjax.registry) when imported, so the catalog is complete once dadjax is.
from dadjax import (adaptive, comm, compress, dad, data, dataquant, elastic, extend, local, models,
                    parallel, pod, registry)
from dadjax.comm import (AllReduceState, CommStats, CommSummary, NetworkModel, accumulate, allreduce,
                         comm_stats)
from dadjax.compress import (
    CompressedState,
    Compressor,
    ErrorFeedbackState,
    PowerSGDState,
    cast,
    compressed,
    error_feedback,
    get_compressor,
    identity,
    powersgd,
    qsgd,
    randomk,
    scaled_sign,
    sign,
    terngrad,
    topk,
)
from dadjax.methods import build_method
from dadjax._core.layers import per_layer, stacked_layers
from dadjax._core.protocols import after_local_state
from dadjax.parallel import (TrainState, TrainStep, initialize, make_mesh, make_train_step,
                             site_map)
from dadjax.registry import Method, SpecError
from dadjax._core.protocols import BatchStage

__version__ = "0.5.0"

__all__ = [
    # subpackages
    "adaptive", "comm", "compress", "dad", "data", "dataquant", "elastic", "extend", "local",
    "models", "parallel", "pod", "registry",
    # protocols
    "Compressor", "Method", "BatchStage",
    # methods by name
    "build_method", "get_compressor", "SpecError",
    # factories and their states
    "allreduce", "AllReduceState", "accumulate", "compressed", "CompressedState", "identity",
    "cast", "topk", "randomk", "qsgd", "terngrad", "sign", "scaled_sign", "powersgd", "PowerSGDState",
    "error_feedback", "ErrorFeedbackState",
    # the ledger and the network model
    "comm_stats", "CommStats", "CommSummary", "NetworkModel",
    # the train step
    "make_train_step", "TrainStep", "TrainState", "make_mesh", "initialize", "site_map",
    # layers stacked by nn.scan
    "stacked_layers", "per_layer",
    # a communicating transformation placed after per-site state on purpose
    "after_local_state",
]
