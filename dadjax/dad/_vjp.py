"""Distributed auto-differentiation of dense layers: a ``custom_vjp`` and a Flax layer.

For ``y = x W + b`` on rows ``A`` (n x d_in, every leading axis of ``x``
flattened) the backward pass receives the output deltas ``D`` (n x d_out)
and the weight gradient is ``A^T D``. Instead of all-reducing that
d_in x d_out matrix, the backward pass of :func:`dense` synchronizes the
layer itself, by one of four routes chosen by ``mode``:

* ``"exact"`` (dAD): all-gather ``[A, D]`` (n (d_in + d_out) numbers per
  site); every site computes the same exact global gradient.
* ``"rank"`` (rank-dAD): each site factorizes its local ``A^T D`` to rank r
  with the structured power iteration (:func:`~dadjax.dad.factorize`) and
  all-gathers the factors, r (d_in + d_out) numbers, plus its d_out column
  sums of ``D`` for the exact bias (when the layer has one). ``aggregation="two_way"`` reduces the
  gathered factors to one global rank-r result (a second power iteration)
  and broadcasts it from site 0.
* ``"auto"``: per layer call, the cheaper *exact* route by bits on the
  wire for the real number of sites ``N``: the gather when ``N`` times its
  payload is below twice the all-reduce payload of ``A^T D`` (+ bias), else
  a plain all-reduce of ``A^T D`` inside the backward pass
  (:mod:`dadjax.dad._cost`).
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
collection. The backward pass returns the *new* float fields as the
cotangent of the state input; the int32 step counter is only read (its
cotangent is zero). The train step replaces the state with
:func:`~dadjax.dad.next_state` of the old state and that "gradient":
float fields from the cotangent and ``step + 1`` for layers that ran
(:mod:`dadjax.parallel`). A layer applied K times in one forward pass
(``nn.scan`` over time with ``variable_broadcast=["dad_state"]``, weight
sharing) receives the *sum* of K cotangents, so the float fields store
sums together with a ``uses`` count and are read back as ``sum / uses``:
the effective rank comes out right, warm starts are the mean of the K
bases, and the K error-feedback memories, each re-applied by all K uses,
add up to exactly the total residual; the step counter advances by one
per step, exactly, however many steps and uses.

Every collective of the backward pass is metered (:mod:`dadjax.dad._routes`);
the bits a layer reports are read from those payloads (:mod:`dadjax.dad._cost`).
"""

from __future__ import annotations

import functools

import jax

from dadjax.comm import axis_size
from dadjax.dad._config import DadConfig
from dadjax.dad._cost import choose_route
from dadjax.dad._routes import backward, forward


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _dense(x, kernel, bias, state, config):
  del state  # read by the backward pass only
  return forward(x, kernel, bias, config)


def _dense_fwd(x, kernel, bias, state, config):
  return forward(x, kernel, bias, config), (x, kernel, bias, state)


def _dense_bwd(config, res, dy):
  x, kernel, bias, state = res
  n = axis_size(config.axis_name)
  route = choose_route(config, x, kernel, bias, state, num_sites=n)
  dx, gk, gb, new_state, _ = backward(config, route, res, dy, num_sites=n)
  return dx, gk, gb, new_state


_dense.defvjp(_dense_fwd, _dense_bwd)


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
  the layer's new float state (``None`` for the int32 ``step``); turn it
  into the next state with :func:`next_state`, differentiating with
  ``allow_int=True`` (see :func:`init_state`).

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
  if state is None and (config.warm_start or config.error_feedback
                        or config.rank_low is not None):
    raise ValueError("state: warm_start, error_feedback and rank_low need the layer state "
                     "(init_state(config, d_in, d_out))")
  if kernel.ndim != 2 or x.shape[-1] != kernel.shape[0]:
    raise ValueError(f"kernel must be (d_in, d_out) with d_in = x.shape[-1]; got x "
                     f"{x.shape}, kernel {kernel.shape}")
  return _dense(x, kernel, bias, state, config)
