"""One process of the 2-process fault tests: 4 CPU devices each (``FAULTS_DEVICES``), gloo.

Usage: python faults_multihost_worker.py PORT PROCESS_ID OUT.npz CKPT STEPS SLOW_S [key=value...]
Trains :data:`multihost_common.TRAIN_CONFIG` (plus the overrides) for STEPS
steps through ``dadjax.train.train`` with checkpoints in CKPT, printing each
metrics row (``row STEP``) after sleeping SLOW_S seconds (time for a test to
act between steps); process 0 writes the final parameters to OUT.npz. A
``dadjax.errors.Stopped`` ends the process with its exit code and message.
``fail_at=N`` (not a config field) makes process ``fails`` (another one, default
1) raise a ``RuntimeError`` right after it logged step N. ``transport_error=N`` makes
process 0's finite check (``train._check_finite`` -> ``host_array``) after it
logged step N raise the ``JaxRuntimeError`` gloo raises there when its peer is
gone ("Gloo AllGather failed: ... Connection closed by peer"): the timing in
which a survivor's collective fails before its peer watch has concluded (the
test kills process 1 when it sees row N).
"""
import os
import sys
import time

# 4 CPU devices a process unless the test says otherwise (FAULTS_DEVICES).
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count="
                           + os.environ.get("FAULTS_DEVICES", "4"))
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import dadjax  # noqa: E402
from dadjax.run._config import Config, _parse_value  # noqa: E402
from dadjax.errors import DadjaxError, Stopped  # noqa: E402
from dadjax.train import train  # noqa: E402
from multihost_common import TRAIN_CONFIG  # noqa: E402


def main():
  port, process_id, out, ckpt, steps, slow = sys.argv[1:7]
  process_id, slow = int(process_id), float(slow)
  dadjax.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id))
  overrides = dict(item.split("=", 1) for item in sys.argv[7:])
  fail_at = int(overrides.pop("fail_at", -1))  # process FAILS raises after logging this step
  fails = int(overrides.pop("fails", 1))
  transport_error = int(overrides.pop("transport_error", -1))
  armed = []  # process 0 logged step transport_error
  if transport_error >= 0 and process_id == 0:
    import dadjax.run._loop as train_module  # pylint: disable=g-import-not-at-top
    host_array = train_module.host_array

    def failing_host_array(x):
      if armed:
        print("injected: Gloo AllGather failed", file=sys.stderr, flush=True)
        raise jax.errors.JaxRuntimeError(
            "INTERNAL: Gloo AllGather failed: [gloo/transport/tcp/pair.cc:547] Connection "
            "closed by peer [127.0.0.1]:1")
      return host_array(x)

    train_module.host_array = failing_host_array
  config = Config(**TRAIN_CONFIG, steps=int(steps), checkpoint_dir=ckpt).replace(
      **{k: _parse_value(k, v) for k, v in overrides.items()})

  def log(row):
    time.sleep(slow)
    print(f"row {row['step']}", flush=True)
    if row["step"] == transport_error:
      armed.append(True)
    if process_id == fails and row["step"] == fail_at:
      raise RuntimeError(f"injected failure after step {fail_at}")

  try:
    run = train(config, progress=False, log=log)
  except Stopped as e:
    print(f"dadjax: {e}", file=sys.stderr, flush=True)
    jax.distributed.shutdown()
    sys.exit(e.exit_code)
  except DadjaxError as e:
    print(f"dadjax: error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  if process_id == 0:
    np.savez(out, **{f"p{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(run.params))})
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
