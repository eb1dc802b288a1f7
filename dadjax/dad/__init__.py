"""Distributed auto-differentiation: dAD and rank-dAD dense layers.

A dense layer's weight gradient is ``A^T D`` (inputs times output deltas);
sites share ``A`` and ``D`` (dAD, exact) or low-rank factors of their local
``A^T D`` (rank-dAD) inside the backward pass instead of all-reducing the
gradient. :class:`DadConfig` holds every option (each layer takes a
``config``, or its fields as keyword options). :class:`DotGeneral` is the
``dot_general_cls`` that brings this to any linen layer contracting an
input with a kernel (``nn.Dense``, ``nn.DenseGeneral``, attention
projections, einsums); :class:`Dense` is ``flax.linen.Dense`` with the
bias in the route; :class:`NnxDotGeneral` is the same for Flax NNX
(``nnx.Linear(..., dot_general=...)``, ``nnx.Einsum(..., einsum_op=...)``;
:func:`inject` gives every such layer of a model its own, and
:class:`DadState` is its ``"dad_state"`` Variable type). The three share
one layer route (:mod:`dadjax.dad._layer`): state, refusals, the bucket
and the bits they book. :func:`synchronize` handles every other parameter
and the bit ledger. The
specs ``dad``, ``auto_dad``, ``local_dad`` and ``rank_dad:R[:two_way][:warm][:ef][:block]``
are registered methods (:func:`get_method`, ``dadjax methods``). The
structured power iteration (:func:`~dadjax.extend.factorize`) is in
:mod:`dadjax.extend`.

Layer state: each layer keeps a ``"dad_state"`` entry (:func:`init_state`):
float fields its backward pass returns as the cotangent of the state, and an
int32 ``step`` counter that the backward pass only reads. The train step
differentiates the collection and replaces it with :func:`next_state`
(cotangent's float fields, ``step + 1``, for the layers that ran; the old
state for the others). Code that differentiates ``"dad_state"`` itself does
the same, with ``allow_int=True`` for the int counter::

    grads, cts = jax.grad(loss, argnums=(0, 1), allow_int=True)(params, dad_state)
    dad_state = dadjax.dad.next_state(dad_state, cts)

Collectives per step: one all-gather per layer, or one per backward pass
with ``bucket=True`` (spec ``dad:bucket``). Layer ``l``'s gradient needs
only its own gathered ``A_l`` and ``D_l``, and the delta passed down to
layer ``l - 1`` is this site's *local* ``D_l W_l^T``: no layer's backward
pass waits for another layer's gather. What keeps the gathers per layer by
default is where the gradient is formed: each layer's ``custom_vjp``
backward must return its kernel's gradient, and a backward pass has no side
output for its rows. A bucketing layer hands that job to the train step
(:mod:`dadjax.dad._bucket`): its output carries a zero slot whose gradient
is ``D``, its rows ``A`` are sown, and the step gathers every layer's
``[A, D]`` at once after the backward pass and maps ``A^T D`` back onto the
parameters. A layer that cannot join (inside ``nn.scan`` without
``"dad_bucket"`` in its ``variable_axes``, or differentiated outside the
train step) takes its own route. rank-dAD's factors stay per layer (each
layer's power iteration runs in its backward pass). (XLA's all-gather
combiner on GPU/TPU may merge independent per-layer gathers by itself;
XLA:CPU does not.)

References:
  Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
  Differentiation" (https://arxiv.org/abs/2102.09631).
"""

from dadjax.dad._config import AGGREGATIONS, MODES, ROUTES, DadConfig
from dadjax.dad._cost import choose_route, layer_bits, layer_route, layer_traffic, route_traffic
from dadjax.dad._dot_general import dot_general
from dadjax.dad._module import Dense, DotGeneral
from dadjax.dad._nnx import DadState, NnxDotGeneral, inject, inject_method
from dadjax.dad._state import current_state, init_state, next_state
from dadjax.dad._vjp import dense
from dadjax.dad._methods import DenseFactory, get_method, is_method
from dadjax.dad._power import Factors, factorize, product_route
from dadjax.dad._sync import (
    LayerPlan,
    ModelLedgerState,
    SynchronizeState,
    accordion_rows,
    effective_ranks,
    layer_mask,
    layer_plan,
    model_ledger,
    synchronize,
)
from dadjax.dad import _collection  # registers the "dad_state" collection rule
from dadjax.dad import _bucket  # registers the "dad_bucket" rule (one gather per backward pass)

# factorize, Factors, product_route, current_state, layer_bits and
# layer_route stay importable from here; their documented home is dadjax.extend.
__all__ = [
    "Dense",
    "DotGeneral",
    "NnxDotGeneral",
    "DadState",
    "inject",
    "inject_method",
    "dot_general",
    "DadConfig",
    "MODES",
    "AGGREGATIONS",
    "dense",
    "init_state",
    "next_state",
    "DenseFactory",
    "get_method",
    "is_method",
    "synchronize",
    "SynchronizeState",
    "layer_mask",
    "layer_plan",
    "LayerPlan",
    "accordion_rows",
    "effective_ranks",
    "model_ledger",
    "ModelLedgerState",
    # the mechanics dadjax.extend offers method authors
    "Factors", "factorize", "current_state", "layer_bits", "layer_route", "product_route",
]
