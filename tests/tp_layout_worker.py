"""One train step with tensor-parallel kernels: ``python tp_layout_worker.py SPEC LAYOUT``.

The reduced case of an abort inside XLA's SPMD partitioner (``Check failed:
partition_group_list.num_replica_groups() * ... == device_groups.num_devices_per_group()`` in
PartitionGather, the whole process gone with SIGABRT): a 2 x 4 ("data", "model") mesh of CPU
devices, an MLP whose kernels are split over "model" (LAYOUT "col": their output dimension,
"row": their input dimension), and QSGD, whose 6-bit codes were packed with a static gather
over the flattened leaf. The test (tests/test_pod.py) runs it in a child process because an
abort cannot be caught; it prints ``OK <loss>``.
"""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import dadjax  # noqa: E402
from dadjax import models  # noqa: E402


def main(spec: str, layout: str) -> None:
  method = dadjax.build_method(spec, axis_name="data", seed=0)
  mesh = dadjax.make_mesh(sites=2, inner={"model": 4})
  dense = {"dense": method.dense} if method.dense is not None else {}
  model = models.get_model("mlp", 10, hidden=(64, 96), **dense)
  split = P(None, "model") if layout == "col" else P("model", None)
  specs = lambda params: jax.tree.map(lambda p: split if np.ndim(p) == 2 and p.shape[0] % 4 == 0
                                      and p.shape[1] % 4 == 0 else P(), params)
  step = dadjax.make_train_step(model, method.optimizer(optax.adam(1e-3)), mesh=mesh,
                                param_specs=specs)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 40)).astype(np.float32)
  state = step.init(jax.random.key(0), x[:8])
  state, metrics = step(state, {"x": x, "y": np.arange(16) % 10})
  print("OK", float(np.mean(np.asarray(metrics["loss"]))))


if __name__ == "__main__":
  main(*sys.argv[1:3])
