"""A stable import path: :class:`Config` of the run layer (:mod:`dadjax.run`)."""

from dadjax.run import Config, load_config, parse_lr_schedule, validate

__all__ = ["Config", "load_config", "validate", "parse_lr_schedule"]
