"""Local updates: local SGD, DiLoCo and Streaming DiLoCo, with compressed outer gradients.

Sites take ``H`` inner optimizer steps on their own copy of the
parameters, then average their *pseudo-gradient* (the change since the
last synchronization) through an fp32 all-reduce or any dadjax compressor,
and an outer optimizer applies it to the synchronized (anchor) parameters:

* :func:`local_sgd`: parameter averaging every ``H`` steps;
* :func:`diloco`: an outer optimizer (SGD with Nesterov momentum) on the
  averaged pseudo-gradient, which may be compressed (``"qsgd:4"``);
* :func:`streaming_diloco`: the same in staggered fragments, each merged
  ``delay`` steps after it was sent (:func:`sync_plan`).

Each is an optax transformation that wraps the local optimizer and plugs
into :func:`~dadjax.make_train_step` alone (it communicates itself); its
state is a :class:`LocalState` whose ledger is a
:class:`~dadjax.comm.PeriodicStats`. Specs: ``local_sgd:H``,
``diloco:H[:outer_lr=..][:compress=SPEC]``,
``streaming_diloco:H:fragments=P:delay=TAU[:compress=SPEC]``.
"""

from dadjax.local._periodic import (
    LocalState,
    SyncPlan,
    default_outer,
    diloco,
    local_sgd,
    local_updates,
    streaming_diloco,
    sync_plan,
)
from dadjax.local import _methods  # registers the specs  # noqa: F401

__all__ = [
    "local_sgd",
    "diloco",
    "streaming_diloco",
    "local_updates",
    "default_outer",
    "LocalState",
    "SyncPlan",
    "sync_plan",
]
