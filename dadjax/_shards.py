"""Parameters sharded within a site (FSDP): what the methods are told while a step is traced.

With ``make_train_step(..., shard_params=True)`` on a 2-D mesh, every
device of a site holds only a slice of each parameter, of its optimizer
state and of the site's averaged gradient. A method that acts on each
entry on its own (all-reduce, casting, signSGD's majority vote, error
feedback around them, elementwise optimizers) runs unchanged on the slice
and gives the replicated result. A method that needs a whole tensor
(TopK's selection, a norm or a scale per tensor, PowerSGD's matrices,
Accordion's per-tensor norms) would silently compute on the slice; those
call :func:`require_whole_leaves`, which refuses while the step with
sharded parameters is being traced.

This is trace-time Python state (the step enters :func:`sharded_parameters`
around the code it traces), so the check costs nothing at run time.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

# Stack of the in-site axes of the steps being traced with sharded parameters.
_ACTIVE: list[tuple[str, ...]] = []

SHARDABLE_METHODS = ("allreduce", "identity / fp32", "cast / bf16 / fp16", "sign",
                     "ef(...) of these", "dad / auto_dad / rank_dad (layers see whole kernels)")


@contextlib.contextmanager
def sharded_parameters(axes: tuple[str, ...]) -> Iterator[None]:
  """Within this context, gradients and parameters are slices over ``axes``."""
  _ACTIVE.append(tuple(axes))
  try:
    yield
  finally:
    _ACTIVE.pop()


def shard_axes() -> tuple[str, ...] | None:
  """The in-site axes parameters are sharded over, or ``None`` (whole tensors)."""
  return _ACTIVE[-1] if _ACTIVE else None


def require_whole_leaves(method: str) -> None:
  """Raise a ``ValueError`` naming ``method`` if parameters are sharded now.

  Args:
    method: the method's name as the user spelled it (e.g. ``"topk"``).
  """
  if _ACTIVE:
    raise ValueError(
        f"{method} needs each parameter's whole tensor, but make_train_step(shard_params=True) "
        f"gives every device of a site a slice of it over {_ACTIVE[-1]}; use shard_params="
        f"False for {method}. Methods that support sharded parameters: "
        f"{', '.join(SHARDABLE_METHODS)}")


__all__ = ["SHARDABLE_METHODS", "require_whole_leaves", "shard_axes", "sharded_parameters"]
