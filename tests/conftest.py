"""Test set-up: eight simulated CPU devices, set before jax is imported."""
import os

# The tests check behaviour, not speed: XLA's CPU backend compiles without LLVM's expensive
# passes (about half the compile time, which dominates most tests; XLA's HLO passes, and so the
# compiled collectives the ledger tests read, are unchanged). DADJAX_TEST_XLA_OPT=1 keeps the
# default optimization.
_FAST_COMPILE = ("" if os.environ.get("DADJAX_TEST_XLA_OPT") == "1" else
                 " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8" + _FAST_COMPILE
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402  (after the flags: nothing here starts JAX's backend)


@pytest.fixture
def tiny_mlp():
  """The usual model: ``models.MLP(hidden=(8,), num_classes=3)`` (:func:`helpers.mlp`)."""
  import helpers  # pylint: disable=g-import-not-at-top  (imports jax: after the flags)
  return helpers.mlp()


@pytest.fixture
def tiny_batch():
  """The usual data: 16 rows of 6 features, 3 classes, seed 0 (:func:`helpers.batch`)."""
  import helpers  # pylint: disable=g-import-not-at-top
  return helpers.batch(16)


@pytest.fixture
def tiny_step(tiny_mlp):
  """The usual step: the tiny MLP, fp32 all-reduce + SGD 0.1 with momentum, 4 sites under
  ``vmap`` (:func:`helpers.run_steps` runs it)."""
  import dadjax  # pylint: disable=g-import-not-at-top
  import helpers  # pylint: disable=g-import-not-at-top
  return dadjax.make_train_step(tiny_mlp, helpers.sgd_allreduce(), num_sites=4, backend="vmap")
