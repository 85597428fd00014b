#!/usr/bin/env bash
# The project's GPU check, run ON a GPU machine in a few minutes (see README "GPU check"):
#   1. nvidia-smi and versions;  2. the GPU-marked tests;
#   3. the benchmark: ViT-B/16 at 224 (config built locally, random weights), bf16, dali vs
#      baseline vs synthetic, under `taskset -c 0-3` to stand in for a 4-vCPU g4dn.xlarge.
# Writes everything under OUT (default ./gpu-check): versions.txt, gpu-tests.txt,
# benchmark.json, benchmark.png, benchmark.txt.
#
#   usage: tools/gpu_check.sh [OUT] [STEPS]
set -uo pipefail
OUT=${1:-gpu-check}
STEPS=${2:-80}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

{ nvidia-smi; echo; $PY - <<'PYEOF'
import platform, torch, pytorch_lightning, transformers
import nvidia.dali as dali
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| dali", dali.__version__, "| lightning", pytorch_lightning.__version__, "| transformers", transformers.__version__)
print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
PYEOF
} 2>&1 | tee "$OUT/versions.txt"

echo "== GPU-marked tests"
taskset -c 0-3 $PY -m pytest -q -s -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu-tests.txt"
tests_rc=${PIPESTATUS[0]}

echo "== benchmark data: ImageNet-size real photos (~500 px)"
DATA=${BENCH_DATA:-/tmp/dali_pipe_bench500}
$PY -c "from dali_pipe.demo import make_photo_dataset as m; m('$DATA', classes=7, per_class=96, side=(400, 600))"

echo "== benchmark: ViT-B/16 bf16, 4 cores, dali vs baseline vs synthetic"
taskset -c 0-3 $PY train.py --benchmark --data "$DATA" --model vit-b16-random --precision bf16-mixed \
  --device gpu --batch-size 128 --steps "$STEPS" --warmup 20 --cpus 4 --loaders dali,baseline,synthetic \
  --scan off --cache-dir /tmp/dali_pipe_cache --output "$OUT" 2>&1 | tee "$OUT/benchmark.txt"
bench_rc=${PIPESTATUS[0]}
echo "gpu tests rc=$tests_rc benchmark rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
