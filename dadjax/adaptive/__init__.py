"""Adaptive communication: Accordion's critical-regime detector and switches.

* :func:`accordion`: per tensor, a low- or high-compression setting of any
  compressor, chosen by the detector.
* :func:`accordion_batch`: the detector on the whole-model norm switches the
  global batch size (gradient accumulation with a traced number of steps).
* the detector itself (:func:`detector_init`, :func:`detector_update`,
  :func:`is_critical`), and host helpers for metrics rows and a heat map.
"""

from dadjax.adaptive._accordion import (
    AccordionState,
    accordion,
    accordion_row,
    find_accordion_state,
    tensor_names,
)
from dadjax.adaptive._batch import AccordionBatchState, accordion_batch, batch_row
from dadjax.adaptive._detector import (
    DetectorState,
    detector_init,
    detector_lr_decrease,
    detector_update,
    norm_bits,
)
from dadjax._core.critical import is_critical, lr_decreased
from dadjax.adaptive._plot import decision_matrix, plot_decisions
from dadjax.adaptive import _methods  # registers the accordion(...) spec  # noqa: F401

__all__ = [
    "accordion",
    "AccordionState",
    "accordion_batch",
    "AccordionBatchState",
    "accordion_row",
    "batch_row",
    "find_accordion_state",
    "tensor_names",
    "DetectorState",
    "detector_init",
    "detector_update",
    "detector_lr_decrease",
    "is_critical",
    "lr_decreased",
    "norm_bits",
    "decision_matrix",
    "plot_decisions",
]
