#!/usr/bin/env bash
# One prepared run for a machine with an accelerator (e.g. one H200 with the
# JAX it ships). Writes everything under ${OUT:-experiments/results/device}.
#   1. dAD and compressor tests on that machine's JAX (CPU devices, as in CI),
#      which checks the invariant all-gather helper on a newer JAX;
#   2. the compressor step-time benchmark on the accelerator (ResNet-18,
#      batch 128, one site): the <= 1.10x targets of PowerSGD r4 and TopK 1%.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-experiments/results/device}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import jax; print(jax.__version__, jax.devices())" | tee "$out/jax.txt"
JAX_PLATFORMS=cpu timeout 240 python -m pytest -q -x -p no:cacheprovider \
  tests/test_dad.py tests/test_compress_hlo.py 2>&1 | tail -15 | tee "$out/tests.txt"
timeout 300 python experiments/bench_compressors.py --steps 20 \
  --methods topk:0.01,ef_topk:0.01,powersgd:1,powersgd:4,qsgd:16,sign \
  --markdown "$out/bench_compressors_gpu.md" 2>&1 | tail -30 | tee "$out/bench.txt"
