"""Meshes, multi-host start-up, the SPMD train step and its loss functions."""

from dadjax.parallel._losses import (
    MODEL_STATE,
    classification_loss,
    cross_entropy_rows,
    default_metrics,
    model_loss,
    regression_loss,
    squared_error_rows,
    stream_key,
)
from dadjax.parallel._mesh import initialize, make_mesh
from dadjax.parallel._step import (
    BACKENDS,
    COMM_COLLECTION,
    LocalGradients,
    STATE_COLLECTION,
    TrainState,
    TrainStep,
    grad_result,
    keep_unused_state,
    local_gradients,
    make_train_step,
    shard_dims,
    site_keys,
    softmax_cross_entropy,
    stack_sites,
    unstack_site,
)

__all__ = [
    "make_train_step",
    "shard_dims",
    "TrainStep",
    "TrainState",
    "BACKENDS",
    "local_gradients",
    "LocalGradients",
    "softmax_cross_entropy",
    "classification_loss",
    "regression_loss",
    "stack_sites",
    "unstack_site",
    "COMM_COLLECTION",
    "STATE_COLLECTION",
    "make_mesh",
    "initialize",
]
