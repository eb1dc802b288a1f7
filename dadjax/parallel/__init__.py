"""Meshes, multi-host start-up, the SPMD train step and its loss functions.

Placements (:class:`Vmap`, :class:`Pmap`, :class:`Mesh`) say where the sites
run; :class:`CollectionRule` s (declared by a family with
:func:`register_rule`, or passed as ``make_train_step(collections=...)``) say
how the step updates a model-state collection.
"""

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
from dadjax._core.protocols import CollectionRule, register_rule
from dadjax.comm import COMM_COLLECTION, STATE_COLLECTION
from dadjax.parallel._abstract import abstract_batch, abstract_state
from dadjax.parallel._gradient import LocalGradients, grad_result, keep_unused_state, local_gradients
from dadjax.parallel._layout import shard_dims
from dadjax.parallel._scan_axes import layer_axes_of
from dadjax.parallel._losses import softmax_cross_entropy
from dadjax.parallel._make import make_train_step
from dadjax.parallel._mesh import initialize, make_mesh
from dadjax.parallel._placement import BACKENDS, Mesh, Pmap, Vmap
from dadjax.parallel._site_map import SiteMapped, site_map
from dadjax.parallel._state import TrainState, site_keys, stack_sites, unstack_site
from dadjax.parallel._step import TrainStep

__all__ = [
    "make_train_step",
    "abstract_state",
    "abstract_batch",
    "shard_dims",
    "layer_axes_of",
    "site_map",
    "SiteMapped",
    "TrainStep",
    "TrainState",
    "BACKENDS",
    "Vmap",
    "Pmap",
    "Mesh",
    "CollectionRule",
    "register_rule",
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
