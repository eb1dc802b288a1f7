"""One process of the 2-process test: 4 CPU devices each, gloo collectives.

Usage: python multihost_worker.py PORT PROCESS_ID OUT.npz [flat|sites|sharded|train CKPT STEPS]
Trains the test model for a few steps over all 8 global devices and writes
the parameters (from process 0) to OUT.npz. ``flat``: a 1-D mesh of 8 sites;
``sites``: a 2-D mesh where each process is one site of its 4 devices;
``sharded``: the same with each site's parameters sharded over its devices;
``train``: ``dadjax.train.train`` of :data:`TRAIN_CONFIG` for STEPS steps
with checkpoints in CKPT (resuming from them when present).
"""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import dadjax  # noqa: E402
from multihost_common import STEPS, make_problem  # noqa: E402


def train_run(process_id, out, checkpoint_dir, steps):
  from dadjax.config import Config  # pylint: disable=g-import-not-at-top
  from dadjax.train import train  # pylint: disable=g-import-not-at-top
  from multihost_common import TRAIN_CONFIG  # pylint: disable=g-import-not-at-top
  run = train(Config(**TRAIN_CONFIG, steps=steps, checkpoint_dir=checkpoint_dir), progress=False)
  if process_id == 0:
    np.savez(out, **{f"p{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(run.params))})


def main():
  port, process_id, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
  layout = sys.argv[4] if len(sys.argv) > 4 else "flat"
  dadjax.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  if layout == "train":
    train_run(process_id, out, sys.argv[5], int(sys.argv[6]))
    jax.distributed.shutdown()
    return
  model, tx, batches = make_problem()
  if layout in ("sites", "sharded"):  # one site per process: its 4 local devices
    mesh = dadjax.make_mesh(sites=2, per_site=4)
    assert {d.process_index for d in mesh.devices[process_id]} == {process_id}
  else:
    mesh = None  # a 1-D mesh over all 8 global devices
  ts = dadjax.make_train_step(model, tx, mesh=mesh, shard_params=layout == "sharded")
  state = ts.init(jax.random.key(0), batches[0]["x"][:2])
  for batch in batches[:STEPS]:
    state, _ = ts(state, batch)
  params = ts.params(state)
  summary = dadjax.comm_stats(state.opt_state)
  # how much of the largest parameter one device holds (FSDP splits it within the site)
  largest = max(jax.tree.leaves(state.params), key=lambda x: x.size)
  held = largest.addressable_shards[0].data.size / (largest.size // largest.shape[0])
  if process_id == 0:
    leaves = {f"p{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(params))}
    np.savez(out, total_bits=summary.total, held=held, **leaves)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
