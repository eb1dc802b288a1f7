"""GRU sequence classifier with a hand-written cell (dense maps via ``dense``)."""
from typing import Callable, Optional, Tuple

import flax.linen as nn
import jax.numpy as jnp


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
        hp = self.dense(3 * self.hidden, use_bias=True, name="hh",
                        kernel_init=nn.initializers.orthogonal())(h)
        xr, xz, xn = jnp.split(xp, 3, axis=-1)
        hr, hz, hn = jnp.split(hp, 3, axis=-1)
        r = nn.sigmoid(xr + hr)
        z = nn.sigmoid(xz + hz)
        n = jnp.tanh(xn + r * hn)
        h = (1.0 - z) * n + z * h
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


class GRUClassifier(nn.Module):
    """Single-layer GRU; classifies from the final hidden state.

    Input:  float ``(batch, T, features)``, or int tokens ``(batch, T)`` when
            ``vocab_size`` is given (embedded with ``nn.Embed``).
    Output: logits ``(batch, num_classes)``.

    The input-to-hidden projection (``3 * hidden``, named ``"ih"``) is applied
    once to the whole sequence ``(batch, T, d)`` before the recurrence (rows =
    batch * time, as in cuDNN); the hidden-to-hidden projection runs inside an
    ``nn.scan`` over time (``cell/hh``).

    Attributes:
      hidden: hidden-state size (default 64).
      num_classes: number of classes (default 10).
      vocab_size: token vocabulary size; ``None`` (default) for float inputs.
      embed_dim: embedding size for token inputs (default 32).
      dense: factory for every dense layer (default ``nn.Dense``).

    Reference: Cho et al., "Learning Phrase Representations using RNN
    Encoder-Decoder for Statistical Machine Translation", EMNLP 2014.
    """

    hidden: int = 64
    num_classes: int = 10
    vocab_size: Optional[int] = None
    embed_dim: int = 32
    dense: Callable[..., nn.Module] = nn.Dense

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
        del train
        if self.vocab_size is not None:
            x = nn.Embed(self.vocab_size, self.embed_dim, name="embed")(x)
        xp = self.dense(3 * self.hidden, use_bias=True, name="ih")(x)  # (b, T, 3h)
        h0 = jnp.zeros_like(xp[:, 0, : self.hidden])  # inherits the input's varying-axes type under shard_map
        h, _ = _ScanGRUStep(self.hidden, self.dense, name="cell")(h0, xp)
        return self.dense(self.num_classes, use_bias=True, name="head")(h)
