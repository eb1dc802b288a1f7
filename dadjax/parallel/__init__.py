"""Meshes, multi-host start-up and the SPMD train step."""

from dadjax.parallel._mesh import initialize, make_mesh
from dadjax.parallel._step import (
    BACKENDS,
    COMM_COLLECTION,
    LocalGradients,
    STATE_COLLECTION,
    TrainState,
    TrainStep,
    local_gradients,
    make_train_step,
    softmax_cross_entropy,
    stack_sites,
    unstack_site,
)

__all__ = [
    "make_train_step",
    "TrainStep",
    "TrainState",
    "BACKENDS",
    "local_gradients",
    "LocalGradients",
    "softmax_cross_entropy",
    "stack_sites",
    "unstack_site",
    "COMM_COLLECTION",
    "STATE_COLLECTION",
    "make_mesh",
    "initialize",
]
