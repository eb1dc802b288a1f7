"""Language models over byte (or token) sequences: a decoder-only transformer and an LSTM.

Both map int tokens ``(batch, T)`` to next-token logits ``(batch, T,
num_classes)``; with :func:`dadjax.parallel.classification_loss` (the train
step's default) the loss is the mean per-token cross-entropy, and
:func:`dadjax.data.language_model_metrics` reports bits per byte. Every
projection is a ``dense`` layer, so ``dense=dadjax.dad.Dense`` synchronizes
them by dAD (rows = ``batch * T``); the token embedding is ``nn.Embed``
(all-reduced by the method's default).
"""

from typing import Callable, Optional, Tuple

import flax.linen as nn
import jax.numpy as jnp

from dadjax._core.validate import check_real
from dadjax.models._transformer import TransformerBlock


class TransformerLM(nn.Module):
  """Decoder-only (GPT-style) pre-LN transformer language model.

  ``embed`` (``nn.Embed(vocab_size, d_model)``) + learned ``pos_embed``
  ``(max_len, d_model)`` -> ``num_layers`` causal :class:`TransformerBlock`
  s (``query``, ``key``, ``value``, ``out``, ``mlp_in``, ``mlp_out`` all
  ``dense`` layers) -> ``ln_final`` -> ``head`` (``dense(num_classes)``) at
  every position.

  Input: int tokens ``(batch, T)`` in ``[0, vocab_size)``, ``T <= max_len``.

  Output: logits ``(batch, T, num_classes)``; position ``t`` sees tokens
  ``0..t`` only.

  Attributes:
    num_layers: decoder blocks (default 2).
    d_model, num_heads, mlp_dim: block sizes (defaults 128, 4, 512; about
      0.53M parameters with 256 bytes and max_len 512).
    vocab_size: input vocabulary (default 256: bytes).
    num_classes: output classes (default ``None``: ``vocab_size``).
    max_len: longest sequence (default 512).
    dense: factory for every dense layer (default ``nn.Dense``).
    dropout: residual dropout rate (default 0).

  Reference: Radford et al., "Language Models are Unsupervised Multitask
  Learners" (GPT-2), 2019; Vaswani et al., NeurIPS 2017; the dAD paper
  (https://arxiv.org/abs/2102.09631) for attention projections as dAD
  layers.
  """

  num_layers: int = 2
  d_model: int = 128
  num_heads: int = 4
  mlp_dim: int = 512
  vocab_size: int = 256
  num_classes: Optional[int] = None
  max_len: int = 512
  dense: Callable[..., nn.Module] = nn.Dense
  dropout: float = 0.0

  def __post_init__(self):
    check_real("dropout", self.dropout, "[0, 1)")
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model={self.d_model} must be divisible by num_heads="
                       f"{self.num_heads}")
    super().__post_init__()

  @nn.compact
  def __call__(self, tokens: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    if tokens.ndim != 2:
      raise ValueError(f"TransformerLM takes int tokens (batch, T), got shape {tokens.shape}")
    t = tokens.shape[1]
    if t > self.max_len:
      raise ValueError(f"sequence length {t} exceeds max_len={self.max_len}")
    x = nn.Embed(self.vocab_size, self.d_model, name="embed")(tokens)
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (self.max_len, self.d_model))
    x = x + pos[:t].astype(x.dtype)
    for i in range(self.num_layers):
      x = TransformerBlock(self.d_model, self.num_heads, self.mlp_dim, self.dense, self.dropout,
                           causal=True, name=f"block_{i}")(x, train)
    x = nn.LayerNorm(name="ln_final")(x)
    return self.dense(self.num_classes or self.vocab_size, use_bias=True, name="head")(x)


class LSTMStep(nn.Module):
  """One LSTM time step given the pre-computed input projection.

  Inputs: carry ``(c, h)``, each ``(batch, hidden)``; ``xp``
  ``(batch, 4 hidden)`` = ``W_i x_t + b_i`` (gates i, f, g, o).

  Returns: ``((c_new, h_new), h_new)``.

  The hidden-to-hidden map ``W_h h + b_h`` is a ``dense(4 hidden)`` layer
  named ``"hh"``::

      i, f, g, o = split(xp + hh(h))
      c_new = sigmoid(f + forget_bias) c + sigmoid(i) tanh(g)
      h_new = sigmoid(o) tanh(c_new)
  """

  hidden: int
  dense: Callable[..., nn.Module] = nn.Dense
  forget_bias: float = 1.0

  @nn.compact
  def __call__(self, carry: Tuple[jnp.ndarray, jnp.ndarray],
               xp: jnp.ndarray) -> Tuple[Tuple[jnp.ndarray, jnp.ndarray], jnp.ndarray]:
    c, h = carry
    hp = self.dense(4 * self.hidden, use_bias=True, name="hh",
                    kernel_init=nn.initializers.orthogonal())(h)
    i, f, g, o = jnp.split(xp + hp, 4, axis=-1)
    c = nn.sigmoid(f + self.forget_bias) * c + nn.sigmoid(i) * jnp.tanh(g)
    h = nn.sigmoid(o) * jnp.tanh(c)
    return (c, h), h


# Parameters and "dad_state" are shared over time; sown "comm" entries stack on a time axis.
_ScanLSTMStep = nn.scan(
  LSTMStep,
  variable_broadcast=["params", "dad_state"],
  variable_axes={"comm": 0},
  split_rngs={"params": False},
  in_axes=1,
  out_axes=1,
)


class LSTMLM(nn.Module):
  """Stacked-LSTM language model (Accordion's WikiText-2 setting, at byte level).

  ``embed`` -> for each layer: ``ih`` (``dense(4 hidden)`` over all ``batch
  * T`` rows, as in cuDNN) and an ``nn.scan`` of :class:`LSTMStep` over time
  (its ``hh`` is a ``dense`` layer called once per step, so a dAD ``hh``
  synchronizes ``T`` times per step) -> ``head`` (``dense(num_classes)``) at
  every position.

  Input:  int tokens ``(batch, T)``.
  Output: logits ``(batch, T, num_classes)``.

  Attributes:
    num_layers: stacked LSTM layers (default 1).
    hidden: hidden and cell size (default 256).
    embed_dim: token embedding size (default 64).
    vocab_size: input vocabulary (default 256: bytes).
    num_classes: output classes (default ``None``: ``vocab_size``).
    dense: factory for every dense layer (default ``nn.Dense``).

  Reference: Hochreiter & Schmidhuber, "Long Short-Term Memory", 1997;
  Zaremba et al., "Recurrent Neural Network Regularization", 2014; Agarwal
  et al., "Accordion" (https://arxiv.org/abs/2010.16248).
  """

  num_layers: int = 1
  hidden: int = 256
  embed_dim: int = 64
  vocab_size: int = 256
  num_classes: Optional[int] = None
  dense: Callable[..., nn.Module] = nn.Dense

  @nn.compact
  def __call__(self, tokens: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    del train
    if tokens.ndim != 2:
      raise ValueError(f"LSTMLM takes int tokens (batch, T), got shape {tokens.shape}")
    x = nn.Embed(self.vocab_size, self.embed_dim, name="embed")(tokens)
    for i in range(self.num_layers):
      xp = self.dense(4 * self.hidden, use_bias=True, name=f"ih_{i}")(x)  # (b, T, 4h)
      h0 = jnp.zeros_like(xp[:, 0, : self.hidden])  # the input's varying-axes type
      _, x = _ScanLSTMStep(self.hidden, self.dense, name=f"cell_{i}")((h0, h0), xp)
    return self.dense(self.num_classes or self.vocab_size, use_bias=True, name="head")(x)
