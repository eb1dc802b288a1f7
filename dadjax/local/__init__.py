"""Local updates: local SGD, DiLoCo and Streaming DiLoCo, with compressed outer gradients.

Sites take ``H`` inner optimizer steps on their own copy of the
parameters, then average their *pseudo-gradient* (the change since the
last synchronization) through an fp32 all-reduce or any dadjax compressor,
and an outer optimizer applies it to the synchronized (anchor) parameters:

* :func:`local_sgd`: parameter averaging every ``H`` steps;
* :func:`diloco`: an outer optimizer (SGD with Nesterov momentum) on the
  averaged pseudo-gradient, which may be compressed (``"qsgd:4"``);
* :func:`streaming_diloco`: the same in staggered fragments, each merged
  ``delay`` steps after it was sent (:func:`sync_plan`);
* :func:`sparseloco`: top-k per block of a decaying error-feedback memory,
  2-bit values, plain outer SGD (the memory replaces the outer momentum);
* :func:`demo`: per-site momentum whose top-k DCT components per block are
  shared and removed, sign-SGD on their mean.

Every one of them is :func:`local_updates` with its own pair of steps: a
:class:`Communicate` (:func:`averaging`: fp32, a compressor, or a decaying
error-feedback memory) and a :class:`Merge` (:func:`outer_step`: an outer
optimizer, with a local weight ``alpha``). A new variant is a new pair,
built from these or from functions that call the module-level steps
(:func:`pseudo_gradient`, :func:`exchange_mean`, :func:`outer_merge`).

Each is an optax transformation that wraps the local optimizer and plugs
into :func:`~dadjax.make_train_step` alone (it communicates itself); its
state is a :class:`LocalState` whose ledger is a
:class:`~dadjax.comm.PeriodicStats`. Specs: ``local_sgd:H``,
``diloco:H[:outer_lr=..][:compress=SPEC]``,
``streaming_diloco:H:fragments=P:delay=TAU[:compress=SPEC]``, ``sparseloco:H``,
``demo[:H]``.
"""

from dadjax.local._chunked import ChunkedPayload, chunked_topk
from dadjax.local._dct import ChunkLayout, chunk_layout, dct_matrix, from_chunks, to_chunks
from dadjax.local._frontier import demo, demo_outer, sparseloco
from dadjax.local._diloco import diloco, local_sgd, streaming_diloco
from dadjax.local._periodic import LocalState, local_updates
from dadjax.local._plan import SyncPlan, check_schedule, leaves_of, put_leaves, sync_plan
from dadjax.local._steps import (Communicate, Exchange, Merge, Outer, averaging, default_outer,
                                 exchange_init, exchange_mean, outer_init, outer_merge, outer_step,
                                 pseudo_gradient)
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
    "check_schedule",
    "leaves_of",
    "put_leaves",
    "sparseloco",
    "demo",
    "demo_outer",
    "chunked_topk",
    "ChunkedPayload",
    "ChunkLayout",
    "chunk_layout",
    "to_chunks",
    "from_chunks",
    "dct_matrix",
    "Communicate",
    "Merge",
    "Exchange",
    "Outer",
    "averaging",
    "exchange_init",
    "exchange_mean",
    "outer_step",
    "outer_init",
    "outer_merge",
    "pseudo_gradient",
]
