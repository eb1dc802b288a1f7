"""Error feedback (memory) for any compressor."""

from __future__ import annotations

from typing import Any, NamedTuple

from dadjax._core.trees import check_tree_matches, tree_add, tree_sub, tree_zeros_like
from dadjax.compress._base import Compressor, Exchanged, as_keys, exchange
from dadjax.registry import COMPRESSOR, Arg, register_compressor


class ErrorFeedbackState(NamedTuple):
  """The wrapped compressor's state and this site's residual memory ``e``."""

  inner: Any
  memory: Any


@register_compressor("ef", Arg("compressor", COMPRESSOR, doc="the compressor to wrap"),
                     prefix="ef_")
def error_feedback(compressor: Compressor) -> Compressor:
  """Wrap a (biased) compressor with a residual memory.

  Each step the site compresses ``g + e`` instead of ``g`` and keeps what
  did not get through: ``e <- g + e - decompress(payload)``, the *local*
  decompression of the payload this site sent (not the average over
  sites). Nothing is lost, only delayed, which restores convergence for
  biased compressors such as TopK and scaled sign.

  A compressor that already keeps its own memory (``compressor.memory``:
  PowerSGD with its default ``error_feedback=True``, or the result of an
  earlier ``error_feedback``) is returned unchanged, so its memory is
  applied once: ``error_feedback(powersgd(2))`` (the ``"ef_powersgd:2"``
  spec) is ``powersgd(2)``, PowerSGD's own error feedback as in the paper.

  Args:
    compressor: any :class:`Compressor` (its exchange may be multi-round:
      then the local reconstruction it reports is subtracted).

  Returns:
    A :class:`Compressor` with the same payload, bits and communication,
    whose state is :class:`ErrorFeedbackState` (or ``compressor`` itself
    when it has a memory already).

  Raises:
    ValueError: at once if ``compressor`` is not a :class:`Compressor`; at
      ``compress`` / exchange time if the gradients' structure, shapes or
      dtypes differ from the params given to ``init`` (naming the leaf).

  References:
    Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014;
    Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018
    (https://arxiv.org/abs/1809.07599); Karimireddy et al., "Error Feedback
    Fixes SignSGD and other Gradient Compression Schemes", ICML 2019
    (https://arxiv.org/abs/1901.09847).
  """
  if not isinstance(compressor, Compressor):
    raise ValueError(f"error_feedback wraps a Compressor (e.g. dadjax.compress.topk(0.01)), "
                     f"got {type(compressor).__name__}: {compressor!r}")
  if compressor.memory:
    return compressor

  def init(params):
    return ErrorFeedbackState(compressor.init(params), tree_zeros_like(params))

  def compress(grads, state, key):
    key = as_keys(key)
    check_tree_matches(grads, state.memory, "error_feedback")
    corrected = tree_add(grads, state.memory)
    payload, inner = compressor.compress(corrected, state.inner, key)
    local = compressor.decompress(payload, corrected, key)
    return payload, ErrorFeedbackState(inner, tree_sub(corrected, local))

  def exchange_fn(grads, state, key, axis_name):
    check_tree_matches(grads, state.memory, "error_feedback")
    corrected = tree_add(grads, state.memory)
    out = exchange(compressor, corrected, state.inner, key, axis_name)
    memory = tree_sub(corrected, out.local)
    return Exchanged(out.mean, out.local, ErrorFeedbackState(out.state, memory), out.traffic)

  return Compressor(
      init=init,
      compress=compress,
      decompress=compressor.decompress,
      bits=compressor.bits,
      communication=compressor.communication,
      aggregate=compressor.aggregate,
      exchange=exchange_fn,
      memory=True,
      name=f"ef_{compressor.name}" if compressor.name else "error_feedback",
      shardable=compressor.shardable,  # the memory update is elementwise
  )
