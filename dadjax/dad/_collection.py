"""The ``"dad_state"`` collection's rule, registered for every train step on import.

dAD layers keep their state (warm starts, error-feedback memories, Accordion
decisions) in ``"dad_state"``: the train step differentiates its float
leaves, and :func:`~dadjax.dad.next_state` turns the old state and its
cotangent into the new one (the step counter advances; layers that got no
cotangent keep their state). Rank-dAD layers under Accordion report their
decisions through the rule's ``metrics_row`` (:func:`~dadjax.dad.accordion_rows`).
"""

from __future__ import annotations

from dadjax._core.protocols import CollectionRule, register_rule
from dadjax.comm import STATE_COLLECTION
from dadjax.dad._state import next_state
from dadjax.dad._sync import accordion_rows

DAD_STATE_RULE = register_rule(STATE_COLLECTION, CollectionRule(
    differentiate=True, update=next_state, metrics_row=accordion_rows))
