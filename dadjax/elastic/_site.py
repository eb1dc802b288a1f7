"""One site of an elastic DiLoCo run: inner steps under ``jit``, outer steps through the lighthouse.

Each site is its own JAX program (its own devices; one process per site, or
a thread per site in a test). Every ``every`` inner steps it sends its
pseudo-gradient ``Delta = anchor - local`` to the
:class:`~dadjax.elastic.Lighthouse`, gets back the weighted mean over the
sites present at that round, and applies the outer optimizer to the
anchor, exactly as :func:`dadjax.local.diloco` does over a mesh axis.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import pathlib
import socket
import sys
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dadjax.compress import Compressor, Keys, step_keys
from dadjax.elastic._wire import WireError, dtype_of, recv, send
from dadjax.local import (Outer, check_schedule, chunked_topk, default_outer, demo_outer,
                          leaves_of, outer_merge, pseudo_gradient, put_leaves, sync_plan)

_PAYLOAD_DTYPES = ("float32", "bfloat16")


class SiteState(NamedTuple):
  """What a joiner receives from a donor (and what a site checkpoints) at a round boundary.

  Attributes:
    anchor: the global parameters after the last outer step (the site's
      local parameters equal them at the boundary).
    inner_state: the donor's inner optimizer state (a joiner continues with
      the donor's moments; its own were lost with it).
    outer_state: the outer optimizer's state (identical on every live site).
    codec_state: the compressor's state (an error-feedback memory: this
      site's own unsent residual); ``()`` without a compressor. A joiner's is
      reset to the compressor's ``init``, never copied from the donor (the
      donor's residual is the donor's to send). A site's own checkpoint keeps it.
  """
  anchor: Any
  inner_state: Any
  outer_state: Any
  codec_state: Any = ()


@dataclasses.dataclass(frozen=True)
class ElasticDiLoCo:
  """DiLoCo across sites that come and go (arXiv 2311.08105; torchft's fault-tolerant DiLoCo).

  Args:
    loss_fn: ``(params, batch) -> scalar loss`` of one site's batch.
    inner: the local optimizer (no collectives), e.g. ``optax.adamw(1e-3)``.
    every: ``H``, inner steps per outer step (int >= 1).
    outer: the outer optimizer (default :func:`dadjax.local.default_outer`,
      SGD with Nesterov momentum 0.9, lr 0.7).
    payload_dtype: the pseudo-gradient's dtype on the wire without a
      compressor, ``"float32"`` (default) or ``"bfloat16"``; the lighthouse
      takes the mean in float64.
    compressor: ``None``, or a one-round dadjax compressor (or its spec) for
      the pseudo-gradient: ``"qsgd:4"``, ``"ef(topk:0.01)"``, ``"sign"``...
      Each site sends its ``compress`` payload; every site receives the
      quorum's payloads and decodes their weighted mean itself (the
      compressor's ``aggregate``, e.g. sign's vote, where it has one: one
      vote per site), the one-round protocol of
      :func:`dadjax.compress.one_round_exchange`. A compressor with a
      multi-round exchange of its own runs as its one-site codec: PowerSGD
      sends each site's own rank-r factors (no shared basis, so the mean is
      of N rank-r approximations), the two-phase all-reduce its codes.
    seed: the compressor's randomness (the same on every site).
    decay: ``None``, or SparseLoCo's decaying memory ``beta`` in [0, 1] (needs
      a compressor): each round the site sends ``C(e)`` of
      ``e <- decay * e + Delta`` and keeps ``e - C(e)`` (see :func:`sparseloco`).
    fragments: ``P``, Streaming DiLoCo's fragments (default 1: DiLoCo): the
      leaves cut as :func:`dadjax.local.sync_plan` cuts them, fragment ``p``
      sending every ``every`` steps at its own offset, one round per send.
    delay: ``tau``, inner steps between a round's send and its merge (default
      0), less than the gap between two sends (about ``every / fragments``):
      one round is in flight at a time.
    alpha: the local parameters' weight in the merge, in [0, 1] (default 0:
      the site takes the new anchor; Streaming DiLoCo: 0.5).
  """
  loss_fn: Callable[[Any, Any], jax.Array]
  inner: optax.GradientTransformation
  every: int
  outer: optax.GradientTransformation | None = None
  payload_dtype: str = "float32"
  compressor: Compressor | str | None = None
  seed: int = 0
  decay: float | None = None
  fragments: int = 1
  delay: int = 0
  alpha: float = 0.0

  def __post_init__(self):
    if not (isinstance(self.every, int) and self.every >= 1):
      raise ValueError(f"every must be an int >= 1, got {self.every!r}")
    check_schedule(self.every, self.fragments, self.delay, "ElasticDiLoCo")
    # the send steps depend on every and fragments alone: one scalar leaf per fragment
    first = sync_plan([np.zeros(())] * self.fragments, self.every, self.fragments).first
    gap = min(b - a for a, b in zip((0,) + first, first))
    if self.delay >= gap:
      raise ValueError(f"delay must be an int in [0, {gap - 1}] (less than the {gap} steps "
                       f"between two sends of every={self.every} with fragments="
                       f"{self.fragments}: one round in flight at a time), got {self.delay!r}")
    if isinstance(self.alpha, bool) or not (isinstance(self.alpha, (int, float))
                                            and 0 <= self.alpha <= 1):
      raise ValueError(f"alpha must be a number in [0, 1] (the local parameters' weight in the "
                       f"merge), got {self.alpha!r}")
    if self.payload_dtype not in _PAYLOAD_DTYPES:
      raise ValueError(f"payload_dtype must be one of {_PAYLOAD_DTYPES}, "
                       f"got {self.payload_dtype!r}")
    for name in ("inner", "outer"):
      value = getattr(self, name)
      if value is not None and not isinstance(value, optax.GradientTransformation):
        raise ValueError(f"{name} must be an optax.GradientTransformation, got {value!r}")
    object.__setattr__(self, "compressor", _one_round(self.compressor))
    if self.decay is not None:
      if self.compressor is None:
        raise ValueError("decay needs a compressor (the memory keeps what it did not send)")
      if isinstance(self.decay, bool) or not (isinstance(self.decay, (int, float))
                                              and 0 <= self.decay <= 1):
        raise ValueError(f"decay must be None or a number in [0, 1], got {self.decay!r}")


def sparseloco(loss_fn: Callable[[Any, Any], jax.Array], inner: optax.GradientTransformation,
               every: int, *, k: int = 64, chunk: int = 64, values: Any = "terngrad",
               decay: float = 0.95, outer_lr: float = 1.0, seed: int = 0) -> ElasticDiLoCo:
  """SparseLoCo across sites that come and go: :func:`dadjax.local.sparseloco`'s exchange.

  Every ``every`` inner steps each site folds its pseudo-gradient into its memory
  (``e <- decay * e + Delta``), sends the ``k`` largest entries of every
  ``chunk x chunk`` block of ``e`` (values through ``values``, 2-bit ``terngrad`` by
  default; :func:`dadjax.local.chunked_topk`) and keeps the rest; the outer step is plain
  SGD with ``outer_lr`` on the sites' mean. A joiner's memory starts at zero.

  References:
    A. Sarfi, B. Therien, J. Lidin, E. Belilovsky, "Communication Efficient LLM
    Pre-training with SparseLoCo", 2025 (https://arxiv.org/abs/2508.15706).
  """
  values = _one_round(values) if values is not None else None
  return ElasticDiLoCo(loss_fn, inner, every, outer=optax.sgd(outer_lr),
                       compressor=chunked_topk(k, chunk, values=values), seed=seed, decay=decay)


def streaming_diloco(loss_fn: Callable[[Any, Any], jax.Array], inner: optax.GradientTransformation,
                     every: int, fragments: int = 2, delay: int = 1, alpha: float = 0.5,
                     outer: optax.GradientTransformation | None = None,
                     compressor: Compressor | str | None = None, *,
                     payload_dtype: str = "float32", seed: int = 0) -> ElasticDiLoCo:
  """Streaming DiLoCo across sites that come and go: :func:`dadjax.local.streaming_diloco`'s schedule.

  The leaves are cut into ``fragments`` contiguous runs; fragment ``p`` sends its
  pseudo-gradient every ``every`` steps at its own offset (one round of the
  lighthouse per send, so a round carries about ``1 / fragments`` of the
  model), and its mean is merged ``delay`` steps later while the site keeps
  training: the outer optimizer (its state kept per fragment) steps the
  fragment's anchor and the site's fragment becomes ``alpha * local + (1 -
  alpha) * anchor``. ``delay`` must be less than the gap between two sends.
  With every site present it is :func:`dadjax.local.streaming_diloco` over the sites.

  References:
    A. Douillard et al., "Streaming DiLoCo with overlapping communication:
    Towards a Distributed Free Lunch", 2025 (https://arxiv.org/abs/2501.18512).
  """
  return ElasticDiLoCo(loss_fn, inner, every, outer=outer, payload_dtype=payload_dtype,
                       compressor=compressor, seed=seed, fragments=fragments, delay=delay,
                       alpha=alpha)


def demo(loss_fn: Callable[[Any, Any], jax.Array], inner: optax.GradientTransformation,
         every: int = 1, *, lr: float | Callable[[Any], Any] = 4e-4, k: int = 32, chunk: int = 64,
         decay: float = 0.999, weight_decay: float = 0.0, sign: bool = True,
         seed: int = 0) -> ElasticDiLoCo:
  """DeMo across sites that come and go: :func:`dadjax.local.demo`'s exchange, one round per ``every`` steps.

  Each site folds the change its inner optimizer made into its own momentum
  (``m <- decay * m + Delta``), sends the ``k`` largest DCT-II coefficients of
  every ``chunk x chunk`` block of ``m`` and removes them from ``m``; every
  site decodes the quorum's mean and takes ``-lr * sign(mean)`` (with decoupled
  ``weight_decay``; ``lr`` a number or an optax schedule of the round). The momentum is the site's own: a joiner's starts at
  zero. With every site present it is :func:`dadjax.local.demo` over the
  sites. The paper's DeMo is ``inner=optax.sgd(lr)``, ``every=1``: a
  lighthouse round per inner step.

  References:
    B. Peng, J. Quesnelle, D. P. Kingma, "DeMo: Decoupled Momentum
    Optimization", 2024 (https://arxiv.org/abs/2411.19870).
  """
  if not callable(lr) and (isinstance(lr, bool) or not (isinstance(lr, (int, float)) and lr > 0)):
    raise ValueError(f"lr must be a number > 0 or an optax schedule, got {lr!r}")
  if isinstance(weight_decay, bool) or not (isinstance(weight_decay, (int, float))
                                            and weight_decay >= 0):
    raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
  if not isinstance(sign, bool):
    raise ValueError(f"sign must be a bool, got {sign!r}")
  return ElasticDiLoCo(loss_fn, inner, every, outer=demo_outer(lr, float(weight_decay), sign),
                       compressor=chunked_topk(k, chunk, dct=True), seed=seed, decay=decay)


def _one_round(compressor) -> Compressor | None:
  """The compressor of a spec (a ``ValueError`` for anything that is not one)."""
  if isinstance(compressor, str):
    from dadjax.registry import get_compressor  # pylint: disable=g-import-not-at-top
    compressor = get_compressor(compressor)
  if compressor is not None and not isinstance(compressor, Compressor):
    raise ValueError(f"compressor must be None, a dadjax Compressor or its spec, got "
                     f"{compressor!r}")
  return compressor


def round_keys(seed: int, index: int, site: int) -> Keys:
  """A round's compressor keys: ``shared`` equal on every site, ``site`` this site's own."""
  keys = step_keys(seed, jnp.int32(index), None)
  return Keys(keys.shared, jax.random.fold_in(keys.site, site))


class _Dense(NamedTuple):
  """fp32 / bf16 pseudo-gradients: the lighthouse returns their weighted mean."""
  dtype: np.dtype

  gather = False

  def encode(self, delta, codec_state, index, site):
    leaves, treedef = jax.tree.flatten(delta)
    return [np.asarray(d).astype(self.dtype) for d in leaves], treedef, codec_state

  def decode(self, reply, arrays, treedef, like, index, site):
    return jax.tree.unflatten(treedef, [np.asarray(m, np.float32) for m in arrays])


class DecayingMemory(NamedTuple):
  """The codec state with ``decay``: the memory ``e`` and the compressor's own state."""
  memory: Any
  inner: Any


class _Compressed(NamedTuple):
  """A compressor's payloads: gathered by the lighthouse, decoded here."""
  compressor: Compressor
  seed: int
  compress: Callable
  combine: Callable

  @staticmethod
  def init(compressor: Compressor, decay: float | None, params):
    state = compressor.init(params)
    if decay is None:
      return state
    return DecayingMemory(jax.tree.map(jnp.zeros_like, params), state)

  @classmethod
  def of(cls, compressor: Compressor, seed: int, decay: float | None = None) -> "_Compressed":
    if decay is None:
      compress = jax.jit(compressor.compress)
    else:
      @jax.jit
      def compress(delta, state, keys):  # SparseLoCo's: send C(e), keep e - C(e)
        e = jax.tree.map(lambda m, d: decay * m + d, state.memory, delta)
        payload, inner = compressor.compress(e, state.inner, keys)
        sent = compressor.decompress(payload, e, keys)
        return payload, DecayingMemory(jax.tree.map(jnp.subtract, e, sent), inner)

    @jax.jit
    def combine(gathered, weights, like, keys):
      if compressor.aggregate is not None:
        return compressor.aggregate(gathered, like, keys)
      decoded = jax.vmap(lambda p: compressor.decompress(p, like, keys))(gathered)
      w = weights / jnp.sum(weights)
      return jax.tree.map(lambda d: jnp.tensordot(w, d.astype(jnp.float32), axes=1), decoded)

    return cls(compressor, seed, compress, combine)

  gather = True

  def encode(self, delta, codec_state, index, site):
    payload, codec_state = self.compress(delta, codec_state, round_keys(self.seed, index, site))
    leaves, treedef = jax.tree.flatten(payload)
    return [np.asarray(x) for x in leaves], treedef, codec_state

  def decode(self, reply, arrays, treedef, like, index, site):
    """``arrays``: the quorum's payloads in site order, each with this site's structure."""
    n = treedef.num_leaves
    gathered = jax.tree.unflatten(treedef, [np.stack(arrays[i::n]) for i in range(n)])
    return self.combine(gathered, jnp.asarray(reply["weights"], jnp.float32), like,
                        round_keys(self.seed, index, site))


@dataclasses.dataclass
class SiteRun:
  """What :func:`run_site` returns.

  Attributes:
    anchor: the global parameters after the site's last outer step.
    state: the site's whole :class:`SiteState` then (its compressor's memory too).
    rows: one dict per outer step the site took part in: ``round``, ``step``
      (inner steps done), ``quorum`` (the sites averaged), ``dropped``,
      ``loss`` (the site's mean inner loss over the interval),
      ``sent_bits`` / ``received_bits`` (payload bits of that exchange).
    events: the ``dadjax: elastic:`` lines the site printed.
  """
  anchor: Any
  state: SiteState
  rows: list[dict]
  events: list[str]


class LighthouseUnreachable(ConnectionError):
  """The lighthouse did not answer (it is the run's single point of failure)."""


def _request(address: str, header: dict, arrays=(), timeout_s: float = 600.0):
  host, port = address.rsplit(":", 1)
  try:
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
      sent = send(sock, header, arrays)
      reply, out = recv(sock)
  except (OSError, WireError) as e:
    raise LighthouseUnreachable(f"the lighthouse at {address} did not answer a "
                                f"{header['kind']!r} request: {e}") from e
  if "error" in reply:
    raise RuntimeError(f"dadjax: elastic: {reply['error']}")
  return reply, out, sent


def _leaves_as(template_leaves: list, arrays: list[np.ndarray], what: str) -> list:
  if len(arrays) != len(template_leaves):
    raise ValueError(f"{what} has {len(arrays)} arrays, this site's state {len(template_leaves)}")
  out = []
  for i, (t, a) in enumerate(zip(template_leaves, arrays)):
    if tuple(a.shape) != tuple(np.shape(t)):
      raise ValueError(f"{what}: leaf {i} has shape {a.shape}, this site's {np.shape(t)}")
    out.append(jnp.asarray(a, dtype=jnp.result_type(t)))
  return out


class _Checkpoints:
  """A site's own synchronous orbax checkpoints of its :class:`SiteState` per round."""

  def __init__(self, directory, every_rounds: int):
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    self._ocp = ocp
    self.every_rounds = every_rounds
    self.manager = ocp.CheckpointManager(
        pathlib.Path(directory).resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False))

  def latest(self, template: SiteState) -> tuple[int, SiteState] | None:
    step = self.manager.latest_step()
    if step is None:
      return None
    return step, self.manager.restore(step, args=self._ocp.args.StandardRestore(template))

  def save(self, index: int, state: SiteState) -> None:
    if index % self.every_rounds == 0:
      self.manager.save(index, args=self._ocp.args.StandardSave(state))

  def close(self) -> None:
    self.manager.close()


def _check_run(method: ElasticDiLoCo, site, steps, checkpoint_every_rounds) -> None:
  """:func:`run_site`'s argument checks (a ``ValueError`` naming the argument)."""
  if not (isinstance(site, int) and site >= 0):
    raise ValueError(f"site must be an int >= 0, got {site!r}")
  if not (isinstance(steps, int) and steps >= 0 and steps % method.every == 0):
    raise ValueError(f"steps must be an int >= 0 and a multiple of every = {method.every}, "
                     f"got {steps!r}")
  if not (isinstance(checkpoint_every_rounds, int) and checkpoint_every_rounds >= 1):
    raise ValueError(f"checkpoint_every_rounds must be an int >= 1, "
                     f"got {checkpoint_every_rounds!r}")


class _Rounds(NamedTuple):
  """When each round sends and merges: one round per fragment send, in step order.

  Round ``r`` is fragment ``r % P``'s send on (1-based) inner step
  :meth:`send_step`; its mean is merged ``delay`` steps later, before the next
  round sends (:class:`ElasticDiLoCo` checks ``delay`` against the gap). With
  one fragment, round ``r`` is DiLoCo's outer step after ``(r + 1) * every`` steps.
  """
  every: int
  delay: int
  first: tuple[int, ...]  # per fragment, the step of its first send (sync_plan's)
  leaves: tuple[int, ...]  # the fragment of each parameter leaf

  @classmethod
  def of(cls, method: ElasticDiLoCo, params) -> "_Rounds":
    plan = sync_plan(params, method.every, method.fragments, method.delay, "run_site")
    return cls(plan.every, plan.delay, plan.first, plan.leaves)

  @property
  def fragments(self) -> int:
    return len(self.first)

  def fragment(self, index: int) -> int:
    return index % self.fragments

  def send_step(self, index: int) -> int:
    return index // self.fragments * self.every + self.first[index % self.fragments]

  def start_step(self, index: int) -> int:
    """The inner steps done when round ``index - 1``'s mean has been merged."""
    return 0 if index == 0 else self.send_step(index - 1) + self.delay

  def part(self, tree, p: int):
    return leaves_of(tree, self.leaves, p)

  def whole(self, values: list):
    """Per-fragment states as :class:`SiteState` keeps them: the one state, or a tuple."""
    return values[0] if self.fragments == 1 else tuple(values)

  def each(self, value) -> list:
    return [value] if self.fragments == 1 else list(value)


def _steps(method: ElasticDiLoCo, outer: optax.GradientTransformation, rounds: _Rounds):
  """The site's jitted steps: an inner optimizer step, a fragment's pseudo-gradient, its merge."""
  inner, config = method.inner, Outer(outer, float(method.alpha))

  @jax.jit
  def inner_step(local, inner_state, batch):
    loss, grads = jax.value_and_grad(method.loss_fn)(local, batch)
    updates, inner_state = inner.update(grads, inner_state, local)
    return optax.apply_updates(local, updates), inner_state, loss

  @functools.partial(jax.jit, static_argnums=0)
  def delta_of(p, anchor, local):
    return pseudo_gradient(rounds.part(anchor, p), rounds.part(local, p))

  @functools.partial(jax.jit, static_argnums=0)
  def merge(p, local, anchor, mean, outer_state):
    """The outer step on fragment ``p``'s anchor; the site's fragment becomes
    ``alpha * local + (1 - alpha) * anchor`` (:func:`dadjax.local.outer_merge`)."""
    anchor_p = rounds.part(anchor, p)
    mean = jax.tree.map(lambda m, a: m.astype(a.dtype), mean, anchor_p)
    local_p, anchor_p, outer_state = outer_merge(config, rounds.part(local, p), anchor_p, mean,
                                                 outer_state)
    return (put_leaves(local, local_p, rounds.leaves, p),
            put_leaves(anchor, anchor_p, rounds.leaves, p), outer_state)

  return inner_step, delta_of, merge


class _Sent(NamedTuple):
  """A round on the wire: its reply arrives ``delay`` steps after the send."""
  index: int
  fragment: int
  reply: Any  # a concurrent.futures.Future of ``_request``'s (reply, arrays, bytes sent)
  payload_def: Any
  codec_state: Any
  step: int


class _Site:
  """One site's protocol state between inner steps: joins, rounds, merges, drops and relays."""

  def __init__(self, method: ElasticDiLoCo, params, *, lighthouse: str, site: int,
               timeout_s: float, store, say):
    self.method, self.lighthouse, self.site, self.timeout_s = method, lighthouse, site, timeout_s
    self.store, self.say = store, say
    self.rounds = rounds = _Rounds.of(method, params)
    outer = method.outer or default_outer()
    self.inner_step, self.delta_of, self.merge_step = _steps(method, outer, rounds)
    self.codec = (_Dense(dtype_of(method.payload_dtype)) if method.compressor is None
                  else _Compressed.of(method.compressor, method.seed, method.decay))
    parts = [rounds.part(params, p) for p in range(rounds.fragments)]
    codecs = [() if method.compressor is None
              else _Compressed.init(method.compressor, method.decay, part) for part in parts]
    self.fresh = SiteState(params, method.inner.init(params),
                           rounds.whole([outer.init(part) for part in parts]),
                           rounds.whole(codecs))
    # a joiner receives all but the compressor's state, which it starts afresh
    self.template = jax.tree.leaves(self.fresh[:3])
    self.treedef = jax.tree.structure(tuple(self.fresh[:3]))
    self.rows: list[dict] = []
    self.pending: _Sent | None = None
    self._requests = concurrent.futures.ThreadPoolExecutor(1, "dadjax-elastic-sync")

  def start(self) -> None:
    if self.store is not None and (saved := self.store.latest(self.fresh)) is not None:
      own_round, own = saved
      origin = f"from its checkpoint of round {own_round}"
    else:
      own_round, own, origin = 0, self.fresh, "from the initial parameters"
    self._join(own, own_round, origin)

  def _join(self, own: SiteState, own_round: int, why: str) -> None:
    """Takes a live site's state (or its own) and starts at that round's step."""
    site = self.site
    reply, arrays, _ = _request(self.lighthouse, {"kind": "join", "site": site,
                                                  "alone_round": own_round},
                                timeout_s=self.timeout_s)
    state, index = own, own_round
    if reply["start"] == "peer":
      received = jax.tree.unflatten(self.treedef,
                                    _leaves_as(self.template, arrays, "the donor's state"))
      state, index = SiteState(*received, self.fresh.codec_state), reply["round"]
      self.say(f"site {site} joined at round {index} with site {reply['donor']}'s state")
    elif reply["start"] == "alone":
      self.say(f"site {site} starts alone at round {own_round} (no live site; {why})")
    elif own_round:
      self.say(f"site {site} resumes at round {own_round} ({why}), as the run re-forms")
    self.state, self.index, self.local = state, index, state.anchor
    self.step = self.rounds.start_step(index)
    self.rows_since = [0] * self.rounds.fragments  # rows trained since each fragment's send
    self.losses: list[jax.Array] = []

  def train(self, batch) -> jax.Array:
    self.local, inner_state, loss = self.inner_step(self.local, self.state.inner_state, batch)
    self.state = self.state._replace(inner_state=inner_state)
    self.losses.append(loss)
    self.step += 1
    # the rows: the leading size of the first leaf that has one (a scalar entry is not data)
    rows = next(np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x))
    self.rows_since = [r + rows for r in self.rows_since]
    return loss

  def sends_now(self) -> bool:
    return self.pending is None and self.step == self.rounds.send_step(self.index)

  def merges_now(self, last_step: int) -> bool:
    return self.pending is not None and (self.step >= self.pending.step + self.rounds.delay
                                         or self.step >= last_step)

  def send(self) -> dict | None:
    """This round's fragment to the lighthouse; its mean is merged ``delay`` steps later (with
    no delay: now, returning :meth:`merge`'s row)."""
    p, index = self.rounds.fragment(self.index), self.index
    payload, payload_def, codec_state = self.codec.encode(
        self.delta_of(p, self.state.anchor, self.local),
        self.rounds.each(self.state.codec_state)[p], index, self.site)
    header = {"kind": "sync", "site": self.site, "round": index,
              "weight": float(self.rows_since[p]), "gather": self.codec.gather}
    self.rows_since[p] = 0
    # the module's _request, looked up when the request runs
    reply = self._requests.submit(lambda: _request(self.lighthouse, header, payload,
                                                   timeout_s=self.timeout_s))
    self.pending = _Sent(index, p, reply, payload_def, codec_state, self.step)
    return None if self.rounds.delay else self.merge()

  def merge(self) -> dict | None:
    """The round's mean into the anchor and the site; a dropped site joins again."""
    sent, self.pending = self.pending, None
    reply, received, sent_bytes = sent.reply.result()
    index, p = sent.index, sent.fragment
    if reply["status"] == "dropped":  # (its memory as before the round: nothing was sent)
      lost = self.step - self.rounds.start_step(index)
      self.say(f"site {self.site} was dropped from round {index} (its contribution came after "
               f"the quorum closed); it loses {lost} steps and joins again")
      self._join(self.state, index, "after being dropped")
      return None
    if reply["dropped"]:
      self.say(f"round {index}: sites {reply['dropped']} dropped (no contribution in time); "
               f"the outer mean is over sites {reply['quorum']}")
    state = self.state
    mean = self.codec.decode(reply, received, sent.payload_def,
                             self.rounds.part(state.anchor, p), index, self.site)
    outers, codecs = self.rounds.each(state.outer_state), self.rounds.each(state.codec_state)
    self.local, anchor, outers[p] = self.merge_step(p, self.local, state.anchor, mean, outers[p])
    codecs[p] = sent.codec_state
    self.state = SiteState(anchor, state.inner_state, self.rounds.whole(outers),
                           self.rounds.whole(codecs))
    self.index = index + 1
    row = {"round": index, "step": sent.step, "quorum": reply["quorum"],
           "dropped": reply["dropped"], "loss": float(np.mean([float(l) for l in self.losses])),
           "sent_bits": 8 * sent_bytes, "received_bits": 8 * sum(m.nbytes for m in received)}
    self.losses.clear()
    self.rows.append(row)
    if reply["donor"]:
      _request(self.lighthouse, {"kind": "state", "site": self.site, "round": self.index,
                                 "step": self.step},
               [np.asarray(x) for x in jax.tree.leaves(tuple(self.state[:3]))],
               timeout_s=self.timeout_s)
    if self.store is not None:
      self.store.save(self.index, self.state)
    return row

  def close(self) -> None:
    self._requests.shutdown(wait=False, cancel_futures=True)
    if self.store is not None:
      self.store.close()


def run_site(method: ElasticDiLoCo, params: Any, batch_at: Callable[[int, int], Any], *,
             lighthouse: str, site: int, steps: int, checkpoint_dir=None,
             checkpoint_every_rounds: int = 1, timeout_s: float = 600.0,
             log: Callable[[str], None] | None = None,
             on_round: Callable[[dict, SiteState], None] | None = None,
             on_step: Callable[[int, float], None] | None = None) -> SiteRun:
  """Trains one site of an elastic run until ``steps`` inner steps are done.

  The site joins through the lighthouse: at the run's start (every site from
  ``params``), from a live site's state (a restart or a new site: it joins at
  the next round), or, with no live site, from its own latest checkpoint
  (else ``params`` at round 0). At each round it sends its pseudo-gradient
  (of the round's fragment, with ``method.fragments > 1``) and a weight (the
  rows of its batches since that fragment's last send) and merges the mean,
  ``method.delay`` steps later. A site the lighthouse dropped (its
  contribution came after ``quorum_timeout_s``) loses its steps since its
  last merge and joins again.

  Args:
    method: the :class:`ElasticDiLoCo` (loss, inner and outer optimizers, H).
    params: the initial parameters (the same on every site: the same seed).
    batch_at: ``(site, step) -> batch`` of that site's data at an inner step (a pytree; its
      first leaf with a leading axis counts the rows, scalar entries such as a step are not rows).
    lighthouse: ``"host:port"`` of the :class:`~dadjax.elastic.Lighthouse`.
    site: this site's id (int >= 0); a restart uses the same id.
    steps: inner steps of the run (a multiple of ``method.every``).
    checkpoint_dir: where this site keeps its own round checkpoints (orbax,
      synchronous); ``None``: none.
    checkpoint_every_rounds: rounds between checkpoints (int >= 1).
    timeout_s: how long a request to the lighthouse may take, seconds.
    log: called with each ``dadjax: elastic:`` line (default: stderr).
    on_round: called with each row of :attr:`SiteRun.rows` as it is made and the site's
      :class:`SiteState` after that round's merge (its ``anchor``: the new global parameters).
    on_step: called with ``(step, loss)`` after each inner step (it waits for
      the step's loss: a progress read-out, at the cost of JAX's run-ahead).

  Returns:
    A :class:`SiteRun`.

  Raises:
    ValueError: a bad argument, or a donor's state of another shape.
    LighthouseUnreachable: the lighthouse did not answer.
  """
  _check_run(method, site, steps, checkpoint_every_rounds)
  events: list[str] = []

  def say(line: str) -> None:
    line = f"dadjax: elastic: {line}"
    events.append(line)
    (log or (lambda s: print(s, file=sys.stderr, flush=True)))(line)

  store = None if checkpoint_dir is None else _Checkpoints(checkpoint_dir, checkpoint_every_rounds)
  me = _Site(method, params, lighthouse=lighthouse, site=site, timeout_s=timeout_s, store=store,
             say=say)
  try:
    me.start()
    while me.step < steps or me.pending is not None:
      if me.step < steps:
        step = me.step
        loss = me.train(batch_at(site, step))
        if on_step is not None:
          on_step(step, float(loss))
      merged = me.merge() if me.merges_now(steps) else None
      if me.step <= steps and me.sends_now():
        merged = me.send() or merged
      if merged is not None and on_round is not None:
        on_round(merged, me.state)
  finally:
    me.close()
  _request(lighthouse, {"kind": "leave", "site": site}, timeout_s=timeout_s)
  return SiteRun(me.state.anchor, me.state, me.rows, events)
