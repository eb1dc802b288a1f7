#!/usr/bin/env bash
# The real-workload comparisons at accelerator sizes, for a machine with one GPU, JAX
# preinstalled and no package registry. Writes its tables under ${OUT:-experiments/results/device}.
#
#   experiments/device_run.sh prepare   # on a machine with the Debian packages (`make data`):
#                                       # copy Fashion-MNIST (30 MB) and the Python docs (11 MB)
#                                       # into data/ (git-ignored), to carry with the working tree
#   experiments/device_run.sh [PART]    # on the accelerator: PART's runs, each part within
#                                       # 10 minutes (PART: gpt, the default; earlier; all)
#   experiments/device_run.sh --tiny [PART]   # the same runs on the CPU at tiny sizes (a smoke
#                                       # test: gpt_tiny, the small transformer and ResNet)
#
# Part gpt (one seed, 8 sites simulated with vmap on the one device, non-IID by file):
#   0. experiments/local.py on gpt_125m's blocks (12 x 768, byte vocabulary: 85M parameters,
#      256-byte context, bf16 compute, AdamW 6e-4), 150 steps: fp32 / bf16 all-reduce, PowerSGD
#      r=4, EF-TopK 1%, exact dAD, rank-dAD r=4, DiLoCo H=10 / 50 with an fp32 outer step and
#      DiLoCo H=10 with a 4-bit QSGD outer step, in that order. Expected on one H200 (estimated,
#      not yet measured: no accelerator has run it): under a minute per method, compilation
#      included; the part's timeout (570 s) ends it within 10 minutes, and local.py writes its
#      table after every run, so what finished is kept.
# Part earlier (one seed, IID, 8 sites simulated with vmap on the one device; ~9.5 minutes):
#   1. experiments/dad.py on the transformer LM at d_model 512 (4 layers, 128-byte context):
#      fp32 / bf16 all-reduce, exact dAD, rank-dAD r=4 one- and two-way, PowerSGD r=4, TopK 1% + EF;
#   2. experiments/dataquant.py on ResNet-18 (width 64) on Fashion-MNIST padded to 32x32:
#      all-reduce, PowerSGD r=2, rank-dAD r=2, data quantization b=2;
#   3. experiments/scaling.py on the same ResNet-18: where each method stops paying against a
#      bf16 all-reduce, from this device's measured compute time.
# Each run has its own timeout, so a part ends within 10 minutes even if one hangs.
set -uo pipefail
cd "$(dirname "$0")/.."
data="${DATA:-data}"
if [ "${1:-}" = prepare ]; then
  mkdir -p "$data/fashion-mnist" "$data/python-docs"
  cp /usr/share/datasets/fashion-mnist/*-ubyte.gz "$data/fashion-mnist/" || {
    echo "Fashion-MNIST missing: apt-get install -y dataset-fashion-mnist (or make data)"; exit 1; }
  cp -r /usr/share/doc/python3.11/html/_sources/. "$data/python-docs/" || {
    echo "Python docs missing: apt-get install -y python3.11-doc (or make data)"; exit 1; }
  du -sh "$data"
  exit 0
fi
quick=""
limit=(240 200 100 570)
steps_lm="${STEPS_LM:-200}"
steps_resnet="${STEPS_RESNET:-200}"
every=50
if [ "${1:-}" = --tiny ]; then
  quick="--quick"
  limit=(600 600 600 900)
  steps_lm=4
  steps_resnet=4
  every=2
  export JAX_PLATFORMS=cpu
  shift
fi
part="${1:-gpt}"
case "$part" in
  gpt|earlier|all) ;;
  *) echo "device_run.sh: PART must be gpt, earlier or all, got '$part'"; exit 2 ;;
esac
out="${OUT:-experiments/results/device}"
mkdir -p "$out"
export DADJAX_FASHION_MNIST="${DADJAX_FASHION_MNIST:-$PWD/$data/fashion-mnist}"
export DADJAX_TEXT_GLOB="${DADJAX_TEXT_GLOB:-$PWD/$data/python-docs/**/*.txt}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python}"
"$py" -c "import jax; print(jax.__version__, jax.devices())" | tee "$out/jax.txt"
start=$(date +%s)
if [ "$part" != earlier ]; then
  timeout "${limit[3]}" "$py" experiments/local.py --workload text_gpt_125m $quick --seeds 0 \
    --partition non_iid --out "$out" --name gpt_125m_device \
    --methods 'allreduce;bf16;powersgd:4;ef_topk:0.01;dad;rank_dad:4;diloco:10;diloco:50;diloco:10:compress=qsgd(7)' \
    2>&1 | tail -20 | tee "$out/gpt.txt"
  echo "device_run gpt: $(( $(date +%s) - start )) s" | tee "$out/time_gpt.txt"
fi
if [ "$part" = gpt ]; then
  exit 0
fi
start=$(date +%s)
timeout "${limit[0]}" "$py" experiments/dad.py --workload text_lm_512 $quick --seeds 0 \
  --partitions iid --steps "$steps_lm" --out "$out" --name dad_device \
  --methods allreduce,bf16,dad,rank_dad:4,rank_dad:4:two_way,powersgd:4,ef_topk:0.01 \
  2>&1 | tail -40 | tee "$out/dad.txt"
timeout "${limit[1]}" "$py" experiments/dataquant.py --workload fashion_resnet18 $quick \
  --seeds 0 --steps "$steps_resnet" --eval-every "$every" --target 0.8 --widths none \
  --methods allreduce,powersgd:2,rank_dad:2,dataquant:2:classes=10 --out "$out" \
  --name dataquant_device 2>&1 | tail -30 | tee "$out/dataquant.txt"
timeout "${limit[2]}" "$py" experiments/scaling.py --workload fashion_resnet18 $quick --steps 3 \
  --methods allreduce,bf16,powersgd:2,ef_topk:0.01,rank_dad:2 --out "$out" \
  --name scaling_device 2>&1 | tail -20 | tee "$out/scaling.txt"
echo "device_run: $(( $(date +%s) - start )) s" | tee "$out/time.txt"
