"""A stable import path: the batch-stage protocol (:mod:`dadjax._core.protocols`, public in
:mod:`dadjax.extend`)."""

from dadjax._core.protocols import BatchStage, GradResult, StageContext, StageOutput

__all__ = ["BatchStage", "GradResult", "StageContext", "StageOutput"]
