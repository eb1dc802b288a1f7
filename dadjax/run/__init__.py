"""The run layer: a training run from a configuration, on top of the library.

:func:`train` runs a :class:`Config` (data, model, method, placement,
schedule, checkpoints) to the end or to a stop, writing metrics rows and
orbax checkpoints; :func:`build` gives its step, state and data without
running. The command line (``dadjax``: :func:`main`) and the demo
(:func:`run_demo`) sit on top of it. Modules:

* ``_config``: :class:`Config`, its validation, TOML / JSON files;
* ``_loop``: :func:`train`, :func:`build`, :func:`evaluate`, the optimizer
  and schedule by name;
* ``_checkpoint``: :class:`CheckpointDir` (orbax, fingerprints, locks);
* ``_signals`` / ``_peers``: stopping on a signal, a lost peer process;
* ``_metrics_file``: the metrics file (JSON lines);
* ``_optim``: optimizer and schedule specs (``adam(b1=0.9)``);
* ``_targets``: :func:`to_target`, steps, bits and time to a target metric;
* ``_elastic``: :func:`train_site`, one site of an elastic run from a config
  (``dadjax train --lighthouse HOST:PORT --site I``);
* ``_cli`` / ``_demo``: the command line and the demo table.

``dadjax.train``, ``dadjax.config`` and ``dadjax.cli`` stay importable as
stable paths to the same names.
"""

from dadjax.run._checkpoint import (FINGERPRINT_EXCLUDED, CheckpointDir, fingerprint,
                                    state_digest, truncate_metrics)
from dadjax.run._cli import describe_methods, main
from dadjax.run._config import Config, load_config, parse_lr_schedule, validate
from dadjax.run._elastic import ELASTIC_METHODS, elastic_method, train_site
from dadjax.run._demo import DEFAULT_METHODS, format_table, run_demo
from dadjax.run._loop import (Run, build, build_step, compiled_ops, evaluate, local_optimizer, make_optimizer,
                              make_schedule, method_and_model, network_model, state_rows, train)
from dadjax.run._metrics_file import MetricsFile, json_row
from dadjax.run._targets import Reached, higher_is_better, to_target

__all__ = [
    "train", "train_site", "elastic_method", "ELASTIC_METHODS", "build", "build_step", "method_and_model", "evaluate", "Run", "state_rows", "compiled_ops", "network_model",
    "make_optimizer", "local_optimizer", "make_schedule",
    "Config", "load_config", "validate", "parse_lr_schedule",
    "CheckpointDir", "fingerprint", "state_digest", "truncate_metrics", "FINGERPRINT_EXCLUDED",
    "MetricsFile", "json_row",
    "to_target", "Reached", "higher_is_better",
    "main", "describe_methods", "run_demo", "DEFAULT_METHODS", "format_table",
]
