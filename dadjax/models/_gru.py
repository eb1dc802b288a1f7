"""GRU sequence classifier with a hand-written cell (dense maps via ``dense``)."""

from typing import Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype


def _gru_update(h: jnp.ndarray, xp: jnp.ndarray, hp: jnp.ndarray) -> jnp.ndarray:
  """One GRU update from the input (``xp``) and hidden (``hp``) projections."""
  xr, xz, xn = jnp.split(xp, 3, axis=-1)
  hr, hz, hn = jnp.split(hp, 3, axis=-1)
  r = nn.sigmoid(xr + hr)
  z = nn.sigmoid(xz + hz)
  n = jnp.tanh(xn + r * hn)
  return (1.0 - z) * n + z * h


class GRUStep(nn.Module):
  """One GRU time step given the pre-computed input projection.

  Inputs:  ``h`` ``(batch, hidden)``; ``xp`` ``(batch, 3 * hidden)`` = the
           input-to-hidden projection ``W_i x_t + b_i`` (gates r, z, n).
  Returns: ``(h_new, h_new)`` (carry, per-step output), both
           ``(batch, hidden)``.

  The hidden-to-hidden map ``W_h h + b_h`` (``3 * hidden`` features, named
  ``"hh"``, orthogonal init) is a ``dense`` layer applied at every step::

      r = sigmoid(xr + hr); z = sigmoid(xz + hz); n = tanh(xn + r * hn)
      h_new = (1 - z) * n + z * h

  (PyTorch / cuDNN convention: the reset gate multiplies ``W_hn h + b_hn``.)
  """

  hidden: int
  dense: Callable[..., nn.Module] = nn.Dense

  @nn.compact
  def __call__(self, h: jnp.ndarray, xp: jnp.ndarray) -> Tuple[jnp.ndarray, jnp.ndarray]:
    hp = self.dense(
      3 * self.hidden, use_bias=True, name="hh", kernel_init=nn.initializers.orthogonal()
    )(h)
    h = _gru_update(h, xp, hp)
    return h, h


# Scan over time (axis 1 of xp). Parameters and the "dad_state" collection are
# shared across steps; anything sown into "comm" is stacked along a new
# leading time axis.
_ScanGRUStep = nn.scan(
  GRUStep,
  variable_broadcast=["params", "dad_state"],
  variable_axes={"comm": 0},
  split_rngs={"params": False},
  in_axes=1,
  out_axes=1,
)


class GRUTimeRows(nn.Module):
  """The GRU recurrence with ONE hidden-to-hidden ``dense`` call over all time rows.

  Same math, parameters (``hh/kernel`` (hidden, 3 hidden), ``hh/bias``)
  and result as ``nn.scan(GRUStep)``, but the ``dense`` layer ``"hh"`` is
  called once, on the rows ``(batch, T, hidden)`` of every step's input
  ``h_{t-1}``, so a layer that synchronizes itself in its backward pass
  (:class:`dadjax.dad.Dense`) runs ONE backward over ``batch * T`` rows:
  one all-gather of ``[A, D]`` (exact dAD) or one rank-r factorization of
  ``sum_t A_t^T D_t`` (rank-dAD), instead of one per time step. This is
  the layout of the dAD paper, where the rows of a recurrent layer carry
  the time axis.

  Construction ("two-pass tap"); ``K``, ``b`` are ``hh``'s parameters read
  with ``stop_gradient``:

  1. gradient-free pass: run the recurrence with ``h K + b`` to get the
     hh inputs ``A = [h_0 .. h_{T-1}]`` ``(batch, T, hidden)``
     (``stop_gradient``);
  2. ``hh_all = hh(A)``, the one ``dense`` call, and the zero-valued tap
     ``tap = hh_all - stop_gradient(hh_all)``;
  3. differentiable pass: ``hp_t = h_{t-1} K + b + tap_t``.

  The value of ``hp_t`` is the true hidden projection (the tap is zero and
  pass 1 computes the same states as pass 3); the gradient with respect
  to ``h_{t-1}`` (hence to earlier steps and the inputs) flows through
  ``K``; the gradient with respect to ``K`` and ``b`` flows only through
  the tap, whose cotangent is exactly ``D_t = dL/dhp_t``, so the ``dense``
  layer's backward pass sees ``A`` and ``D`` for all ``batch * T`` rows at
  once.

  Cost: one extra forward recurrence (pass 1, no backward) and one extra
  ``(batch * T, hidden) x (hidden, 3 hidden)`` forward matmul (the tap).
  The ``dense`` layer must name its parameters ``kernel`` and ``bias``
  (as ``nn.Dense`` and ``dadjax.dad.Dense`` do) and compute
  ``x @ kernel + bias``. Its sown ``"comm"`` entries and its
  ``"dad_state"`` come from one call (no time axis; ``uses`` is 1).
  At initialization the layer is called once on zeros of the same shape
  to create its variables (the tap is then zero).

  Inputs:  ``h0`` ``(batch, hidden)``; ``xp`` ``(batch, T, 3 hidden)``.
  Returns: the final hidden state ``(batch, hidden)``.
  """

  hidden: int
  dense: Callable[..., nn.Module] = nn.Dense

  @nn.compact
  def __call__(self, h0: jnp.ndarray, xp: jnp.ndarray) -> jnp.ndarray:
    hh = self.dense(
      3 * self.hidden, use_bias=True, name="hh", kernel_init=nn.initializers.orthogonal()
    )
    rows_shape = xp.shape[:-1] + (self.hidden,)
    initializing = not hh.has_variable("params", "kernel")
    if initializing:  # create hh's variables (one call, same rows as below)
      hh(jnp.zeros(rows_shape, h0.dtype))
    params = hh.variables["params"]
    kernel = jax.lax.stop_gradient(params["kernel"])
    bias = jax.lax.stop_gradient(params["bias"])
    precision = getattr(hh, "precision", None)
    dtype = getattr(hh, "dtype", None)

    def project(h):  # hh's forward math, as nn.Dense computes it
      h, k, b = promote_dtype(h, kernel, bias, dtype=dtype)
      return jnp.dot(h, k, precision=precision) + b

    xs = jnp.swapaxes(xp, 0, 1)  # (T, batch, 3h)

    def first(h, xp_t):
      return _gru_update(h, xp_t, project(h)), h

    _, a = jax.lax.scan(first, h0, xs)  # a[t] = h_{t-1}, the input of hh at step t
    a = jax.lax.stop_gradient(jnp.swapaxes(a, 0, 1))  # (batch, T, hidden)

    if initializing:
      tap = jnp.zeros(xp.shape[:-1] + (3 * self.hidden,), xp.dtype)
    else:
      hh_all = hh(a)  # the one dense call over batch * T rows
      tap = hh_all - jax.lax.stop_gradient(hh_all)

    def second(h, inputs):
      xp_t, tap_t = inputs
      return _gru_update(h, xp_t, project(h) + tap_t), None

    h, _ = jax.lax.scan(second, h0, (xs, jnp.swapaxes(tap, 0, 1)))
    return h


class GRUClassifier(nn.Module):
  """Single-layer GRU; classifies from the final hidden state.

  Input: float ``(batch, T, features)``, or int tokens ``(batch, T)`` when
  ``vocab_size`` is given (embedded with ``nn.Embed``).

  Output: logits ``(batch, num_classes)``.

  The input-to-hidden projection (``3 * hidden``, named ``"ih"``) is applied
  once to the whole sequence ``(batch, T, d)`` before the recurrence (rows =
  batch * time, as in cuDNN). By default the hidden-to-hidden projection
  runs inside an ``nn.scan`` over time (``cell/hh``), so a dAD layer there
  synchronizes once per time step (T collectives; T rank-r factorizations
  for rank-dAD) and its ``"comm"`` entries are stacked over time.

  With ``stack_time_rows=True`` the recurrence is :class:`GRUTimeRows`:
  ``cell/hh`` is called once on all ``batch * T`` rows, as in the dAD
  paper (rows carry the time axis), so dAD synchronizes it with one
  collective (rank-dAD: one factorization of ``sum_t A_t^T D_t``, ``r
  (hidden + 3 hidden)`` numbers once instead of T times). Outputs and
  gradients are the same as the default; the parameter tree is identical
  (``embed``, ``ih``, ``cell/hh/{kernel,bias}``, ``head``), as is the
  ``"dad_state"`` path (``cell/hh/dad``, with ``uses`` 1 instead of T).
  Cost: one extra forward recurrence and one extra forward hh matmul over
  all rows (see :class:`GRUTimeRows`).

  Attributes:
    hidden: hidden-state size (default 64).
    num_classes: number of classes (default 10).
    vocab_size: token vocabulary size; ``None`` (default) for float inputs.
    embed_dim: embedding size for token inputs (default 32).
    dense: factory for every dense layer (default ``nn.Dense``).
    stack_time_rows: one hh call over all time rows (default False).

  Reference: Cho et al., "Learning Phrase Representations using RNN
  Encoder-Decoder for Statistical Machine Translation", EMNLP 2014;
  Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
  Differentiation" (https://arxiv.org/abs/2102.09631).
  """

  hidden: int = 64
  num_classes: int = 10
  vocab_size: Optional[int] = None
  embed_dim: int = 32
  dense: Callable[..., nn.Module] = nn.Dense
  stack_time_rows: bool = False

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    del train
    if self.vocab_size is not None:
      x = nn.Embed(self.vocab_size, self.embed_dim, name="embed")(x)
    xp = self.dense(3 * self.hidden, use_bias=True, name="ih")(x)  # (b, T, 3h)
    h0 = jnp.zeros_like(
      xp[:, 0, : self.hidden]
    )  # inherits the input's varying-axes type under shard_map
    if self.stack_time_rows:
      h = GRUTimeRows(self.hidden, self.dense, name="cell")(h0, xp)
    else:
      h, _ = _ScanGRUStep(self.hidden, self.dense, name="cell")(h0, xp)
    return self.dense(self.num_classes, use_bias=True, name="head")(h)
