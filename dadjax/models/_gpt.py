"""A GPT-style decoder for pods: scanned, rematerialized, logically partitioned blocks.

:class:`GPT` is a pre-LayerNorm decoder whose ``num_layers`` blocks run
under ``nn.scan`` (one compiled block, parameters stacked on a leading axis
named ``"layers"``), each block under ``nn.remat`` with a named
``jax.checkpoint_policies`` policy, compute in ``dtype`` (bf16 on
accelerators) with fp32 parameters, rotary or learned positions, tied or
untied embeddings. Every parameter carries logical axis names
(``nn.with_logical_partitioning``: ``embed``, ``mlp``, ``heads``, ``kv``,
``vocab``, ``layers``) and every large activation a logical constraint
(``batch``, ``length`` and the same names), so a mesh and a rule set
(:func:`gpt_rules`: FSDP, Megatron TP, both) lay the model out inside a
site. The site axis (``"data"``) is manual in dadjax's placement and never
appears in the rules.

Every dense projection (query, key, value, attention output, MLP in and
out, an untied head) takes ``dot_general_cls``, so
:class:`dadjax.dad.DotGeneral` (or a dAD method's factory, passed as
``dense`` by ``dadjax train``) synchronizes its kernel by dAD.

:func:`gpt_memory` is the dry run: parameter shapes by ``jax.eval_shape``
(nothing allocated), shardings on a ``jax.sharding.AbstractMesh`` from the
rules, and the per-device bytes of parameters, gradients, optimizer state
and an activation estimate.

References:
  Radford et al., "Language Models are Unsupervised Multitask Learners"
  (GPT-2), 2019; Su et al., "RoFormer: Enhanced Transformer with Rotary
  Position Embedding" (https://arxiv.org/abs/2104.09864); Shoeybi et al.,
  "Megatron-LM" (https://arxiv.org/abs/1909.08053); Rajbhandari et al.,
  "ZeRO" (https://arxiv.org/abs/1910.02054); Chen et al., "Training Deep
  Nets with Sublinear Memory Cost" (https://arxiv.org/abs/1604.06174);
  Biderman et al., "Pythia" (https://arxiv.org/abs/2304.01373) for the 1B
  shape.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

SITE_AXIS = "data"
FSDP_AXIS = "fsdp"
MODEL_AXIS = "model"
DTYPES = ("float32", "bfloat16", "float16")
POSITIONS = ("rotary", "learned")
RULE_SETS = ("fsdp", "tp", "fsdp_tp", "replicated")

# Logical axis rules (flax.linen.logical_axis_rules pairs). A mesh axis is
# used at most once per array: flax skips a rule whose mesh axis an earlier
# dimension took, so an activation ("batch", "length", "embed") splits its
# batch over "fsdp" and keeps "embed" whole, while a kernel ("embed", "mlp")
# splits "embed" over "fsdp" (ZeRO-3 / FSDP: weights gathered per layer).
_FSDP = (("batch", FSDP_AXIS), ("embed", FSDP_AXIS))
# Megatron: column-parallel q/k/v and mlp_in (their "heads" / "mlp" output
# axis), row-parallel out and mlp_out (the same axis as input), the
# vocabulary split for the embedding and head.
_TP = (("mlp", MODEL_AXIS), ("heads", MODEL_AXIS), ("vocab", MODEL_AXIS))
_WHOLE = (("batch", None), ("length", None), ("embed", None), ("mlp", None), ("heads", None),
          ("kv", None), ("vocab", None), ("layers", None))


def gpt_rules(kind: str = "fsdp") -> tuple[tuple[str, Optional[str]], ...]:
  """Logical axis rules for :class:`GPT` over mesh axes ``"fsdp"`` and ``"model"``.

  Use with ``flax.linen.logical_axis_rules(rules)``, ``make_train_step(...,
  rules=rules)`` or :func:`gpt_memory`. The site axis ``"data"`` never
  appears: it is manual (each site holds a replica), and only the in-site
  axes are GSPMD's.

  Args:
    kind: ``"fsdp"`` (weights' ``embed`` and activations' ``batch`` over
      ``"fsdp"``), ``"tp"`` (Megatron column/row: ``mlp``, ``heads`` and
      ``vocab`` over ``"model"``), ``"fsdp_tp"`` (both), ``"replicated"``
      (every name whole).

  Returns:
    A tuple of ``(logical name, mesh axis or None)`` pairs naming every
    logical axis of the model (``batch``, ``length``, ``embed``, ``mlp``,
    ``heads``, ``kv``, ``vocab``, ``layers``).

  Raises:
    ValueError: an unknown ``kind``.
  """
  if kind not in RULE_SETS:
    raise ValueError(f"gpt_rules: kind must be one of {list(RULE_SETS)}, got {kind!r}")
  split = {"fsdp": _FSDP, "tp": _TP, "fsdp_tp": _FSDP + _TP, "replicated": ()}[kind]
  return split + tuple(r for r in _WHOLE if r[0] not in {name for name, _ in split})


GPT_FSDP_RULES = gpt_rules("fsdp")
GPT_TP_RULES = gpt_rules("tp")
GPT_FSDP_TP_RULES = gpt_rules("fsdp_tp")

# Named sizes. gpt_tiny: tests. gpt_cpu: the largest that trains 300 steps of
# 8 sites in 15 minutes on 2 CPU cores (README "A GPT decoder": the measured
# step). gpt_125m: GPT-2 small (learned positions, tied embeddings, GPT-2's
# vocabulary padded to a multiple of 128). gpt_1b: Pythia-1B's shape (rotary,
# untied). The byte corpus sets vocab_size=256 through `dadjax train`.
GPT_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt_tiny": dict(num_layers=2, d_model=64, num_heads=4, mlp_dim=256, vocab_size=256,
                     max_len=64, positions="rotary", tie_embeddings=True, dtype="float32"),
    "gpt_cpu": dict(num_layers=8, d_model=256, num_heads=4, mlp_dim=1024, vocab_size=256,
                    max_len=128, positions="rotary", tie_embeddings=True, dtype="float32"),
    "gpt_125m": dict(num_layers=12, d_model=768, num_heads=12, mlp_dim=3072, vocab_size=50304,
                     max_len=1024, positions="learned", tie_embeddings=True, dtype="bfloat16"),
    "gpt_1b": dict(num_layers=16, d_model=2048, num_heads=8, mlp_dim=8192, vocab_size=50304,
                   max_len=2048, positions="rotary", tie_embeddings=False, dtype="bfloat16"),
}


def gpt_config(name: str) -> dict[str, Any]:
  """The fields of a named GPT size (``"gpt_tiny"``, ``"gpt_cpu"``, ``"gpt_125m"``, ``"gpt_1b"``).

  Raises:
    ValueError: an unknown name.
  """
  if name not in GPT_CONFIGS:
    raise ValueError(f"gpt_config: name must be one of {sorted(GPT_CONFIGS)}, got {name!r}")
  return dict(GPT_CONFIGS[name])


def _policy(name: str):
  if name == "none":
    return None
  policy = getattr(jax.checkpoint_policies, name, None)
  if policy is None or not callable(policy) or name.startswith("_"):
    raise ValueError(f"remat must be 'none' or a jax.checkpoint_policies name "
                     f"(e.g. 'nothing_saveable', 'dots_with_no_batch_dims_saveable', "
                     f"'everything_saveable'), got {name!r}")
  if name.startswith(("save_", "offload", "save_and_offload")):
    raise ValueError(f"remat={name!r} is a policy factory (it takes arguments); give a policy "
                     "such as 'nothing_saveable' or 'dots_with_no_batch_dims_saveable'")
  return policy


def _param(init, names):
  return nn.with_logical_partitioning(init, names)


def _rotary(x: jax.Array, positions: jax.Array) -> jax.Array:
  """Rotate (batch, length, heads, kv) pairs ``(x_i, x_{i + kv/2})`` by position-dependent
  angles (GPT-NeoX's half split), computed in fp32."""
  half = x.shape[-1] // 2
  freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
  angle = positions.astype(jnp.float32)[:, None] * freq[None, :]  # (length, half)
  sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Projection(nn.Module):
  """A dense projection with a logically partitioned kernel of any rank.

  ``y = dot_general(x, kernel)`` over ``x``'s last ``contract`` axes; the
  kernel has shape ``x.shape[-contract:] + features`` and the logical names
  ``names`` (in that order), fp32, cast to ``dtype`` for the contraction.
  Written out rather than ``nn.DenseGeneral`` because DenseGeneral draws a
  multi-axis kernel flat and unboxes it (a sharding constraint of the full
  rank on the flat array) inside every ``param`` call, which fails under an
  active mesh with logical rules.

  Attributes:
    features: the output axes' sizes.
    names: the kernel's logical axis names (``contract + len(features)`` of them).
    contract: how many trailing input axes are contracted.
    dtype: compute dtype.
    use_bias: add a bias of shape ``features`` (outside the contraction).
    dot_general_cls: the contraction's class (``None``: ``lax.dot_general``).
  """

  features: tuple
  names: tuple
  contract: int = 1
  dtype: str = "float32"
  use_bias: bool = False
  dot_general_cls: Any = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c, dtype = self.contract, jnp.dtype(self.dtype)
    shape = tuple(x.shape[-c:]) + tuple(self.features)
    kernel = self.param("kernel", _param(nn.initializers.normal(0.02), self.names), shape,
                        jnp.float32)
    dims = ((tuple(range(x.ndim - c, x.ndim)), tuple(range(c))), ((), ()))
    dot = self.dot_general_cls() if self.dot_general_cls is not None else jax.lax.dot_general
    y = dot(x.astype(dtype), kernel.astype(dtype), dims)
    if self.use_bias:
      bias = self.param("bias", _param(nn.initializers.zeros, self.names[c:]),
                        tuple(self.features), jnp.float32)
      y = y + bias.astype(dtype)
    return y


class GPTBlock(nn.Module):
  """One pre-LN decoder block: ``x + Attn(LN(x))`` then ``x + MLP(LN(x))``.

  ``__call__(x, _)`` returns ``(x, None)`` (the form ``nn.scan`` carries).
  Projections (:class:`Projection`): ``query``, ``key``, ``value`` (to ``(heads,
  kv)``, kernels ``("embed", "heads", "kv")``), ``out`` (``("heads", "kv",
  "embed")``), ``mlp_in`` (``("embed", "mlp")``), ``mlp_out`` (``("mlp",
  "embed")``), each with ``dot_general_cls``. Causal softmax attention in
  fp32.

  Attributes: see :class:`GPT`.
  """

  d_model: int
  num_heads: int
  mlp_dim: int
  positions: str = "rotary"
  dtype: str = "float32"
  use_bias: bool = False
  dot_general_cls: Any = None

  @nn.compact
  def __call__(self, x: jax.Array, _: Any = None):
    dtype = jnp.dtype(self.dtype)
    b, t, d = x.shape
    h, kv = self.num_heads, self.d_model // self.num_heads
    proj = functools.partial(Projection, dtype=self.dtype, use_bias=self.use_bias,
                             dot_general_cls=self.dot_general_cls)
    norm = dict(dtype=dtype, param_dtype=jnp.float32,
                scale_init=_param(nn.initializers.ones, ("embed",)),
                bias_init=_param(nn.initializers.zeros, ("embed",)))

    y = nn.LayerNorm(name="ln_attn", **norm)(x)
    act = ("batch", "length", "heads", "kv")
    qkv = lambda name: nn.with_logical_constraint(
        proj((h, kv), ("embed", "heads", "kv"), name=name)(y), act)
    q, k, v = qkv("query"), qkv("key"), qkv("value")
    if self.positions == "rotary":
      pos = jnp.arange(t)
      q, k = _rotary(q, pos), _rotary(k, pos)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * kv**-0.5
    keep = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
    attn = jax.nn.softmax(logits, axis=-1).astype(dtype)
    y = nn.with_logical_constraint(jnp.einsum("bhqk,bkhd->bqhd", attn, v), act)
    y = proj((d,), ("heads", "kv", "embed"), contract=2, name="out")(y)
    x = nn.with_logical_constraint(x + y, ("batch", "length", "embed"))

    y = nn.LayerNorm(name="ln_mlp", **norm)(x)
    y = proj((self.mlp_dim,), ("embed", "mlp"), name="mlp_in")(y)
    y = nn.with_logical_constraint(nn.gelu(y), ("batch", "length", "mlp"))
    y = proj((d,), ("mlp", "embed"), name="mlp_out")(y)
    x = nn.with_logical_constraint(x + y, ("batch", "length", "embed"))
    return x, None


class GPT(nn.Module):
  """GPT-style decoder-only language model (pre-LN, scanned and rematerialized blocks).

  ``embed`` (``(vocab, embed)``) [+ learned ``pos_embed`` ``(max_len,
  embed)``] -> ``num_layers`` :class:`GPTBlock` s (under ``nn.scan`` as one
  module ``"layers"`` whose parameters stack on a leading ``"layers"`` axis,
  or unrolled as ``block_0 ...`` with ``scan_layers=False``) ->
  ``ln_final`` -> logits by the embedding's transpose (tied) or a ``head``
  projection ``("embed", "vocab")``.

  Input: int tokens ``(batch, T)`` in ``[0, vocab_size)``, ``T <= max_len``.

  Output: fp32 logits ``(batch, T, vocab_size)``; position ``t`` sees tokens
  ``0..t`` only. With the train step's default loss
  (:func:`dadjax.parallel.classification_loss`) the loss is the mean
  next-token cross entropy.

  Attributes:
    num_layers, d_model, num_heads, mlp_dim: sizes (``d_model`` divisible by
      ``num_heads``, head size even for rotary positions).
    vocab_size: the token vocabulary (256: bytes).
    max_len: longest sequence.
    positions: ``"rotary"`` (RoPE on queries and keys) or ``"learned"``.
    tie_embeddings: logits by the input embedding's transpose (no head).
    dtype: compute dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"``;
      parameters are always fp32 (master weights); logits come back fp32.
    remat: a ``jax.checkpoint_policies`` name for each block's
      rematerialization (default ``"nothing_saveable"``: only the block
      inputs are kept for the backward pass), or ``"none"``.
    scan_layers: stack the blocks under ``nn.scan`` (default) or unroll them.
    use_bias: biases on the projections (default ``False``; LayerNorm keeps its).
    dot_general_cls: the contraction of every dense projection (``None``:
      ``lax.dot_general``; :class:`dadjax.dad.DotGeneral` for dAD).
    dense: a dAD method's layer factory (``dadjax train`` passes it); its
      ``dot_general_cls`` is used when ``dot_general_cls`` is ``None``.

  References: module docstring.
  """

  num_layers: int = 2
  d_model: int = 64
  num_heads: int = 4
  mlp_dim: int = 256
  vocab_size: int = 256
  max_len: int = 64
  positions: str = "rotary"
  tie_embeddings: bool = True
  dtype: str = "float32"
  remat: str = "nothing_saveable"
  scan_layers: bool = True
  use_bias: bool = False
  dot_general_cls: Any = None
  dense: Callable[..., Any] = nn.Dense

  def __post_init__(self):
    for name in ("num_layers", "d_model", "num_heads", "mlp_dim", "vocab_size", "max_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"GPT: {name} must be an int >= 1, got {value!r}")
    if self.d_model % self.num_heads:
      raise ValueError(f"GPT: d_model={self.d_model} must be divisible by num_heads="
                       f"{self.num_heads}")
    if self.positions not in POSITIONS:
      raise ValueError(f"GPT: positions must be one of {list(POSITIONS)}, got {self.positions!r}")
    if self.positions == "rotary" and (self.d_model // self.num_heads) % 2:
      raise ValueError(f"GPT: positions='rotary' needs an even head size, got d_model / "
                       f"num_heads = {self.d_model // self.num_heads}")
    if self.dtype not in DTYPES:
      raise ValueError(f"GPT: dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
    _policy(self.remat)
    if self.dense is not nn.Dense and self.dot_general_cls is None and getattr(
        self.dense, "dot_general_cls", None) is None:
      raise ValueError("GPT: dense must be a dAD method's factory (it has a dot_general_cls); "
                       "give a layer contraction as dot_general_cls instead")
    super().__post_init__()

  def _dot_general_cls(self):
    if self.dot_general_cls is not None:
      return self.dot_general_cls
    return None if self.dense is nn.Dense else self.dense.dot_general_cls

  @nn.compact
  def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
    del train  # no dropout: pod-scale pre-training runs without it
    if tokens.ndim != 2:
      raise ValueError(f"GPT takes int tokens (batch, T), got shape {tokens.shape}")
    t = tokens.shape[1]
    if t > self.max_len:
      raise ValueError(f"GPT: sequence length {t} exceeds max_len={self.max_len}")
    dtype = jnp.dtype(self.dtype)
    embed = nn.Embed(self.vocab_size, self.d_model, dtype=dtype, param_dtype=jnp.float32,
                     embedding_init=_param(nn.initializers.normal(0.02), ("vocab", "embed")),
                     name="embed")
    # The lookup reads the table whole inside the site (FSDP gathers it for the forward pass
    # anyway): the gradient of a gather from a table sharded over an automatic axis inside a
    # partially manual shard_map aborts XLA's SPMD partitioner (spmd_partitioner_util.cc:497,
    # reproduced by tests/test_slices.py::test_xla_limitations_that_the_placement_works_around).
    table = nn.with_logical_constraint(embed.embedding, (None, None))
    x = jnp.take(table, tokens, axis=0).astype(dtype)
    if self.positions == "learned":
      pos = self.param("pos_embed", _param(nn.initializers.normal(0.02), (None, "embed")),
                       (self.max_len, self.d_model), jnp.float32)
      x = x + pos[:t].astype(dtype)
    x = nn.with_logical_constraint(x.astype(dtype), ("batch", "length", "embed"))

    fields = dict(d_model=self.d_model, num_heads=self.num_heads, mlp_dim=self.mlp_dim,
                  positions=self.positions, dtype=self.dtype, use_bias=self.use_bias,
                  dot_general_cls=self._dot_general_cls())
    block = GPTBlock
    policy = _policy(self.remat)
    if self.remat != "none":
      # Under scan the loop already keeps XLA from merging the recomputation
      # with the forward pass, so CSE prevention is only needed unrolled.
      block = nn.remat(block, policy=policy, prevent_cse=not self.scan_layers)
    if self.scan_layers:
      # Every collection (params, dAD's state, the sown "comm" bits) stacks
      # per layer; the stacked parameters carry the logical name "layers".
      stack = nn.scan(block, variable_axes={True: 0}, split_rngs={"params": True},
                      length=self.num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
      x, _ = stack(**fields, name="layers")(x, None)
    else:
      for i in range(self.num_layers):
        x, _ = block(**fields, name=f"block_{i}")(x, None)

    x = nn.LayerNorm(dtype=dtype, param_dtype=jnp.float32,
                     scale_init=_param(nn.initializers.ones, ("embed",)),
                     bias_init=_param(nn.initializers.zeros, ("embed",)), name="ln_final")(x)
    if self.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = Projection((self.vocab_size,), ("embed", "vocab"), dtype=self.dtype,
                          use_bias=self.use_bias, dot_general_cls=self._dot_general_cls(),
                          name="head")(x)
    logits = nn.with_logical_constraint(logits, ("batch", "length", "vocab"))
    return logits.astype(jnp.float32)


def make_gpt(name: str, **overrides: Any) -> GPT:
  """A :class:`GPT` of a named size (:data:`GPT_CONFIGS`) with fields overridden.

  Raises:
    ValueError: an unknown name or a bad field.
  """
  return GPT(**{**gpt_config(name), **overrides})


def gpt_param_count(model: GPT) -> int:
  """The number of parameters of ``model`` (from ``jax.eval_shape``; nothing allocated)."""
  shapes = _param_shapes(model, min(8, model.max_len))
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(shapes))))


def _param_shapes(model: GPT, seq_len: int):
  tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  return jax.eval_shape(lambda k, x: model.init(k, x)["params"], jax.random.key(0), tokens)


class GPTMemory(NamedTuple):
  """Per-device bytes of one training step of a :class:`GPT` (see :func:`gpt_memory`).

  Attributes:
    params, grads, optimizer, activations: bytes per device.
    total: their sum.
    param_count: the model's parameters (all of them, one site).
    mesh_shape: ``{axis: size}``.
    rules: the logical axis rules used.
    specs: the in-site ``PartitionSpec`` of every parameter (a tree).
    sites_per_device: sites simulated on one device (``vmap``), else 1.
  """

  params: int
  grads: int
  optimizer: int
  activations: int
  total: int
  param_count: int
  mesh_shape: dict
  rules: tuple
  specs: Any
  sites_per_device: int

  def fits(self, hbm_bytes: float) -> bool:
    """Whether the step's estimate fits ``hbm_bytes`` of device memory."""
    return self.total <= hbm_bytes

  def table(self, hbm_gib: float | None = None) -> str:
    """The numbers as a few printable lines (GiB per device)."""
    gib = lambda n: f"{n / 2**30:8.3f} GiB"
    mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
    lines = [f"parameters      {self.param_count:,} ({self.param_count * 4 / 2**30:.3f} GiB fp32 "
             "per replica)",
             f"mesh            {mesh} (site axis {SITE_AXIS!r} manual: one replica per site)"
             + (f"; {self.sites_per_device} sites per device (vmap)"
                if self.sites_per_device > 1 else ""),
             "per device:",
             f"  params        {gib(self.params)}",
             f"  grads         {gib(self.grads)}",
             f"  optimizer     {gib(self.optimizer)}",
             f"  activations   {gib(self.activations)}  (estimate)",
             f"  total         {gib(self.total)}"]
    if hbm_gib is not None:
      verdict = "fits" if self.fits(hbm_gib * 2**30) else "does NOT fit"
      share = 100 * self.total / (hbm_gib * 2**30)
      lines.append(f"  {verdict} in {hbm_gib:g} GiB HBM ({share:.0f}%)")
    return "\n".join(lines)


_OPTIMIZER_COPIES = {"adam": 2, "adamw": 2, "sgd": 1, "none": 0}


def _check_mesh(mesh_shape: dict, rules) -> None:
  if not isinstance(mesh_shape, dict) or SITE_AXIS not in mesh_shape:
    raise ValueError(f"mesh_shape must be a dict {{axis: size}} with the site axis {SITE_AXIS!r}, "
                     f"got {mesh_shape!r}")
  for axis, size in mesh_shape.items():
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
      raise ValueError(f"mesh_shape[{axis!r}] must be an int >= 1, got {size!r}")
  for name, axes in rules:
    named = axes if isinstance(axes, (tuple, list)) else (axes,)
    if SITE_AXIS in named:
      raise ValueError(f"rules: the site axis {SITE_AXIS!r} is manual and must not appear in the "
                       f"logical axis rules, got ({name!r}, {axes!r})")


def _shard_bytes(mesh, spec, shape, itemsize: int) -> int:
  return math.prod(jax.sharding.NamedSharding(mesh, spec).shard_shape(tuple(shape))) * itemsize


def _activation_bytes(model: GPT, mesh, rules, batch: int, seq_len: int) -> int:
  """An estimate of the activations a step keeps live at its peak on one device.

  What the backward pass keeps per layer depends on ``remat``:
  ``"nothing_saveable"`` keeps each block's input; ``"none"`` /
  ``"everything_saveable"`` keeps every intermediate below; any other policy
  is counted as keeping the inputs and the dot outputs (q, k, v, attention
  output, MLP hidden, the two projections). On top: one block's
  intermediates (the recomputed block during the backward pass), the
  embeddings, the fp32 logits with their gradient, and, where the
  embedding table is sharded, its whole copy and whole gradient (the lookup
  reads it whole inside a site).
  """
  item = jnp.dtype(model.dtype).itemsize
  h, kv = model.num_heads, model.d_model // model.num_heads

  def size(names, dims, itemsize=item):
    spec = jax.sharding.PartitionSpec(*nn.logical_to_mesh_axes(names, rules))
    return _shard_bytes(mesh, _clean(spec, dims, mesh), dims, itemsize)

  b, t, d, m = batch, seq_len, model.d_model, model.mlp_dim
  x = size(("batch", "length", "embed"), (b, t, d))
  qkv = size(("batch", "length", "heads", "kv"), (b, t, h, kv))
  scores = size(("batch", "heads", "length", None), (b, h, t, t), 4)
  hidden = size(("batch", "length", "mlp"), (b, t, m))
  dots = 4 * qkv + 2 * x + hidden
  block = 2 * x + dots + 2 * scores + 2 * hidden  # LN outputs, dots, logits + probs, gelu
  if model.remat == "nothing_saveable":
    kept = x
  elif model.remat in ("none", "everything_saveable"):
    kept = x + block
  else:
    kept = x + dots
  logits = 2 * size(("batch", "length", "vocab"), (b, t, model.vocab_size), 4)
  # The lookup reads the table whole inside a site (GPT.__call__): a gathered copy of a sharded
  # table and its whole gradient before the reduce-scatter, beyond the shard already counted.
  full = model.vocab_size * d * 4
  table = 2 * (full - size(("vocab", "embed"), (model.vocab_size, d), 4))
  return model.num_layers * kept + block + 2 * x + logits + table


def _clean(spec, shape, mesh):
  """``spec`` with the site axis removed and whole where an axis does not divide."""
  out = []
  entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
  for n, axes in zip(shape, entries):
    axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    axes = tuple(a for a in axes if a in mesh.shape and a != SITE_AXIS)
    ok = axes and n % math.prod(mesh.shape[a] for a in axes) == 0
    out.append((axes[0] if len(axes) == 1 else axes) if ok else None)
  while out and out[-1] is None:  # the placement's form (dadjax.parallel: clean_spec)
    out.pop()
  return jax.sharding.PartitionSpec(*out)


def gpt_memory(model: GPT | str, mesh_shape: dict | None = None, rules: Any = "fsdp", *,
               batch_per_site: int = 8, seq_len: int | None = None, optimizer: str = "adam",
               sites_per_device: int = 1, **overrides: Any) -> GPTMemory:
  """Dry run: the per-device memory of a GPT training step, without allocating it.

  Parameter shapes come from ``jax.eval_shape`` of ``model.init``; each
  parameter's in-site sharding from its logical names and ``rules``
  (``nn.logical_to_mesh_axes``, the site axis never named, a dimension the
  mesh axes do not divide kept whole) on a ``jax.sharding.AbstractMesh`` of
  ``mesh_shape`` (no devices needed); bytes per device from the sharding's
  ``shard_shape``. Gradients take the parameters' layout in fp32, Adam two
  more copies (``optimizer="sgd"``: one momentum copy), activations the
  estimate of the module docstring's rules (batch split as the ``batch``
  rule says). A method's own per-site state (an error-feedback memory: one
  more copy of the gradient) is not included.

  Args:
    model: a :class:`GPT` or a name of :data:`GPT_CONFIGS`.
    mesh_shape: ``{axis: size}`` with the site axis ``"data"`` and in-site
      axes such as ``"fsdp"`` / ``"model"`` (default ``{"data": 1}``).
    rules: a :func:`gpt_rules` kind (``"fsdp"``, ``"tp"``, ``"fsdp_tp"``,
      ``"replicated"``) or logical axis rules (pairs).
    batch_per_site: sequences per site per step.
    seq_len: tokens per sequence (default: the model's ``max_len``).
    optimizer: ``"adam"`` / ``"adamw"`` (2 fp32 copies), ``"sgd"`` (1:
      momentum) or ``"none"``.
    sites_per_device: sites simulated on one device (``vmap``): every count
      is multiplied by it.
    **overrides: fields of a named model (e.g. ``vocab_size=256``).

  Returns:
    A :class:`GPTMemory` (``.table()`` prints it).

  Raises:
    ValueError: a bad mesh (no site axis, sizes < 1), rules that name the
      site axis, a bad ``optimizer``, ``batch_per_site`` or ``seq_len``.
  """
  if isinstance(model, str):
    model = make_gpt(model, **overrides)
  elif overrides:
    model = model.clone(**overrides)
  mesh_shape = {SITE_AXIS: 1} if mesh_shape is None else dict(mesh_shape)
  rules = gpt_rules(rules) if isinstance(rules, str) else tuple(tuple(r) for r in rules)
  _check_mesh(mesh_shape, rules)
  if optimizer not in _OPTIMIZER_COPIES:
    raise ValueError(f"optimizer must be one of {sorted(_OPTIMIZER_COPIES)}, got {optimizer!r}")
  seq_len = model.max_len if seq_len is None else seq_len
  if not isinstance(seq_len, int) or not 1 <= seq_len <= model.max_len:
    raise ValueError(f"seq_len must be an int in [1, max_len={model.max_len}], got {seq_len!r}")
  if not isinstance(batch_per_site, int) or batch_per_site < 1:
    raise ValueError(f"batch_per_site must be an int >= 1, got {batch_per_site!r}")
  if not isinstance(sites_per_device, int) or sites_per_device < 1:
    raise ValueError(f"sites_per_device must be an int >= 1, got {sites_per_device!r}")

  mesh = jax.sharding.AbstractMesh(tuple(mesh_shape.values()), tuple(mesh_shape))
  boxed = _param_shapes(model, min(seq_len, 8))
  arrays = nn.unbox(boxed)

  def spec(x):
    names = x.names if isinstance(x, nn.Partitioned) else (None,) * len(x.shape)
    value = x.value if isinstance(x, nn.Partitioned) else x
    return _clean(jax.sharding.PartitionSpec(*nn.logical_to_mesh_axes(names, rules)),
                  value.shape, mesh)

  specs = jax.tree.map(spec, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
  per_leaf = jax.tree.map(lambda s, x: _shard_bytes(mesh, s, x.shape, 4), specs, arrays,
                          is_leaf=is_spec)
  params = int(sum(jax.tree.leaves(per_leaf)))
  count = int(sum(math.prod(x.shape) for x in jax.tree.leaves(arrays)))
  acts = _activation_bytes(model, mesh, rules, batch_per_site, seq_len)
  k = sites_per_device
  parts = (k * params, k * params, k * _OPTIMIZER_COPIES[optimizer] * params, k * acts)
  return GPTMemory(*parts, total=sum(parts), param_count=count, mesh_shape=mesh_shape,
                   rules=rules, specs=specs, sites_per_device=k)


def parse_mesh(text: str) -> dict:
  mesh = {}
  for item in text.split(","):
    axis, _, size = item.partition("=")
    if not axis.strip() or not size.strip().isdigit():
      raise ValueError(f"--mesh must look like data=2,fsdp=16,model=1, got {text!r}")
    mesh[axis.strip()] = int(size)
  return mesh


def gpt_dry_run(config: Any, *, mesh: str | dict | None = None, rules: str | None = None,
            hbm_gib: float | None = None) -> str:
  """The ``dadjax dryrun`` report of a train config whose model is a GPT (no allocation).

  The mesh defaults to the config's: ``data=num_sites`` and its
  ``mesh_inner`` axes (else, with ``per_site > 1``, ``fsdp=per_site``);
  ``backend="vmap"`` puts every site on one device. The rules default to
  the config's ``rules``, else ``"fsdp"`` (``"fsdp_tp"`` when the mesh has
  a ``"model"`` axis larger than 1). ``seq_len`` is the config's
  ``dataset_kwargs["seq_len"]`` (else the model's ``max_len``); a
  ``text:`` dataset sets ``vocab_size=256`` unless ``model_kwargs`` give
  it, as ``dadjax train`` does; the optimizer is the config's.

  Args:
    config: a :class:`dadjax.config.Config`.
    mesh: ``"data=2,fsdp=16,model=1"`` or a dict (overrides the config's).
    rules: a :func:`gpt_rules` kind.
    hbm_gib: device memory to compare with (GiB), or ``None``.

  Returns:
    The printable report.

  Raises:
    ValueError: a model that is not a GPT, a bad mesh or rules.
  """
  from dadjax.models._lookup import model_class  # pylint: disable=g-import-not-at-top
  cls, defaults = model_class(config.model)
  if not (isinstance(cls, type) and issubclass(cls, GPT)):
    raise ValueError(f"dryrun: config.model must be a GPT (one of {sorted(GPT_CONFIGS)}), got "
                     f"{config.model!r}")
  kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in config.model_kwargs.items()}
  if config.dataset.startswith("text:"):
    kwargs.setdefault("vocab_size", 256)  # as dadjax.train.build does for a byte corpus
  model = cls(**{**defaults, **kwargs})
  vmap = config.backend == "vmap"
  if isinstance(mesh, str):
    mesh = parse_mesh(mesh)
  if mesh is None:
    mesh = {SITE_AXIS: config.num_sites}
    inner = dict(getattr(config, "mesh_inner", None) or {})
    if inner:
      mesh.update(inner)
    elif config.per_site > 1:
      mesh[FSDP_AXIS] = config.per_site
  if rules is None:
    rules = getattr(config, "rules", None)
  if rules is None:
    rules = "fsdp_tp" if mesh.get(MODEL_AXIS, 1) > 1 else "fsdp"
  seq_len = config.dataset_kwargs.get("seq_len", model.max_len)
  opt = config.optimizer.split("(")[0].strip()
  mem = gpt_memory(model, mesh, rules, batch_per_site=config.batch_per_site, seq_len=seq_len,
                   optimizer=opt if opt in _OPTIMIZER_COPIES else "adam",
                   sites_per_device=config.num_sites if vmap else 1)
  head = (f"dry run (an estimate from shapes; `dadjax compile` gives the compiler's figures): "
          f"model={config.model} ({model.num_layers} layers, d_model {model.d_model}, "
          f"vocab {model.vocab_size}, dtype {model.dtype}, remat {model.remat}), rules={rules}, "
          f"batch_per_site={config.batch_per_site}, seq_len={seq_len}, optimizer={opt}")
  return head + "\n" + mem.table(hbm_gib)
