"""dadjax: communication-efficient distributed training in JAX.

Gradient compression as optax transformations, distributed
auto-differentiation (dAD / rank-dAD), data quantization and Accordion,
behind one SPMD train step and one bit ledger.
"""

from dadjax import comm, compress, dad, parallel
from dadjax.compress import compressed, get_compressor
from dadjax.comm import CommStats, CommSummary, NetworkModel, accumulate, allreduce, comm_stats
from dadjax.parallel import TrainState, initialize, make_mesh, make_train_step

__version__ = "0.1.0"
