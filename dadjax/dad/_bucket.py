"""Exact dAD with one all-gather per backward pass (``DadConfig(bucket=True)``, ``dad:bucket``).

A dAD layer's ``custom_vjp`` must return its kernel's gradient from its own
backward pass, so plain exact dAD runs one all-gather per layer (each costs
at least a round trip on a real link). The gathers are independent of one
another (the delta passed down to layer ``l - 1`` is this site's *local*
``D_l W_l^T``), so they can all wait until the backward pass is over. A
bucketed layer lets the train step do that:

1. The layer computes ``y = A stop_gradient(K) (+ stop_gradient(b)) + Z``
   with a zero *slot* ``Z`` shaped like ``y`` (one per call of the layer),
   and sows its rows ``A``, kernel ``K`` and bias ``b`` into the
   ``"dad_bucket"`` collection. Its input gradient ``D K^T`` stays local.
2. The step differentiates the loss with respect to the parameters and the
   slots: a slot's gradient is the layer's output delta ``D``.
3. Every layer's ``[A, D]`` travels in **one** bucketed all-gather (one
   buffer per dtype, :func:`~dadjax.comm.metered_all_gather`); each site
   forms the exact ``(1/N) sum_s A_s^T D_s`` (and ``D``'s column sums for
   :class:`~dadjax.dad.Dense`'s bias).
4. A kernel that *is* a parameter leaf (``nn.Dense``, :class:`~dadjax.dad.Dense`
   without a dtype cast) takes its gradient directly. Any other kernel (a
   dtype cast, :class:`~dadjax.dad.DotGeneral`'s transpose and reshape of a
   ``DenseGeneral`` or attention kernel) is mapped back onto the parameters
   it was computed from by the ``vjp`` of a second trace of the forward
   pass that returns only those kernels; XLA removes the rest of that trace
   as dead code.

The gradient equals plain exact dAD's (the same products, summed in the same
order up to float rounding) and the ledger books the one gather's payload,
``n (d_in + d_out)`` numbers per layer call, as before.

Where a layer cannot join (it runs inside a lifted transform that does not
carry the ``"dad_bucket"`` collection, e.g. ``nn.scan`` without it in
``variable_axes``; a loss function that does not make every collection of
the variables mutable and return it in ``aux["model_state"]``; a user who
differentiates ``model.apply`` directly), it takes its own exact route, one
gather of its own: the gradient is the same, only the bucket is smaller.
The bucket is formed by the train step's differentiation
(:func:`dadjax.parallel.grad_result`, through the collection's
:class:`~dadjax._core.protocols.CollectionRule` ``gradient``); layers record
themselves only while it traces.

References:
  Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
  Differentiation" (https://arxiv.org/abs/2102.09631).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import traverse_util

from dadjax._core.protocols import CollectionRule, register_rule
from dadjax._core.vma import is_varying, to_varying, vma
from dadjax.comm import COMM_COLLECTION, bits_const, metered_all_gather, traffic_add
from dadjax.dad._config import DadConfig
from dadjax.dad._routes import match_type

BUCKET_COLLECTION = "dad_bucket"
MARKER = "bucket"  # created at init: the model state holds the collection iff a layer buckets
ROWS, KERNELS, BIASES, SLOT = "rows", "kernels", "biases", "slot"
MODEL_STATE = "model_state"

_TRACE = threading.local()  # the layers seen while the step traces a bucketed pass


@contextlib.contextmanager
def _recording():
  """The layers that bucket while the step traces its passes, by path -> config.

  A linen layer knows its module path; an NNX layer does not, and is found
  by the rows it sowed (``id(rows)`` -> ``(rows, config)``, the rows held so
  the id stays theirs).
  """
  outer = getattr(_TRACE, "layers", None)
  _TRACE.layers = {}
  try:
    yield _TRACE.layers
  finally:
    _TRACE.layers = outer


def bucketed_output(host, a: jax.Array, kernel: jax.Array, bias: jax.Array | None,
                    config: DadConfig) -> jax.Array | None:
  """A bucketing layer's output ``a @ kernel (+ bias)``, or ``None`` to take its own route.

  Args:
    host: the calling layer (a :class:`~dadjax.dad._layer.Host`: where its
      slots and sown rows go).
    a: (..., n, d_in) rows (leading axes: one kernel per entry).
    kernel: (..., d_in, d_out).
    bias: (d_out,) or ``None``.
    config: the layer's :class:`DadConfig` (``bucket=True``).

  Returns:
    (..., n, d_out), or ``None`` at init and whenever the layer is not
    traced by the step's bucketed pass (module docstring).
  """
  if not host.joins_bucket():  # e.g. inside nn.scan without the collection, or at init
    return None
  layers = getattr(_TRACE, "layers", None)
  if layers is None:
    return None
  call = host.sow(BUCKET_COLLECTION, ROWS, a)
  if call is None:
    return None
  host.sow(BUCKET_COLLECTION, KERNELS, kernel)
  if bias is not None:
    host.sow(BUCKET_COLLECTION, BIASES, bias)
  y = jnp.matmul(a, jax.lax.stop_gradient(kernel), precision=config.precision)
  if bias is not None:
    y = y + jax.lax.stop_gradient(bias)
  if host.path is None:
    layers[id(a)] = (a, config)
  else:
    layers[tuple(host.path)] = config
  # A slot is typed like the output (varying per site under shard_map): the
  # gradient of an invariant slot would be summed over the sites.
  return y + host.slot(BUCKET_COLLECTION, f"{SLOT}{call}", y)


def _layers(sown: Any) -> dict[tuple, dict]:
  """The sown collection by layer path: ``{path: {"rows": (...), "kernels": ..., "slot0": ...}}``."""
  out: dict[tuple, dict] = {}
  for key, value in traverse_util.flatten_dict(dict(sown or {})).items():
    out.setdefault(key[:-1], {})[key[-1]] = value
  return {path: entry for path, entry in out.items() if ROWS in entry}


def _returned(aux: Any) -> Any:
  if isinstance(aux, dict) and isinstance(aux.get(MODEL_STATE), dict):
    return aux[MODEL_STATE].get(BUCKET_COLLECTION)
  return None


class _Pass(NamedTuple):
  """What the probe pass of :func:`bucketed_gradient` found: the layers that joined
  (``{path: sown entry}``), their configs by path, and the zero slots to differentiate."""

  probe: dict
  configs: dict
  slots: Any


def _probe(objective, params, diff) -> _Pass | None:
  """Trace the loss once to find the joining layers (its forward pass is dead code:
  only shapes and configs are read); ``None`` when no layer joins."""
  with _recording() as seen:
    probe = _layers(_returned(objective(params, diff, {BUCKET_COLLECTION: {}})[1]))
  if not probe:
    return None
  configs = {path: seen[path] if path in seen else seen[id(entry[ROWS][0])][1]
             for path, entry in probe.items()}
  slots = traverse_util.unflatten_dict({
      path + (name,): to_varying(jnp.zeros(v.shape, v.dtype), vma(v))
      for path, entry in probe.items() for name, v in entry.items() if name.startswith(SLOT)})
  return _Pass(probe, configs, slots)


def _traced(objective, origin, p, d, s, find_origin=False):
  """The loss with slots ``s``; with ``find_origin``, records in ``origin`` which sown
  kernels and biases *are* parameter leaves (no cast or reshape in between)."""
  with _recording():
    out = objective(p, d, {BUCKET_COLLECTION: s})
  if find_origin:
    index = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(p))}
    for path, entry in _layers(_returned(out[1])).items():
      for kind in (KERNELS, BIASES):
        for i, v in enumerate(entry.get(kind, ())):
          if id(v) in index:
            origin[(path, kind, i)] = index[id(v)]
  return out


def _onto_params(objective, origin, params, diff, slots, grads, cotangents):
  """Add each synchronized kernel / bias gradient onto the parameters it came from.

  A kernel that is a parameter leaf takes its gradient directly; the others
  (a dtype cast, a DotGeneral's transpose and reshape) go through the ``vjp``
  of a second forward trace that returns only those kernels (XLA removes
  the rest of that trace as dead code).
  """
  param_def = jax.tree.structure(params)
  grad_leaves = param_def.flatten_up_to(grads)
  computed = {}  # the rest: layer -> kind -> [(call, cotangent)]
  for path, kinds in cotangents.items():
    for kind, values in kinds.items():
      for i, g in enumerate(values):
        leaf = origin.get((path, kind, i))
        if leaf is None:
          computed.setdefault(path, {}).setdefault(kind, []).append((i, g))
        else:
          grad_leaves[leaf] = grad_leaves[leaf] + g
  grads = param_def.unflatten(grad_leaves)
  if not computed:
    return grads

  def kernels_of(p):
    taken = _layers(_returned(_traced(objective, {}, p, diff, slots)[1]))
    return {path: {kind: [taken[path][kind][i] for i, _ in calls]
                   for kind, calls in kinds.items()} for path, kinds in computed.items()}

  _, pullback = jax.vjp(kernels_of, params)
  (from_kernels,) = pullback({path: {kind: [g for _, g in calls] for kind, calls in kinds.items()}
                              for path, kinds in computed.items()})
  return jax.tree.map(jnp.add, grads, from_kernels)


def _book(aux: Any, traffic) -> Any:
  """``aux`` with the bucket's gather booked in ``aux["model_state"]["comm"]``."""
  aux = dict(aux)
  model_state = dict(aux[MODEL_STATE])
  comm = dict(model_state.get(COMM_COLLECTION) or {})
  comm[BUCKET_COLLECTION] = {
      "gather_bits": (bits_const(traffic.gather),),
      "gather_calls": (jnp.zeros((traffic.gather_calls,), jnp.int8),)}
  if traffic.reduce_calls:
    comm[BUCKET_COLLECTION].update(
        reduce_bits=(bits_const(traffic.reduce),),
        reduce_calls=(jnp.zeros((traffic.reduce_calls,), jnp.int8),))
  model_state[COMM_COLLECTION] = comm
  aux[MODEL_STATE] = model_state
  return aux


def bucketed_gradient(objective, params, diff):
  """The step's differentiation with one all-gather for every bucketing dAD layer.

  ``objective(params, diff, overrides) -> (loss, aux)`` (the loss with
  ``overrides`` replacing model-state collections); ``diff`` the
  differentiated collections' float leaves. Returns ``(loss, aux, grads,
  diff_grads)`` as ``jax.value_and_grad`` would, the bucketed kernels' (and
  biases') synchronized gradients included and the gather booked in
  ``aux["model_state"]["comm"]`` (module docstring).
  """
  found = _probe(objective, params, diff)
  if found is None:  # no layer could join: every one took its own route
    (value, aux), (grads, diff_grads) = jax.value_and_grad(
        objective, argnums=(0, 1), has_aux=True)(params, diff)
    return value, aux, grads, diff_grads
  origin: dict[tuple, int] = {}
  (value, aux), (grads, diff_grads, deltas) = jax.value_and_grad(
      functools.partial(_traced, objective, origin, find_origin=True), argnums=(0, 1, 2),
      has_aux=True)(params, diff, found.slots)
  sown = _layers(_returned(aux))
  if set(sown) != set(found.probe):
    raise ValueError("dad bucket: the loss function must return the 'dad_bucket' collection "
                     "in aux['model_state'] on every call (make every collection of the "
                     "variables mutable, as dadjax.parallel.model_loss does)")
  cotangents, traffic = _synchronized(sown, traverse_util.flatten_dict(deltas), found.configs)
  grads = _onto_params(objective, origin, params, diff, found.slots, grads, cotangents)
  return value, _book(aux, traffic), grads, diff_grads


def _synchronized(sown: dict, deltas: dict, configs: dict):
  """``({layer path: {"kernels": (G, ...), "biases": (...)}}, traffic)``: one gather per group.

  Layers are grouped by site axis and by whether their kernel is typed
  invariant (a replicated ``P()`` parameter under ``shard_map``: JAX sums the
  sites' contributions there, as the per-layer route does); one group is the
  usual case, and each group is one bucketed all-gather.
  """
  groups: dict[tuple, dict] = {}
  for path, entry in sown.items():
    config = configs[path]
    kernel = entry[KERNELS][0]
    invariant = (config.axis_name is not None
                 and any(is_varying(v, config.axis_name) for v in entry[ROWS])
                 and not is_varying(kernel, config.axis_name))
    calls = [(a, deltas[path + (f"{SLOT}{i}",)]) for i, a in enumerate(entry[ROWS])]
    groups.setdefault((config.axis_name, invariant), {})[path] = calls
  cotangents, sent = {}, []
  for (axis, invariant), payload in groups.items():
    gathered, traffic = metered_all_gather(payload, axis, invariant=invariant, bucket=True)
    sent.append(traffic)
    for path, calls in gathered.items():
      entry, config = sown[path], configs[path]
      typed = any(is_varying(v, axis) for v in jax.tree.leaves(entry[ROWS]))
      scale = 1.0 if invariant else 1.0 / calls[0][0].shape[0]
      out = {KERNELS: []}
      for i, (a_all, d_all) in enumerate(calls):
        # sites and rows are summed: (N, ..., n, d_in) x (N, ..., n, d_out) -> (..., d_in, d_out)
        g = jnp.einsum("s...ni,s...no->...io", a_all, d_all, precision=config.precision) * scale
        g, t = match_type(g.astype(entry[KERNELS][i].dtype), entry[KERNELS][i], axis, typed)
        out[KERNELS].append(g)
        sent.append(t)
        if BIASES in entry:
          gb = jnp.sum(d_all, axis=(0, d_all.ndim - 2)) * scale
          gb, t = match_type(gb.astype(entry[BIASES][i].dtype), entry[BIASES][i], axis, typed)
          out.setdefault(BIASES, []).append(gb)
          sent.append(t)
      cotangents[path] = {k: tuple(v) for k, v in out.items()}
  return cotangents, traffic_add(*sent)


def _keep_marker(old: Any, new: Any) -> Any:
  del new  # the slots and sown rows of one step are not state
  return old


BUCKET_RULE = register_rule(BUCKET_COLLECTION, CollectionRule(
    update=_keep_marker, gradient=bucketed_gradient))
