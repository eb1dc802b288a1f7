"""Quantizing data instead of gradients, as a batch stage of the train step.

Each step, every site

1. scores its rows and gates them (optional): the rows it sends are moved
   to the front, the rest are padding of weight 0 (static shapes);
2. quantizes its rows (:func:`~dadjax.dataquant.quantize_uniform`, a learned
   codebook, or none) and packs them, with the labels, the rows' weights
   (when they are not all 1) and the number of rows sent (when gated);
3. all-gathers that payload (:func:`dadjax.comm.metered_all_gather`) and
   decodes every site's rows: all sites hold the same ``N * R`` rows;
4. computes the gradient on the gathered quantized rows with the step's
   ``grad_fn`` (the same on every site);
5. optionally adds the mean of the sites' corrections ``g(x) - g(Q(x))``
   (:mod:`dadjax.dataquant._correction`), sent with any dadjax
   :class:`~dadjax.compress.Compressor` through
   :func:`dadjax.compress.exchange`, every ``correct_every`` steps.

Loss contract (:mod:`dadjax.stage`): a pass over ``n`` rows computes
``sum_i w_i l_i / n``. Rows ``i`` of site ``s`` carry weights ``w_si`` (1,
or the batch's ``"weight"``) divided by the gate's send probability, and
the gathered pass runs over ``N R`` rows, so with quantization off and the
gate open its gradient is exactly the all-reduce mean of the sites'
gradients, and with the sampling gate it is an unbiased estimate of it.
With an uncompressed correction the result is that gradient exactly,
whatever the quantizer and gate.

What the step sees: the gradient above, and the loss and ``aux`` of a
forward pass on this site's own, exact rows (``R`` rows, or the
correction's true pass when there is one), so ``metrics_fn(aux, batch)``
compares like with like and the reported loss is the site's training loss
as under all-reduce.

Cost, reported in :class:`DataQuantState`: the payload the compiled
all-gather moves is padded to ``R`` rows (``Traffic``, ``padded_bits``); the
bits of the rows actually sent are ``useful_bits`` (traced). Compute is
``N R`` rows in the shared backward pass, plus ``2 R`` for the correction
(true and quantized rows) and ``R`` single-row backward passes for the
``"grad_norm"`` score (``backward_rows``), and one forward pass of ``R``
rows for the reported loss and metrics.

References:
  Hanna, Ezzeldin, Fragouli, Diggavi, "Quantizing data for distributed
  learning", arXiv 2012.07913 (https://arxiv.org/abs/2012.07913).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dadjax._core.bits import (Bits, as_bits, bits_add, bits_const, bits_from_count, bits_sum,
                               bits_zero)
from dadjax._core.packing import code_bits
from dadjax._core.validate import check_int
from dadjax._core.trees import tree_nbits, tree_zeros_like
from dadjax.comm import (NO_TRAFFIC, Traffic, axis_size, bits_to_int, host_array,
                         metered_all_gather, traffic_add)
from dadjax.compress import Compressor, Keys, exchange
from dadjax.registry import get_compressor
from dadjax.dataquant._codebook import (decode_codebook, encode_codebook, fit_codebook,
                                        merge_codebooks)
from dadjax.dataquant._correction import correction_term
from dadjax.dataquant._gate import (check_gate, check_score, grad_norm_scores, loss_scores,
                                    sample_gate, threshold_gate)
from dadjax.dataquant._labels import check_num_classes, decode_labels, encode_labels
from dadjax._core.quantize import (SCALE_BITS, check_bits, check_scale, dequantize_uniform,
                                       quantize_uniform)
from dadjax._core.protocols import BatchStage, GradResult, StageContext, StageOutput

QUANTIZERS = ("uniform", "codebook")


class DataQuantState(NamedTuple):
  """Per-site state of :func:`dataquant` and the last step's cost.

  Attributes:
    correction: the correction compressor's state (``()`` without one).
    codebook: ``(2**bits, block)`` shared codebook (``"codebook"``
      quantizer; learned in the first step), else ``()`` (no leaf: an empty
      array leaf would come back from a shard_map step placed unlike its
      spec, and a program compiled for the first state would refuse the next).
    codebook_ready: bool, whether the codebook has been learned and sent.
    sent_rows: int32, rows this site sent in the last step.
    useful_bits: :class:`~dadjax.comm.Bits`, the last step's payload of the
      rows actually sent (and headers, labels, weights, count, codebook
      broadcast, correction).
    padded_bits: :class:`~dadjax.comm.Bits`, the last step's payload as the
      compiled collectives move it (rows padded to the batch size); the sum
      of the returned ``Traffic``.
    backward_rows: int32, rows through a backward pass on this site in the
      last step (``N R``, ``+ 2 R`` correction, ``+ R`` grad-norm scores).
    correction_active: bool, whether the last step sent a correction.
  """

  correction: Any
  codebook: Any
  codebook_ready: jax.Array
  sent_rows: jax.Array
  useful_bits: Bits
  padded_bits: Bits
  backward_rows: jax.Array
  correction_active: jax.Array

  def metrics_row(self) -> dict:
    """The last step's costs (largest site) for the train loop's rows.

    ``useful_bits_per_step``: the bits of what was actually sent (gated
    rows); ``stage_padded_bits_per_step``: the payload its compiled
    collectives move (rows padded; payload, not wire bits: those are
    :func:`~dadjax.comm.report`'s); ``backward_rows_per_step``: rows
    through a backward pass.
    """
    def largest(b):  # the largest site's
      return max(np.atleast_1d(bits_to_int(b)).tolist())
    return {"useful_bits_per_step": largest(self.useful_bits),
            "stage_padded_bits_per_step": largest(self.padded_bits),
            "backward_rows_per_step": int(np.max(host_array(self.backward_rows)))}


def _where_bits(active, b) -> Bits:
  b = as_bits(b)
  return Bits(jnp.where(active, b.hi, jnp.uint32(0)), jnp.where(active, b.lo, jnp.uint32(0)))


def dataquant(
    bits: int | None = 2,
    *,
    scale: str = "sample",
    quantizer: str = "uniform",
    block: int = 4,
    kmeans_iters: int = 10,
    correction: Compressor | str | None = None,
    correct_every: int = 1,
    gate: float | None = None,
    gate_mode: str = "threshold",
    score: str | Callable = "loss",
    gate_floor: float = 0.1,
    num_classes: int | None = None,
    input_key: str = "x",
    label_key: str = "y",
    axis_name: str | None = "data",
) -> BatchStage:
  """Data quantization with gradient correction and an importance gate.

  Args:
    bits: bits per code, in ``[1, 8]``; ``None`` sends the rows exactly, in
      their own dtype (no quantization). For ``quantizer="uniform"`` it is bits per
      coordinate; for ``"codebook"`` the codebook has ``2**bits`` codewords.
    scale: ``"sample"`` or ``"feature"`` range of the uniform quantizer
      (:mod:`dadjax._core.quantize`).
    quantizer: ``"uniform"`` (stochastic, unbiased) or ``"codebook"``
      (k-means vector quantization of blocks of ``block`` features; the
      codebook is learned on the sites' first batches and sent once).
    block: features per codeword (``"codebook"``), ``>= 1``.
    kmeans_iters: Lloyd iterations of the codebook fit and merge, ``>= 1``.
    correction: ``None`` (no correction), a
      :class:`~dadjax.compress.Compressor` or a compressor spec string
      (``"identity"``, ``"ef_scaled_sign"``, ``"ef_topk:0.01"``, ...).
    correct_every: send the correction when ``step % correct_every == 0``.
    gate: ``None`` (send every row); for ``gate_mode="threshold"`` the score
      threshold (``>= 0``), for ``"sample"`` the expected fraction of rows
      sent, in (0, 1] (:mod:`dadjax.dataquant._gate`).
    gate_mode: ``"threshold"`` or ``"sample"`` (probability proportional to
      the score, ``1/p`` reweighting: unbiased).
    score: ``"loss"``, ``"grad_norm"``, or ``(ctx, params, batch) -> (rows,)``.
    gate_floor: uniform share of the sampling probabilities, in [0, 1].
    num_classes: pack labels into ``code_bits(num_classes)`` bits; ``None``
      sends them as they are.
    input_key: the batch entry holding the inputs ``(rows, ...)``.
    label_key: the batch entry holding the targets: class labels ``(rows,)``,
      or regression targets of any shape ``(rows, ...)`` (sent exactly, in
      their dtype; ``num_classes`` must then be ``None``).
    axis_name: the sites' axis; ``None`` is one site.

  Returns:
    A :class:`~dadjax.stage.BatchStage` whose state is
    :class:`DataQuantState`. Only the inputs, labels and weights are sent;
    other batch entries are not used.

  Raises:
    ValueError: for an argument out of its range (named in the message).

  References:
    Hanna et al., "Quantizing data for distributed learning"
    (https://arxiv.org/abs/2012.07913).
  """
  opts = _check_options(bits, scale, quantizer, block, kmeans_iters, correction, correct_every,
                        gate, gate_mode, score, gate_floor, num_classes, input_key, label_key,
                        axis_name)
  return BatchStage(functools.partial(_init, opts), functools.partial(_apply, opts))


class _Options(NamedTuple):
  """The options of :func:`dataquant`, checked (see its arguments)."""

  bits: int | None
  scale: str
  quantizer: str
  block: int
  kmeans_iters: int
  correction: Compressor | None
  correct_every: int
  gate: float | None
  gate_mode: str
  score: str | Callable
  gate_floor: float
  num_classes: int | None
  input_key: str
  label_key: str
  axis_name: str | None


def _check_options(bits, scale, quantizer, block, kmeans_iters, correction, correct_every, gate,
                   gate_mode, score, gate_floor, num_classes, input_key, label_key,
                   axis_name) -> _Options:
  if bits is not None:
    bits = check_bits(bits)
  scale = check_scale(scale)
  if quantizer not in QUANTIZERS:
    raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {quantizer!r}")
  if quantizer == "codebook" and bits is None:
    raise ValueError("bits must be an int in [1, 8] for quantizer='codebook', got None")
  block = check_int("block", block, 1)
  kmeans_iters = check_int("kmeans_iters", kmeans_iters, 1)
  if isinstance(correction, str):
    try:
      correction = get_compressor(correction)
    except ValueError as e:
      raise ValueError(f"correction: not a compressor spec string: {e}") from None
  if correction is not None and not isinstance(correction, Compressor):
    raise ValueError(f"correction must be None, a Compressor or a compressor spec string, "
                     f"got {correction!r}")
  correct_every = check_int("correct_every", correct_every, 1)
  gate, gate_mode, gate_floor = check_gate(gate, gate_mode, gate_floor)
  score = check_score(score)
  num_classes = check_num_classes(num_classes)
  if axis_name is not None and not isinstance(axis_name, str):
    raise ValueError(f"axis_name must be a str or None, got {axis_name!r}")
  return _Options(bits, scale, quantizer, block, kmeans_iters, correction, correct_every, gate,
                  gate_mode, score, gate_floor, num_classes, input_key, label_key, axis_name)


def _init(opts: _Options, params) -> DataQuantState:
  z = bits_zero()
  return DataQuantState(
      correction=opts.correction.init(params) if opts.correction is not None else (),
      codebook=(jnp.zeros((1 << opts.bits, opts.block), jnp.float32)
                if opts.quantizer == "codebook" else ()),
      codebook_ready=jnp.asarray(opts.quantizer != "codebook"),
      sent_rows=jnp.int32(0), useful_bits=z, padded_bits=z,
      backward_rows=jnp.int32(0), correction_active=jnp.asarray(False))


class _Rows(NamedTuple):
  """One site's batch as the stage reads it."""

  x: jax.Array        # (rows, *feat), as given
  y: jax.Array        # (rows, *y_tail): labels or regression targets
  xf: jax.Array       # (rows, dim) fp32
  w: jax.Array        # (rows,) fp32 weights (1 or the batch's "weight")
  feat: tuple
  y_tail: tuple       # a regression target's shape per row; () for labels

  @property
  def rows(self) -> int:
    return self.x.shape[0]

  @property
  def dim(self) -> int:
    return math.prod(self.feat)

  @property
  def x_dtype(self):
    """Decoded rows keep a float input's dtype; integer inputs (e.g. uint8 pixels) become fp32."""
    return self.x.dtype if jnp.issubdtype(self.x.dtype, jnp.floating) else jnp.float32


def _site_rows(opts: _Options, batch) -> _Rows:
  x, y = jnp.asarray(batch[opts.input_key]), jnp.asarray(batch[opts.label_key])
  rows, feat = x.shape[0], x.shape[1:]
  if y.ndim < 1 or y.shape[0] != rows:
    raise ValueError(f"dataquant: batch[{opts.label_key!r}] must have one row per input row, "
                     f"shape ({rows}, ...), got {y.shape}")
  if opts.num_classes is not None and (y.ndim != 1 or not jnp.issubdtype(y.dtype, jnp.integer)):
    raise ValueError(f"dataquant: num_classes={opts.num_classes} packs integer class labels of "
                     f"shape ({rows},); batch[{opts.label_key!r}] has shape {y.shape} and dtype "
                     f"{y.dtype} (use num_classes=None for regression targets)")
  if "weight" in batch:
    w = jnp.asarray(batch["weight"], jnp.float32)
  else:
    w = jnp.ones((rows,), jnp.float32)
  return _Rows(x, y, x.reshape(rows, math.prod(feat)).astype(jnp.float32), w, feat, y.shape[1:])


class _Gated(NamedTuple):
  """The gate's decision: ``count`` rows sent, moved to the front by ``order`` (``None``: all)."""

  count: Any
  order: Any
  valid: Any
  send_w: jax.Array


def _scores(opts: _Options, ctx: StageContext, params, batch):
  if callable(opts.score):
    return opts.score(ctx, params, batch)
  if opts.score == "loss":
    return loss_scores(ctx.loss_fn, params, batch)
  return grad_norm_scores(ctx.loss_fn, params, batch)


def _gate(opts: _Options, ctx: StageContext, params, batch, r: _Rows, key) -> _Gated:
  """Step 1: a row order with the sent rows first."""
  if opts.gate is None:
    return _Gated(r.rows, None, None, r.w)
  s = jax.lax.stop_gradient(_scores(opts, ctx, params, batch))
  if opts.gate_mode == "threshold":
    decision = threshold_gate(s, opts.gate, r.w)
  else:
    decision = sample_gate(s, opts.gate, key, r.w, opts.gate_floor)
  order = jnp.argsort(jnp.logical_not(decision.mask), stable=True)
  count = jnp.sum(decision.mask).astype(jnp.int32)
  return _Gated(count, order, jnp.arange(r.rows) < count, decision.weight[order])


def _compact(g: _Gated, a):
  """Rows in gate order, padding zeroed."""
  if g.order is None:
    return a
  a = a[g.order]
  return jnp.where(g.valid.reshape((a.shape[0],) + (1,) * (a.ndim - 1)), a, jnp.zeros((), a.dtype))


def _learn_codebook(opts: _Options, state: DataQuantState, xf, k_fit, s_fit):
  """Step 2: the codebook, learned on the first batch, gathered once, merged.

  Returns:
    ``(codebook, traffic, static bits of one site's codebook)``.
  """
  fit = lambda: fit_codebook(xf, opts.bits, opts.block, k_fit, opts.kmeans_iters)
  cb_static = tree_nbits(jax.eval_shape(fit))

  def learn(_):
    gathered, _ = metered_all_gather(fit(), opts.axis_name)
    return merge_codebooks(*gathered, s_fit, opts.kmeans_iters)

  codebook = jax.lax.cond(state.codebook_ready, lambda _: state.codebook, learn, None)
  traffic = Traffic(gather=_where_bits(~state.codebook_ready, cb_static), gather_calls=1)
  return codebook, traffic, cb_static


def _encode(opts: _Options, r: _Rows, g: _Gated, codebook, key):
  """Step 3: quantize every row (so ranges do not depend on the gate), then compact.

  Returns:
    ``(data, bits per row, header bits)``.
  """
  if opts.bits is None:  # exact rows, in their own dtype
    return _compact(g, r.x.reshape(r.rows, r.dim)), r.dim * r.x.dtype.itemsize * 8, 0
  if opts.quantizer == "uniform":
    p = quantize_uniform(r.xf, opts.bits, key, opts.scale)
    if opts.scale == "sample":
      data = type(p)(_compact(g, p.words), _compact(g, p.offset), _compact(g, p.step))
    else:
      data = p._replace(words=_compact(g, p.words))
    row_bits = 32 * data.words.shape[1] + (SCALE_BITS if opts.scale == "sample" else 0)
    return data, row_bits, 0 if opts.scale == "sample" else SCALE_BITS * r.dim
  data = _compact(g, encode_codebook(r.xf, codebook, opts.bits))
  return data, 32 * data.shape[1], 0


def _decode(opts: _Options, r: _Rows, codebook, send_weights: bool, p):
  """One site's payload -> ``(x (rows, dim) fp32, y, weight)``."""
  if opts.bits is None:
    xh = p["x"].astype(jnp.float32)
  elif opts.quantizer == "uniform":
    xh = dequantize_uniform(p["x"], opts.bits, r.dim, opts.scale)
  else:
    xh = decode_codebook(p["x"], codebook, opts.bits, r.dim)
  yh = decode_labels(p["y"], opts.num_classes, r.rows, r.y.dtype)
  wh = p["weight"] if send_weights else jnp.ones((r.rows,), jnp.float32)
  if opts.gate is not None:
    wh = jnp.where(jnp.arange(r.rows) < p["count"], wh, 0.0)
  return xh, yh, wh


def _as_batch(opts: _Options, r: _Rows, xh, yh, wh) -> dict:
  return {opts.input_key: xh.reshape((-1,) + r.feat).astype(r.x_dtype), opts.label_key: yh,
          "weight": wh}


def _correct(opts: _Options, ctx: StageContext, params, r: _Rows, own: dict, grads,
             state: DataQuantState, keys: Keys):
  """Step 5: add the sites' mean correction ``g(x) - g(Q(x))``, every ``correct_every`` steps.

  Returns:
    ``(grads, correction state, active, traffic, useful bits)``.
  """
  true_batch = {opts.input_key: r.x, opts.label_key: r.y, "weight": r.w}
  sent = {}

  def corrected(cstate):
    c, _ = correction_term(ctx.grad_fn, params, true_batch, own)
    ex = exchange(opts.correction, c, cstate, keys, opts.axis_name)
    sent["traffic"] = ex.traffic
    return ex.mean, ex.state, as_bits(ex.traffic.reduce), as_bits(ex.traffic.gather)

  if opts.correct_every == 1:
    mean, corr_state, c_reduce, c_gather = corrected(state.correction)
    c_traffic = sent["traffic"]  # static sizes stay Python ints
    active = jnp.asarray(True)
  else:
    active = (ctx.step % opts.correct_every) == 0
    skip = lambda cstate: (tree_zeros_like(grads), cstate, bits_zero(), bits_zero())
    mean, corr_state, c_reduce, c_gather = jax.lax.cond(active, corrected, skip,
                                                        state.correction)
    c_traffic = Traffic(c_reduce, c_gather, sent["traffic"].reduce_calls,
                        sent["traffic"].gather_calls)
  grads = jax.tree.map(lambda g, m: g + m.astype(g.dtype), grads, mean)
  return grads, corr_state, active, c_traffic, bits_add(c_reduce, c_gather)


def _useful_bits(opts: _Options, r: _Rows, g: _Gated, wire: dict, row_bits: int,
                 header_bits: int, send_weights: bool) -> Bits:
  """Step 6: the bits of the rows actually sent (and headers, labels, weights, count)."""
  if tree_nbits(wire) != (r.rows * row_bits + header_bits + tree_nbits(wire["y"])
                          + (32 * r.rows if send_weights else 0)
                          + (32 if opts.gate is not None else 0)):
    raise AssertionError("dataquant: payload layout and bit formula disagree")
  if opts.gate is None:
    return bits_const(tree_nbits(wire))
  if opts.num_classes is None:
    label_useful = bits_from_count(g.count, r.y.dtype.itemsize * 8 * math.prod(r.y_tail))
  else:
    label_useful = bits_from_count((g.count + 31) // 32, 32 * code_bits(opts.num_classes))
  return bits_sum([bits_from_count(g.count, row_bits + (32 if send_weights else 0)),
                   bits_const(header_bits + 32), label_useful])


def _apply(opts: _Options, ctx: StageContext, params, batch, state: DataQuantState
           ) -> StageOutput:
  """The stage's step: gate, quantize, gather, correct one site's batch (module docstring)."""
  if ctx.axis_name != opts.axis_name:
    raise ValueError(f"dataquant was built for axis_name={opts.axis_name!r} but the step runs it "
                     f"with axis_name={ctx.axis_name!r}")
  r = _site_rows(opts, batch)
  rows, n_sites = r.rows, axis_size(opts.axis_name)
  k_quant, k_gate, k_fit, k_corr = (jax.random.fold_in(ctx.key, i) for i in range(4))
  s_fit, s_corr = (jax.random.fold_in(ctx.shared_key, i) for i in range(2))
  send_weights = "weight" in batch or (opts.gate is not None and opts.gate_mode == "sample")
  traffic, backward = NO_TRAFFIC, n_sites * rows
  g = _gate(opts, ctx, params, batch, r, k_gate)
  if opts.gate is not None and opts.score == "grad_norm":
    backward += rows
  codebook, ready = state.codebook, state.codebook_ready
  if opts.quantizer == "codebook":
    codebook, cb_traffic, cb_static = _learn_codebook(opts, state, r.xf, k_fit, s_fit)
    traffic, ready = traffic_add(traffic, cb_traffic), jnp.asarray(True)
  data, row_bits, header_bits = _encode(opts, r, g, codebook, k_quant)
  wire = {"x": data, "y": encode_labels(_compact(g, r.y), opts.num_classes)}
  if send_weights:
    wire["weight"] = g.send_w
  if opts.gate is not None:
    wire["count"] = g.count
  # 4. Gather and the shared pass on every site's quantized rows.
  gathered, gather_traffic = metered_all_gather(wire, opts.axis_name)
  traffic = traffic_add(traffic, gather_traffic)
  xh, yh, wh = jax.vmap(functools.partial(_decode, opts, r, codebook, send_weights))(gathered)
  gbatch = _as_batch(opts, r, xh.reshape(n_sites * rows, r.dim),
                     yh.reshape((n_sites * rows,) + r.y_tail), wh.reshape(-1))
  result = ctx.grad_fn(params, gbatch, jax.random.fold_in(ctx.shared_key, 2))
  grads, corr_state, active, corr_useful = (result.grads, state.correction, jnp.asarray(False),
                                            bits_zero())
  if opts.correction is not None:
    own = _as_batch(opts, r, *_decode(opts, r, codebook, send_weights, wire))
    grads, corr_state, active, c_traffic, corr_useful = _correct(
        opts, ctx, params, r, own, grads, state, Keys(s_corr, k_corr))
    traffic = traffic_add(traffic, c_traffic)
    backward = backward + jnp.where(active, 2 * rows, 0)
  useful = _useful_bits(opts, r, g, wire, row_bits, header_bits, send_weights)
  if opts.quantizer == "codebook":
    useful = bits_add(useful, _where_bits(~state.codebook_ready, cb_static))
  useful = bits_add(useful, corr_useful)
  padded_bits = bits_add(as_bits(traffic.reduce), as_bits(traffic.gather))
  new_state = DataQuantState(
      correction=corr_state, codebook=codebook, codebook_ready=ready,
      sent_rows=jnp.asarray(g.count, jnp.int32), useful_bits=useful, padded_bits=padded_bits,
      backward_rows=jnp.asarray(backward, jnp.int32), correction_active=active)
  # 7. What the step reports: loss and aux of this site's own rows, exact inputs.
  site_loss, site_aux = ctx.loss_fn(params, batch)
  out = GradResult(site_loss, site_aux, grads, result.model_state, result.extra_args)
  return StageOutput(out, new_state, traffic)
