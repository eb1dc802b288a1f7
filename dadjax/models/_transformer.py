"""Pre-LayerNorm transformer encoder classifier (text tokens or ViT patches)."""

from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from dadjax._core.validate import check_real


class TransformerBlock(nn.Module):
  """Pre-LN encoder block: ``x + MHA(LN(x))`` then ``x + MLP(LN(x))``.

  Input / output: ``(batch, tokens, d_model)``.

  Attention is written out explicitly: q, k, v and output projections are
  ``dense(d_model, use_bias=True)`` layers named ``query``, ``key``,
  ``value``, ``out`` (biases as in PyTorch ``nn.MultiheadAttention``),
  softmax over keys with ``1/sqrt(head_dim)`` scaling, no mask (``causal=True``:
  token ``q`` attends only to keys ``k <= q``, as in a decoder). The MLP is
  ``dense(mlp_dim) -> gelu -> dense(d_model)`` (``mlp_in``, ``mlp_out``).
  With ``dropout > 0`` (and ``train=True``), dropout is applied to the
  output of the attention projection and of the MLP before each residual
  add (``"dropout"`` rng stream).

  Attributes:
    d_model: model width (default 64); must be divisible by ``num_heads``.
    num_heads: attention heads (default 4).
    mlp_dim: MLP hidden width (default 128).
    dense: factory for every dense layer (default ``nn.Dense``).
    dropout: residual dropout rate in ``[0, 1)`` (default 0).
    causal: mask attention to earlier tokens (default False).

  Reference: Vaswani et al., "Attention Is All You Need", NeurIPS 2017;
  pre-LN: Xiong et al., "On Layer Normalization in the Transformer
  Architecture", ICML 2020.
  """

  d_model: int = 64
  num_heads: int = 4
  mlp_dim: int = 128
  dense: Callable[..., nn.Module] = nn.Dense
  dropout: float = 0.0
  causal: bool = False

  def __post_init__(self):
    check_real("dropout", self.dropout, "[0, 1)")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    drop = (lambda y: nn.Dropout(self.dropout, deterministic=not train)(y)) if self.dropout else (
        lambda y: y)
    b, t, d = x.shape
    h = self.num_heads
    if d != self.d_model or d % h:
      raise ValueError(f"expected last dim {self.d_model} divisible by {h}, got {d}")
    dh = d // h

    y = nn.LayerNorm(name="ln_attn")(x)
    q = self.dense(d, use_bias=True, name="query")(y).reshape(b, t, h, dh)
    k = self.dense(d, use_bias=True, name="key")(y).reshape(b, t, h, dh)
    v = self.dense(d, use_bias=True, name="value")(y).reshape(b, t, h, dh)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q * dh**-0.5, k)
    if self.causal:
      keep = jnp.tril(jnp.ones((t, t), bool))
      logits = jnp.where(keep, logits, jnp.finfo(logits.dtype).min)
    attn = jax.nn.softmax(logits, axis=-1)
    y = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d)
    x = x + drop(self.dense(d, use_bias=True, name="out")(y))

    y = nn.LayerNorm(name="ln_mlp")(x)
    y = nn.gelu(self.dense(self.mlp_dim, use_bias=True, name="mlp_in")(y))
    return x + drop(self.dense(d, use_bias=True, name="mlp_out")(y))


class Transformer(nn.Module):
  """Transformer encoder classifier: embed -> ``num_layers`` pre-LN blocks ->
  mean-pool over tokens -> LayerNorm -> dense head.

  Inputs (chosen by the fields):
    * ``vocab_size`` set: int tokens ``(batch, T)`` -> ``nn.Embed``.
    * ``patch_size`` set: images ``(batch, H, W, C)`` (H, W divisible by
      ``patch_size``) -> non-overlapping ``p x p`` patches flattened to
      ``(batch, H*W/p**2, p*p*C)`` -> ``dense(d_model)`` (``patch_embed``),
      as in ViT.
    * neither: float ``(batch, T, features)`` -> ``dense(d_model)``
      (``input_proj``).

  A learned positional embedding ``pos_embed`` ``(max_len, d_model)``
  (normal(0.02) init) is added, sliced to the first ``T`` positions.

  Output: logits ``(batch, num_classes)``.

  Attributes:
    num_layers: encoder blocks (default 1).
    d_model, num_heads, mlp_dim: block sizes (defaults 64, 4, 128).
    num_classes: number of classes (default 10).
    vocab_size: token vocabulary size (default ``None``).
    patch_size: ViT patch size (default ``None``).
    max_len: maximum number of tokens / patches (default 512).
    dense: factory for every dense layer (default ``nn.Dense``).
    dropout: residual dropout rate of every block (default 0).

  Reference: Vaswani et al., NeurIPS 2017; Dosovitskiy et al., "An Image is
  Worth 16x16 Words", ICLR 2021.
  """

  num_layers: int = 1
  d_model: int = 64
  num_heads: int = 4
  mlp_dim: int = 128
  num_classes: int = 10
  vocab_size: Optional[int] = None
  patch_size: Optional[int] = None
  max_len: int = 512
  dense: Callable[..., nn.Module] = nn.Dense
  dropout: float = 0.0

  def __post_init__(self):
    check_real("dropout", self.dropout, "[0, 1)")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    if self.vocab_size is not None:
      x = nn.Embed(self.vocab_size, self.d_model, name="embed")(x)
    elif self.patch_size is not None:
      b, hgt, wid, c = x.shape
      p = self.patch_size
      if hgt % p or wid % p:
        raise ValueError(f"image {hgt}x{wid} not divisible by patch_size={p}")
      x = x.reshape(b, hgt // p, p, wid // p, p, c).transpose(0, 1, 3, 2, 4, 5)
      x = x.reshape(b, (hgt // p) * (wid // p), p * p * c)
      x = self.dense(self.d_model, use_bias=True, name="patch_embed")(x)
    else:
      x = self.dense(self.d_model, use_bias=True, name="input_proj")(x)

    t = x.shape[1]
    if t > self.max_len:
      raise ValueError(f"sequence length {t} exceeds max_len={self.max_len}")
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (self.max_len, self.d_model))
    x = x + pos[:t].astype(x.dtype)

    for i in range(self.num_layers):
      x = TransformerBlock(
        self.d_model, self.num_heads, self.mlp_dim, self.dense, self.dropout, name=f"block_{i}"
      )(x, train)
    x = nn.LayerNorm(name="ln_final")(jnp.mean(x, axis=1))
    return self.dense(self.num_classes, use_bias=True, name="head")(x)
