"""Distributed auto-differentiation of dense layers: a ``custom_vjp`` and a Flax layer.

For ``y = x W + b`` on rows ``A`` (n x d_in, every leading axis of ``x``
flattened) the backward pass receives the output deltas ``D`` (n x d_out)
and the weight gradient is ``A^T D``. Instead of all-reducing that
d_in x d_out matrix, the backward pass of :func:`dense` synchronizes the
layer itself, by one of four routes chosen by ``mode``:

* ``"exact"`` (dAD): all-gather ``[A, D]`` (n (d_in + d_out) numbers per
  site); every site computes the same exact global gradient. With
  ``quantize_bits=b`` (quantized dAD, :mod:`dadjax.dad._quantized`) ``A``
  and ``D`` travel stochastically rounded to ``b`` bits per number: the
  gradient is then exact in expectation.
* ``"rank"`` (rank-dAD): each site factorizes its local ``A^T D`` to rank r
  with the structured power iteration (:func:`~dadjax.dad.factorize`) and
  all-gathers the factors, r (d_in + d_out) numbers, plus its d_out column
  sums of ``D`` for the exact bias. ``aggregation="two_way"`` reduces the
  gathered factors to one global rank-r result (a second power iteration)
  and broadcasts it from site 0.
* ``"auto"``: per layer, the cheaper *exact* route by bits on the wire:
  ``"exact"`` when ``n (d_in + d_out) < d_in d_out + d_out`` (bias
  included), else a plain all-reduce of ``A^T D`` inside the backward pass.
* ``"local"``: no communication; the layer then behaves like
  ``flax.linen.Dense`` and is synchronized with the other parameters by
  :func:`~dadjax.dad.synchronize`.

Scaling follows the data-parallel convention of the rest of dadjax: each
site's loss is the mean over its own rows and the synchronized gradient is
the mean over sites, ``(1/N) sum_s A_s^T D_s``; this is what
``dadjax.allreduce`` gives for a plain layer. The one exception is a kernel
that is *invariant* across sites inside ``shard_map(check_vma=True)``
(a replicated ``P()`` parameter): there JAX's own autodiff sums the
per-site contributions (the transpose of the implicit ``pvary``), so the
backward pass returns the sum, typed invariant, and matches ``jax.grad`` of
the same program with ``flax.linen.Dense``.

Layer state (warm-start bases, error-feedback memories, the step counter of
the shared random key, effective ranks) lives in the ``"dad_state"``
collection. The backward pass returns the *new* state as the cotangent of
the state input and the train step overwrites the state with that
"gradient" (:mod:`dadjax.parallel`). A layer applied K times in one forward
pass (``nn.scan`` over time with ``variable_broadcast=["dad_state"]``,
weight sharing) receives the *sum* of K cotangents, so the state stores
sums together with a ``uses`` count and is read back as ``sum / uses``:
the step counter and effective rank come out right, warm starts are the
mean of the K bases, and the K error-feedback memories, each re-applied by
all K uses, add up to exactly the total residual.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from flax.linen.linear import default_kernel_init

from dadjax.comm import axis_size, bits_const, gather_sites, site_index, sum_over_sites
from dadjax.dad._power import factorize
from dadjax.dad._quantized import quantize_keys, quantized_gather, quantized_gather_bits
from dadjax.parallel import COMM_COLLECTION, STATE_COLLECTION

STATE_NAME = "dad"
MODES = ("exact", "rank", "auto", "local")
AGGREGATIONS = ("one_way", "two_way")
ROUTES = ("gather", "factors", "allreduce", "local")


def _check_int(name, value, low):
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class DadConfig:
  """Static configuration of a dAD layer (hashable: a ``nondiff`` argument).

  Attributes:
    axis_name: mesh / pmap / vmap axis of the sites; ``None``: one site.
    mode: ``"exact"``, ``"rank"``, ``"auto"`` or ``"local"`` (module doc).
    rank: components per site for ``"rank"``, >= 1. Default 4.
    iters: maximum power iterations per component, >= 1. Default 10.
    tol: power-iteration convergence threshold on ``||b_new - b||``, >= 0.
      Default 1e-3 (the authors' default).
    aggregation: ``"one_way"`` (sum of all sites' factors, rank <= N r) or
      ``"two_way"`` (global rank-r result). Default ``"one_way"``.
    warm_start: start each step's power iteration from the last step's
      right factors (``"rank"`` only). Default False.
    error_feedback: keep each site's compression residual and add it to the
      next step's local gradient (``"rank"`` only). Default False.
    seed: seed of the random starts; the key is ``fold_in(key(seed),
      step)``, identical on every site. Default 0.
    precision: ``jax.lax.Precision`` of the matmuls. Default ``None``.
    quantize_bits: ``mode="exact"`` only: send ``A`` and ``D`` stochastically
      rounded to this many bits per number, in ``[1, 8]`` (quantized dAD,
      unbiased; :mod:`dadjax.dad._quantized`). Default ``None`` (fp rows).
  """

  axis_name: str | None = "data"
  mode: str = "exact"
  rank: int = 4
  iters: int = 10
  tol: float = 1e-3
  aggregation: str = "one_way"
  warm_start: bool = False
  error_feedback: bool = False
  seed: int = 0
  precision: Any = None
  quantize_bits: int | None = None

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
    _check_int("rank", self.rank, 1)
    _check_int("iters", self.iters, 1)
    if isinstance(self.tol, bool) or not isinstance(self.tol, (int, float)) or not (
        math.isfinite(self.tol) and self.tol >= 0):
      raise ValueError(f"tol must be a finite number >= 0, got {self.tol!r}")
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
    if self.axis_name is not None and not isinstance(self.axis_name, str):
      raise ValueError(f"axis_name must be a str or None, got {self.axis_name!r}")
    for flag in ("warm_start", "error_feedback"):
      if getattr(self, flag) and self.mode != "rank":
        raise ValueError(f"{flag} applies to mode='rank' only, got mode={self.mode!r}")
    _check_int("seed", self.seed, 0)
    if self.quantize_bits is not None:
      if self.mode != "exact":
        raise ValueError(f"quantize_bits applies to mode='exact' only, got mode={self.mode!r}")
      if (isinstance(self.quantize_bits, bool) or not isinstance(self.quantize_bits, int)
          or not 1 <= self.quantize_bits <= 8):
        raise ValueError(f"quantize_bits must be None or an int in [1, 8], "
                         f"got {self.quantize_bits!r}")


def layer_route(config: DadConfig, rows: int, d_in: int, d_out: int, use_bias: bool = True) -> str:
  """How a layer call synchronizes its gradient (trace-time choice).

  Args:
    config: the layer's :class:`DadConfig`.
    rows: rows per site of this call (product of the input's leading axes).
    d_in: input features.
    d_out: output features.
    use_bias: whether the layer has a bias.

  Returns:
    ``"gather"`` (exact dAD), ``"factors"`` (rank-dAD), ``"allreduce"``
    (psum of ``A^T D``) or ``"local"`` (no communication).
  """
  if config.mode == "exact":
    return "gather"
  if config.mode == "rank":
    return "factors"
  if config.mode == "local":
    return "local"
  # auto: the cheaper exact route; ties go to the all-reduce (one fewer
  # moving part, and a reduce can use in-network aggregation).
  dad = rows * (d_in + d_out)
  dense = d_in * d_out + (d_out if use_bias else 0)
  return "gather" if dad < dense else "allreduce"


def layer_bits(config: DadConfig, rows: int, d_in: int, d_out: int, use_bias: bool = True,
               number_bits: int = 32) -> tuple[int, int]:
  """Bits one site hands to collectives in one backward pass of one call.

  * gather (exact dAD): ``rows (d_in + d_out) b``; the bias gradient is the
    column sum of the gathered ``D``, no extra bits. With ``quantize_bits``:
    :func:`~dadjax.dad._quantized.quantized_gather_bits`.
  * factors (rank-dAD): ``r (d_in + d_out) b`` gathered, plus ``d_out b``
    for the exact bias (``D`` itself is not sent); two-way adds the
    broadcast of the global factors, ``r (d_in + d_out) b`` all-reduced.
  * allreduce: ``(d_in d_out + d_out) b`` (bias included when present).
  * local, or no axis: nothing.

  ``b`` is ``number_bits`` (the dtype the rows travel in; factors are at
  least fp32).

  Args:
    config: the layer's :class:`DadConfig`.
    rows: rows per site of this call.
    d_in: input features.
    d_out: output features.
    use_bias: whether the layer has a bias.
    number_bits: bits per transmitted number. Default 32.

  Returns:
    ``(gather_bits, reduce_bits)`` as Python ints.
  """
  if config.axis_name is None:
    return 0, 0
  route = layer_route(config, rows, d_in, d_out, use_bias)
  bias = d_out if use_bias else 0
  if route == "gather" and config.quantize_bits is not None:
    return quantized_gather_bits(rows, d_in, d_out, config.quantize_bits), 0
  if route == "gather":
    return rows * (d_in + d_out) * number_bits, 0
  if route == "allreduce":
    return 0, (d_in * d_out + bias) * number_bits
  if route == "factors":
    b = max(number_bits, 32)
    gather = (config.rank * (d_in + d_out) + bias) * b
    reduce = config.rank * (d_in + d_out) * b if config.aggregation == "two_way" else 0
    return gather, reduce
  return 0, 0


def init_state(config: DadConfig, d_in: int, d_out: int) -> dict[str, jax.Array] | None:
  """The layer's initial ``"dad_state"`` entry (``None`` for ``"local"``).

  Every leaf is float32 (it is differentiated by the train step). Fields:
  ``uses`` and ``step`` always; for ``"rank"``: ``rank`` (local effective
  rank), ``basis`` (d_out, r) with ``warm_start``, ``memory`` (d_in, d_out)
  with ``error_feedback``, and for two-way ``rank_global`` (+
  ``basis_global`` with ``warm_start``). Values are sums over the uses of
  the last step; read them with :func:`current_state`.
  """
  if config.mode == "local":
    return None
  zero = jnp.zeros((), jnp.float32)
  state = {"uses": zero, "step": zero}
  if config.mode == "rank":
    state["rank"] = zero
    if config.warm_start:
      state["basis"] = jnp.zeros((d_out, config.rank), jnp.float32)
    if config.error_feedback:
      state["memory"] = jnp.zeros((d_in, d_out), jnp.float32)
    if config.aggregation == "two_way":
      state["rank_global"] = zero
      if config.warm_start:
        state["basis_global"] = jnp.zeros((d_out, config.rank), jnp.float32)
  return state


def current_state(state: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """A stored state divided by its ``uses`` (zeros before the first step)."""
  uses = state["uses"]
  live = uses > 0
  safe = jnp.where(live, uses, 1.0)
  out = {k: jnp.where(live, v / safe, jnp.zeros_like(v)) for k, v in state.items()}
  out["step"] = jnp.round(out["step"])
  out["uses"] = jnp.ones_like(uses)
  return out


# -- variance typing under shard_map(check_vma=True) -------------------------


def _varying(x, axis_name) -> bool:
  """Whether ``x`` is typed as varying along ``axis_name`` (shard_map only)."""
  if axis_name is None or x is None:
    return False
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)  # jax 0.10
  vary = mat.varying if mat is not None else getattr(aval, "vma", frozenset())
  return axis_name in vary


def _match(ct, primal, axis_name, typed: bool, reduce=jax.lax.pmean):
  """Give a cotangent the variance type of its primal (only where types are checked).

  A varying cotangent of an invariant primal is reduced with ``reduce``:
  ``psum`` where per-site contributions add up (JAX's transpose of the
  implicit ``pvary``), ``pmean`` for values equal on every site by
  construction (synchronized gradients, the step counter), which types them
  invariant without changing them.
  """
  if not typed or ct is None:
    return ct
  want, have = _varying(primal, axis_name), _varying(ct, axis_name)
  if want and not have:
    return jax.lax.pcast(ct, axis_name, to="varying")
  if have and not want:
    return reduce(ct, axis_name)
  return ct


# -- the custom_vjp -------------------------------------------------------------


def _forward(x, kernel, bias, config):
  y = jnp.dot(x, kernel, precision=config.precision)
  return y if bias is None else y + bias


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _dense(x, kernel, bias, state, config):
  del state  # read by the backward pass only
  return _forward(x, kernel, bias, config)


def _dense_fwd(x, kernel, bias, state, config):
  return _forward(x, kernel, bias, config), (x, kernel, bias, state)


def _dense_bwd(config, res, dy):
  x, kernel, bias, state = res
  d_in, d_out = kernel.shape
  axis = config.axis_name
  dot = functools.partial(jnp.dot, precision=config.precision)
  a = x.reshape(-1, d_in)
  d = dy.reshape(-1, d_out)
  dx = dot(dy, kernel.T).astype(x.dtype)  # input gradient: local, like any layer

  typed = any(_varying(v, axis) for v in (a, d, kernel, bias))
  invariant = typed and not _varying(kernel, axis)
  # Replicated invariant kernel: JAX sums per-site contributions; otherwise
  # the data-parallel mean over sites (module docstring).
  scale = 1.0 if invariant else 1.0 / axis_size(axis)
  route = layer_route(config, a.shape[0], d_in, d_out, bias is not None)
  cur = current_state(state) if state is not None else None
  new_state = None if state is None else {
      "uses": jnp.ones((), jnp.float32), "step": cur["step"] + 1}

  if route == "gather" and config.quantize_bits is not None:
    step = cur["step"] if cur is not None else 0
    keys = quantize_keys(config.seed, step, axis)
    a_all, d_all = quantized_gather(a, d, config.quantize_bits, keys, axis, invariant=invariant)
    gk = dot(a_all.T, d_all) * scale
    gb = jnp.sum(d_all, axis=0) * scale
  elif route == "gather":
    rows = gather_sites(jnp.concatenate([a, d], axis=1), axis, invariant=invariant)
    rows = rows.reshape(-1, d_in + d_out)
    a_all, d_all = rows[:, :d_in], rows[:, d_in:]
    gk = dot(a_all.T, d_all) * scale
    gb = jnp.sum(d_all, axis=0) * scale
  elif route == "allreduce":
    gk, gb = sum_over_sites((dot(a.T, d), jnp.sum(d, axis=0)), axis)
    gk, gb = gk * scale, gb * scale
  elif route == "local":
    gk, gb = dot(a.T, d), jnp.sum(d, axis=0)
  else:
    gk, gb, extra = _rank_dad(config, a, d, cur, invariant, scale)
    if new_state is not None:
      new_state.update(extra)
    if "memory" in extra and typed and not _varying(state["memory"], axis):
      raise ValueError("error_feedback keeps one memory per site: the layer's dad_state must "
                       "be per-site (varying along the axis), not a replicated value")

  dx = _match(dx, x, axis, typed, reduce=jax.lax.psum)
  gk = _match(gk.astype(kernel.dtype), kernel, axis, typed)
  gb = None if bias is None else _match(gb.astype(bias.dtype), bias, axis, typed)
  if new_state is not None:
    new_state = {k: _match(v.astype(jnp.float32), state[k], axis, typed) for k, v in new_state.items()}
  return dx, gk, gb, new_state


_dense.defvjp(_dense_fwd, _dense_bwd)


def _rank_dad(config, a, d, cur, invariant, scale):
  """rank-dAD: local factorization, all-gather of the factors, aggregation."""
  axis, r = config.axis_name, config.rank
  d_in, d_out = a.shape[1], d.shape[1]
  dot = functools.partial(jnp.dot, precision=config.precision)
  step = jnp.zeros((), jnp.int32) if cur is None else cur["step"].astype(jnp.int32)
  key_local, key_global = jax.random.split(jax.random.fold_in(jax.random.key(config.seed), step))
  memory = cur.get("memory") if cur is not None else None
  fac = factorize(a, d, rank=r, iters=config.iters, tol=config.tol, key=key_local,
                  init=cur.get("basis") if cur is not None else None,
                  memory=memory, precision=config.precision)
  bias_sum = jnp.sum(d, axis=0).astype(fac.u.dtype)
  # One collective per layer: factors and D's column sums travel together.
  payload = jnp.concatenate([fac.u.ravel(), fac.v.ravel(), bias_sum])
  gathered = gather_sites(payload, axis, invariant=invariant)
  n_sites = gathered.shape[0]
  u_all = gathered[:, :d_in * r].reshape(n_sites, d_in, r)
  v_all = gathered[:, d_in * r:(d_in + d_out) * r].reshape(n_sites, d_out, r)
  gb = jnp.sum(gathered[:, (d_in + d_out) * r:], axis=0) * scale
  one_way = jnp.einsum("sir,sor->io", u_all, v_all, precision=config.precision)

  extra = {"rank": fac.rank.astype(jnp.float32)}
  if config.warm_start:
    extra["basis"] = fac.v
  applied = one_way
  if config.aggregation == "two_way":
    # The gathered factors are rows of a factored matrix:
    # sum_s U_s V_s^T = A2^T D2 with A2 = [U_s^T], D2 = [V_s^T] (N r rows).
    a2 = u_all.transpose(0, 2, 1).reshape(n_sites * r, d_in)
    d2 = v_all.transpose(0, 2, 1).reshape(n_sites * r, d_out)
    fac2 = factorize(a2, d2, rank=r, iters=config.iters, tol=config.tol, key=key_global,
                     init=cur.get("basis_global") if cur is not None else None,
                     precision=config.precision)
    # Second round of the protocol: site 0 broadcasts the global factors, so
    # every replica applies bit-identical updates even where hardware or
    # reduction order would make redundant local computations differ.
    payload2 = jnp.concatenate([fac2.u.ravel(), fac2.v.ravel()])
    if axis is not None:
      payload2 = sum_over_sites(jnp.where(site_index(axis) == 0, payload2, 0), axis)
    u2 = payload2[:d_in * r].reshape(d_in, r)
    v2 = payload2[d_in * r:].reshape(d_out, r)
    applied = dot(u2, v2.T)
    extra["rank_global"] = fac2.rank.astype(jnp.float32)
    if config.warm_start:
      extra["basis_global"] = v2
  if config.error_feedback:
    # Residual of this site's compression; for two-way each site also keeps
    # 1/N of the second stage's error, so the memories sum to exactly
    # (what should have been applied) - (what was applied).
    residual = dot(a.T, d) + memory - dot(fac.u, fac.v.T)
    if config.aggregation == "two_way":
      residual = residual + (one_way - applied) / n_sites
    extra["memory"] = residual
  return applied * scale, gb, extra


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    state: dict[str, jax.Array] | None = None,
    *,
    config: DadConfig | None = None,
    **options,
) -> jax.Array:
  """``y = x @ kernel + bias`` whose backward pass synchronizes the layer.

  The forward pass is a plain dense layer. The backward pass gives ``x``
  its local input gradient, and ``kernel`` / ``bias`` the *synchronized*
  gradient over ``axis_name`` by the configured route (module docstring):
  no optimizer-side all-reduce is needed for them. ``state``'s cotangent is
  the layer's new state (see :func:`init_state`).

  Args:
    x: (..., d_in) inputs; all leading axes are rows.
    kernel: (d_in, d_out) weights.
    bias: (d_out,) or ``None``.
    state: the layer's state from :func:`init_state`, or ``None`` (then
      ``warm_start`` and ``error_feedback`` are unavailable and the random
      key uses step 0).
    config: a :class:`DadConfig`; or pass its fields as keyword ``options``
      (``axis_name="data"``, ``mode="exact"``, ``rank=4``, ``iters=10``,
      ``tol=1e-3``, ``aggregation="one_way"``, ...).

  Returns:
    (..., d_out) outputs.

  Raises:
    ValueError: for invalid options (naming the argument), or state options
      without a state.

  References:
    Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
    Differentiation" (https://arxiv.org/abs/2102.09631).
  """
  if config is None:
    config = DadConfig(**options)
  elif options:
    raise ValueError(f"pass either config or options, not both: {sorted(options)}")
  if state is None and (config.warm_start or config.error_feedback):
    raise ValueError("state: warm_start and error_feedback need the layer state "
                     "(init_state(config, d_in, d_out))")
  if kernel.ndim != 2 or x.shape[-1] != kernel.shape[0]:
    raise ValueError(f"kernel must be (d_in, d_out) with d_in = x.shape[-1]; got x "
                     f"{x.shape}, kernel {kernel.shape}")
  return _dense(x, kernel, bias, state, config)


def _layer_seed(seed: int, path) -> int:
  # Each layer draws its own random starts; the path is the same on every
  # site, so the key stays shared.
  return (seed + zlib.crc32("/".join(map(str, path)).encode())) % (1 << 31)


class Dense(nn.Module):
  """Drop-in for ``flax.linen.Dense`` that synchronizes itself in the backward pass.

  Same parameters (``kernel`` (d_in, features), ``bias`` (features,)), same
  default initializers and call ``Dense(features, use_bias=True,
  kernel_init=..., name=...)(x)`` on ``x`` (..., d_in). The extra fields
  configure distributed auto-differentiation (see :class:`DadConfig`);
  the layer keeps its state in the ``"dad_state"`` collection (none for
  ``mode="local"``) and sows the bits it sends as
  :class:`~dadjax.comm.Bits` into ``"comm"`` (``gather_bits`` /
  ``reduce_bits``), which the train step forwards to the optimizer.
  Applied without a ``dad_state`` (e.g. evaluation with params only) the
  layer uses a fresh, transient state.

  With ``capture=True`` the layer exposes its rows for research: the input
  ``A`` is sown into ``"intermediates"`` as ``inputs``, and the output is
  passed through ``self.perturb("outputs", y)``, so the gradient with
  respect to the ``"perturbations"`` collection is ``D`` (same shape as
  ``y``). Outside ``nn.scan`` only (scan would need those collections in
  its ``variable_axes``).

  Attributes:
    features: output features.
    use_bias: add a bias. Default True.
    dtype: computation dtype (default: inferred, as in Flax).
    param_dtype: parameter dtype. Default float32.
    precision: matmul precision. Default ``None``.
    kernel_init: default ``lecun_normal()`` (Flax's).
    bias_init: default zeros.
    axis_name, mode, rank, iters, tol, aggregation, warm_start,
    error_feedback, seed, quantize_bits: see :class:`DadConfig` (defaults
      ``"data"``, ``"exact"``, 4, 10, 1e-3, ``"one_way"``, False, False, 0,
      None). The seed is combined with the layer's path, so layers draw
      different starts (and rounding noise).
    capture: expose ``A`` and ``D`` (above). Default False.

  References:
    Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
    Differentiation" (https://arxiv.org/abs/2102.09631).
  """

  features: int
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Callable[..., Any] = default_kernel_init
  bias_init: Callable[..., Any] = nn.initializers.zeros_init()
  axis_name: str | None = "data"
  mode: str = "exact"
  rank: int = 4
  iters: int = 10
  tol: float = 1e-3
  aggregation: str = "one_way"
  warm_start: bool = False
  error_feedback: bool = False
  seed: int = 0
  quantize_bits: int | None = None
  capture: bool = False

  def __post_init__(self):
    _check_int("features", self.features, 1)
    self.config()  # fail at construction, naming the bad argument
    super().__post_init__()

  def config(self, seed: int | None = None) -> DadConfig:
    """This layer's :class:`DadConfig` (``seed`` overrides the field).

    The module repeats DadConfig's fields so that ``Dense(features, rank=2)``
    works like ``nn.Dense``; the config is read from them by name, so a new
    DadConfig field needs only its module field.
    """
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(DadConfig)}
    if seed is not None:
      fields["seed"] = seed
    return DadConfig(**fields)

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    d_in = jnp.shape(inputs)[-1]
    kernel = self.param("kernel", self.kernel_init, (d_in, self.features), self.param_dtype)
    bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias else None)
    inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    config = self.config(seed=_layer_seed(self.seed, self.path))
    state = None
    if config.mode != "local":
      if self.is_mutable_collection(STATE_COLLECTION) or self.has_variable(STATE_COLLECTION, STATE_NAME):
        state = self.variable(STATE_COLLECTION, STATE_NAME, init_state, config, d_in,
                              self.features).value
      else:
        state = init_state(config, d_in, self.features)
    if self.capture:
      self.sow("intermediates", "inputs", inputs)
    y = _dense(inputs, kernel, bias, state, config)
    rows = math.prod(jnp.shape(inputs)[:-1])
    gather, reduce = layer_bits(config, rows, d_in, self.features, self.use_bias,
                                jnp.dtype(inputs.dtype).itemsize * 8)
    if gather:
      self.sow(COMM_COLLECTION, "gather_bits", bits_const(gather))
    if reduce:
      self.sow(COMM_COLLECTION, "reduce_bits", bits_const(reduce))
    if self.capture:
      y = self.perturb("outputs", y)
    return y
