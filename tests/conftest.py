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
