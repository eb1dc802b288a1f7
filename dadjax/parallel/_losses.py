"""Loss and metric functions for the train step (Flax-style).

A *loss function* is ``loss_fn(params, variables, batch, rng, train) -> (loss, aux)``:

* ``params``: the ``"params"`` collection;
* ``variables``: every other collection of the model state (``"batch_stats"``,
  ``"dad_state"``, user collections), to be passed to ``model.apply``;
* ``batch``: this site's rows, any pytree (usually a dict);
* ``rng``: a key for this site and step (see :mod:`dadjax.parallel._step`
  for how it is derived);
* ``train``: ``True`` in the training step, ``False`` in evaluation.

``aux`` is any pytree. When it is a mapping, its entry ``"model_state"``
(:data:`MODEL_STATE`) is reserved: the collections ``model.apply(...,
mutable=...)`` returned (new ``"batch_stats"``, the ``"comm"`` bits sown by
dAD layers). The step takes that entry out and hands the rest of ``aux`` to
the metrics function ``metrics_fn(aux, batch) -> dict`` of scalars.

The factories below build loss functions for a Flax module from a per-row
criterion. A batch is a dict with the inputs under ``"x"`` and the targets
under ``"y"``; an optional ``"weight"`` entry (rows,) weights each row's loss:
the loss is ``mean(weight * per_row_loss)`` over the rows (the mean divides
by the number of rows, not by the sum of weights, so importance weights
``1/p`` keep the estimate unbiased and weight 0 drops a row).
"""

from __future__ import annotations

import inspect
import zlib
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import optax

from dadjax._core.protocols import differentiated
from dadjax.comm import COMM_COLLECTION

MODEL_STATE = "model_state"

LossFn = Callable[[Any, Any, Any, jax.Array, bool], tuple[jax.Array, Any]]
MetricsFn = Callable[[Any, Any], dict]


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean cross-entropy of integer ``labels`` (batch,) under ``logits`` (batch, classes)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def cross_entropy_rows(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Per-row cross-entropy, (rows,), of integer ``labels`` under ``logits`` (rows, classes)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def squared_error_rows(predictions: jax.Array, targets: jax.Array) -> jax.Array:
  """Per-row squared error averaged over the output dims: (rows, ...) -> (rows,).

  The mean over rows of this is the MSE over all elements.
  """
  err = jnp.square(predictions - jnp.asarray(targets, predictions.dtype))
  return err.reshape(err.shape[0], -1).mean(axis=1)


def stream_key(rng: jax.Array, name: str) -> jax.Array:
  """The key of one named rng stream (``"dropout"``, ...) from a step's key.

  ``fold_in(rng, crc32(name) mod 2**31)``: a different key per stream name.
  """
  return jax.random.fold_in(rng, zlib.crc32(name.encode()) & 0x7FFFFFFF)


def _accepts_train(model) -> bool:
  try:
    sig = inspect.signature(type(model).__call__)
  except (TypeError, ValueError):
    return False
  return "train" in sig.parameters or any(
      p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())


def model_loss(
    model,
    criterion: Callable[[jax.Array, jax.Array], jax.Array],
    *,
    output_name: str = "outputs",
    input_key: str = "x",
    target_key: str = "y",
    rng_streams: Sequence[str] = ("dropout",),
) -> LossFn:
  """A loss function for a Flax module and a per-row criterion.

  The model is applied as ``model.apply({"params": params, **variables},
  batch[input_key], train=train, rngs=..., mutable=...)`` (``train`` only
  when the module's ``__call__`` takes it). Every non-parameter collection
  in ``variables`` is passed as mutable, except those whose registered
  :class:`~dadjax._core.protocols.CollectionRule` differentiates them
  (``"dad_state"``), plus ``"comm"`` (bits sown by dAD layers); the step
  keeps the ones it has a rule for. Each name in ``rng_streams`` gets ``stream_key(rng, name)``.

  Args:
    model: a Flax linen module.
    criterion: ``(outputs, targets) -> (rows,)`` per-row losses.
    output_name: the aux entry holding the model's outputs.
    input_key, target_key: batch entries of the inputs and the targets.
    rng_streams: rng names the model may request (default ``("dropout",)``).

  Returns:
    ``loss_fn(params, variables, batch, rng, train) -> (loss, aux)`` with
    ``aux = {output_name: outputs, "model_state": updated collections}``.
  """
  pass_train = _accepts_train(model)
  streams = tuple(rng_streams)

  def loss_fn(params, variables, batch, rng, train):
    variables = dict(variables or {})
    skip = ("params", COMM_COLLECTION, *differentiated())
    mutable = [COMM_COLLECTION] + sorted(k for k in variables if k not in skip)
    kwargs = {"train": train} if pass_train else {}
    rngs = {name: stream_key(rng, name) for name in streams} if rng is not None else None
    outputs, updates = model.apply({"params": params, **variables}, batch[input_key],
                                   rngs=rngs, mutable=mutable, **kwargs)
    rows = criterion(outputs, batch[target_key])
    if isinstance(batch, Mapping) and "weight" in batch:
      rows = rows * jnp.asarray(batch["weight"], rows.dtype)
    return jnp.mean(rows), {output_name: outputs, MODEL_STATE: dict(updates)}

  return loss_fn


def classification_loss(model, **kwargs) -> LossFn:
  """Softmax cross-entropy of integer labels ``batch["y"]`` (the default loss).

  ``aux["logits"]`` holds the logits. Keyword arguments as :func:`model_loss`.
  """
  return model_loss(model, cross_entropy_rows, output_name="logits", **kwargs)


def regression_loss(model, **kwargs) -> LossFn:
  """Mean squared error against float targets ``batch["y"]`` of the output's shape.

  Targets may be (rows,) or (rows, k) (a 2-D regression head). ``aux["predictions"]``
  holds the outputs. Keyword arguments as :func:`model_loss`.
  """
  return model_loss(model, squared_error_rows, output_name="predictions", **kwargs)


def _row_mean(values: jax.Array, batch) -> jax.Array:
  if isinstance(batch, Mapping) and "weight" in batch:
    w = jnp.asarray(batch["weight"], jnp.float32)
    return jnp.sum(values * w) / jnp.maximum(jnp.sum(w), 1e-12)
  return jnp.mean(values)


def default_metrics(aux, batch) -> dict:
  """Metrics read from a loss function's ``aux`` and the batch (weighted by ``"weight"``).

  * ``"accuracy"`` when ``aux["logits"]`` (rows, classes) and integer
    ``batch["y"]`` (rows,) are present;
  * ``"mse"`` when ``aux["predictions"]`` and float ``batch["y"]`` of the same
    shape are present.

  Anything else yields no metric (the step always reports ``"loss"``). When
  the aux rows do not match the batch rows (a batch stage that returned the
  aux of other rows), nothing is computed.
  """
  out = {}
  if not (isinstance(aux, Mapping) and isinstance(batch, Mapping) and "y" in batch):
    return out
  y = batch["y"]
  logits = aux.get("logits")
  if (logits is not None and jnp.issubdtype(y.dtype, jnp.integer)
      and logits.shape[:-1] == y.shape):
    out["accuracy"] = _row_mean((jnp.argmax(logits, -1) == y).astype(jnp.float32), batch)
  preds = aux.get("predictions")
  if preds is not None and jnp.issubdtype(y.dtype, jnp.floating) and preds.shape == y.shape:
    out["mse"] = _row_mean(squared_error_rows(preds, y), batch)
  return out


def compute_in(loss_fn: LossFn, dtype: Any) -> LossFn:
  """``loss_fn`` computed in ``dtype`` (e.g. bf16) from fp32 master weights.

  The floating parameters and batch entries are cast to ``dtype`` before the
  model runs, so its matmuls and activations are in ``dtype``; the gradient
  flows back through the casts, so it arrives in the parameters' fp32, and
  every method averages and applies fp32 gradients to fp32 weights (what
  mixed-precision training on TPUs and GPUs does). Integer labels and
  tokens are left as they are.

  Args:
    loss_fn: ``loss_fn(params, variables, batch, rng, train) -> (loss, aux)``.
    dtype: the compute dtype, e.g. ``jnp.bfloat16``.

  Returns:
    The wrapped loss function; the loss is returned in fp32.

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018
    (https://arxiv.org/abs/1710.03740).
  """
  dtype = jnp.dtype(dtype)

  def cast(tree):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(jnp.result_type(x),
                                                                     jnp.floating) else x, tree)

  def wrapped(params, variables, batch, rng, train):
    value, aux = loss_fn(cast(params), variables, cast(batch), rng, train)
    return value.astype(jnp.float32), aux

  return wrapped

