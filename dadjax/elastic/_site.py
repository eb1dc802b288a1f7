"""One site of an elastic DiLoCo run: inner steps under ``jit``, outer steps through the lighthouse.

Each site is its own JAX program (its own devices; one process per site, or
a thread per site in a test). Every ``every`` inner steps it sends its
pseudo-gradient ``Delta = anchor - local`` to the
:class:`~dadjax.elastic.Lighthouse`, gets back the weighted mean over the
sites present at that round, and applies the outer optimizer to the
anchor, exactly as :func:`dadjax.local.diloco` does over a mesh axis.
"""

from __future__ import annotations

import dataclasses
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
from dadjax.local import default_outer

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
  """
  loss_fn: Callable[[Any, Any], jax.Array]
  inner: optax.GradientTransformation
  every: int
  outer: optax.GradientTransformation | None = None
  payload_dtype: str = "float32"
  compressor: Compressor | str | None = None
  seed: int = 0
  decay: float | None = None

  def __post_init__(self):
    if not (isinstance(self.every, int) and self.every >= 1):
      raise ValueError(f"every must be an int >= 1, got {self.every!r}")
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
  from dadjax.local import chunked_topk  # pylint: disable=g-import-not-at-top
  values = _one_round(values) if values is not None else None
  return ElasticDiLoCo(loss_fn, inner, every, outer=optax.sgd(outer_lr),
                       compressor=chunked_topk(k, chunk, values=values), seed=seed, decay=decay)


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


def _steps(loss_fn, inner: optax.GradientTransformation, outer: optax.GradientTransformation):
  """The site's two jitted steps: an inner optimizer step, and the outer step on the mean."""

  @jax.jit
  def inner_step(local, inner_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(local, batch)
    updates, inner_state = inner.update(grads, inner_state, local)
    return optax.apply_updates(local, updates), inner_state, loss

  @jax.jit
  def outer_step(anchor, outer_state, mean_delta):
    mean_delta = jax.tree.map(lambda m, a: m.astype(a.dtype), mean_delta, anchor)
    updates, outer_state = outer.update(mean_delta, outer_state, anchor)
    return optax.apply_updates(anchor, updates), outer_state

  return inner_step, outer_step


def run_site(method: ElasticDiLoCo, params: Any, batch_at: Callable[[int, int], Any], *,
             lighthouse: str, site: int, steps: int, checkpoint_dir=None,
             checkpoint_every_rounds: int = 1, timeout_s: float = 600.0,
             log: Callable[[str], None] | None = None,
             on_round: Callable[[dict], None] | None = None,
             on_step: Callable[[int, float], None] | None = None) -> SiteRun:
  """Trains one site of an elastic DiLoCo run until ``steps`` inner steps are done.

  Long because the round loop (join, a drop and its rejoin, the donor's relay, the
  checkpoint) reads as one protocol; its steps and checks are helpers.

  The site joins through the lighthouse: at the run's start (every site from
  ``params``), from a live site's state (a restart or a new site: it joins at
  the next round), or, with no live site, from its own latest checkpoint
  (else ``params`` at round 0). At each round it sends ``Delta`` and a weight
  (the rows of its batches since the last round) and applies the mean. A site
  the lighthouse dropped (its contribution came after ``quorum_timeout_s``)
  loses that interval's steps and joins again.

  Args:
    method: the :class:`ElasticDiLoCo` (loss, inner and outer optimizers, H).
    params: the initial parameters (the same on every site: the same seed).
    batch_at: ``(site, step) -> batch`` of that site's data at an inner step.
    lighthouse: ``"host:port"`` of the :class:`~dadjax.elastic.Lighthouse`.
    site: this site's id (int >= 0); a restart uses the same id.
    steps: inner steps of the run (a multiple of ``method.every``).
    checkpoint_dir: where this site keeps its own round checkpoints (orbax,
      synchronous); ``None``: none.
    checkpoint_every_rounds: rounds between checkpoints (int >= 1).
    timeout_s: how long a request to the lighthouse may take, seconds.
    log: called with each ``dadjax: elastic:`` line (default: stderr).
    on_round: called with each row of :attr:`SiteRun.rows` as it is made.
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

  inner, outer, every = method.inner, method.outer or default_outer(), method.every
  inner_step, outer_step = _steps(method.loss_fn, inner, outer)
  delta_of = jax.jit(lambda anchor, local: jax.tree.map(jnp.subtract, anchor, local))
  codec = (_Dense(dtype_of(method.payload_dtype)) if method.compressor is None
           else _Compressed.of(method.compressor, method.seed, method.decay))
  fresh = SiteState(params, inner.init(params), outer.init(params),
                    () if method.compressor is None
                    else _Compressed.init(method.compressor, method.decay, params))
  # a joiner receives all but the compressor's state, which it starts afresh
  template, treedef = jax.tree.leaves(fresh[:3]), jax.tree.structure(tuple(fresh[:3]))
  store = None if checkpoint_dir is None else _Checkpoints(checkpoint_dir, checkpoint_every_rounds)

  def join(own: SiteState, own_round: int, why: str) -> tuple[SiteState, int]:
    reply, arrays, _ = _request(lighthouse, {"kind": "join", "site": site,
                                             "alone_round": own_round}, timeout_s=timeout_s)
    if reply["start"] == "peer":
      received = jax.tree.unflatten(treedef, _leaves_as(template, arrays, "the donor's state"))
      state = SiteState(*received, fresh.codec_state)
      say(f"site {site} joined at round {reply['round']} with site {reply['donor']}'s state")
      return state, reply["round"]
    if reply["start"] == "alone":
      say(f"site {site} starts alone at round {own_round} (no live site; {why})")
    elif own_round:
      say(f"site {site} resumes at round {own_round} ({why}), as the run re-forms")
    return own, own_round

  if store is not None and (saved := store.latest(fresh)) is not None:
    own_round, own = saved
    origin = f"from its checkpoint of round {own_round}"
  else:
    own_round, own, origin = 0, fresh, "from the initial parameters"
  state, index = join(own, own_round, origin)
  local = state.anchor
  rows: list[dict] = []
  losses: list[jax.Array] = []
  step = index * every
  try:
    while step < steps:
      batch = batch_at(site, step)
      local, inner_state, loss = inner_step(local, state.inner_state, batch)
      state = state._replace(inner_state=inner_state)
      losses.append(loss)
      if on_step is not None:
        on_step(step, float(loss))
      step += 1
      if step % every:
        continue
      weight = float(every * np.shape(jax.tree.leaves(batch)[0])[0])
      payload, payload_def, codec_state = codec.encode(delta_of(state.anchor, local),
                                                       state.codec_state, index, site)
      reply, received, sent = _request(
          lighthouse, {"kind": "sync", "site": site, "round": index, "weight": weight,
                       "gather": codec.gather}, payload, timeout_s=timeout_s)
      if reply["status"] == "dropped":  # (its memory as before the round: nothing was sent)
        say(f"site {site} was dropped from round {index} (its contribution came after the "
            f"quorum closed); it loses {every} steps and joins again")
        losses.clear()
        state, index = join(state, index, "after being dropped")
        local, step = state.anchor, index * every
        continue
      if reply["dropped"]:
        say(f"round {index}: sites {reply['dropped']} dropped (no contribution in time); the "
            f"outer mean is over sites {reply['quorum']}")
      mean = codec.decode(reply, received, payload_def, state.anchor, index, site)
      anchor, outer_state = outer_step(state.anchor, state.outer_state, mean)
      state = SiteState(anchor, state.inner_state, outer_state, codec_state)
      local, index = anchor, index + 1
      row = {"round": index - 1, "step": step, "quorum": reply["quorum"],
             "dropped": reply["dropped"], "loss": float(np.mean([float(l) for l in losses])),
             "sent_bits": 8 * sent, "received_bits": 8 * sum(m.nbytes for m in received)}
      losses.clear()
      rows.append(row)
      if on_round is not None:
        on_round(row)
      if reply["donor"]:
        _request(lighthouse, {"kind": "state", "site": site, "round": index, "step": step},
                 [np.asarray(x) for x in jax.tree.leaves(tuple(state[:3]))],
                 timeout_s=timeout_s)
      if store is not None:
        store.save(index, state)
  finally:
    if store is not None:
      store.close()
  _request(lighthouse, {"kind": "leave", "site": site}, timeout_s=timeout_s)
  return SiteRun(state.anchor, state, rows, events)
