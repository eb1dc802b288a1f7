"""Meshes, multi-host start-up and the SPMD train step."""

from dadjax.parallel._mesh import initialize, make_mesh
from dadjax.parallel._step import (
    BACKENDS,
    COMM_COLLECTION,
    STATE_COLLECTION,
    TrainState,
    TrainStep,
    make_train_step,
    softmax_cross_entropy,
    stack_sites,
    unstack_site,
)
