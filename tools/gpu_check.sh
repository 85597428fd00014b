#!/usr/bin/env bash
# The GPU check, run ON a GPU machine in a few minutes:
#   1. nvidia-smi and versions, and whether they are the locked ones (requirements.lock);
#   2. the GPU-marked tests (mixed decode vs PIL, outputs on the GPU, 16-mixed and bf16 training,
#      no host sync inside steps, ViT-B/16 memory budget);
#   3. the benchmark: ViT-B/16 at 224 (config built locally, random weights), dali vs baseline vs
#      synthetic, --precision auto and forced 16-mixed (the T4 path), under `taskset -c 0-3` to stand in
#      for a 4-vCPU g4dn.xlarge;
#   4. one summary table.
# Writes under OUT (default ./gpu-check): versions.txt, gpu-tests.txt, benchmark.{json,png,txt},
# benchmark-16mixed.json, summary.md. Exits non-zero when any step failed.
#
#   usage: tools/gpu_check.sh [OUT] [STEPS]
set -uo pipefail
mkdir -p "${1:-gpu-check}"
OUT=$(cd "${1:-gpu-check}" && pwd)
STEPS=${2:-60}
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
failed=()

{ nvidia-smi; echo; "$PY" - <<'PYEOF'
import platform, re, torch, pytorch_lightning, transformers
import nvidia.dali as dali
from importlib import metadata
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| dali", dali.__version__, "| lightning", pytorch_lightning.__version__, "| transformers", transformers.__version__)
print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
pins = dict(l.split("==") for l in open("requirements.lock").read().splitlines() if "==" in l and not l.startswith("#"))
off = [f"{n} {metadata.version(n)} (lock {v})" for n, v in pins.items()
       if n in ("torch", "nvidia-dali-cuda120", "pytorch-lightning", "transformers")
       and metadata.version(n).split("+")[0] != v]
print("stack: the locked versions" if not off else "stack differs from requirements.lock: " + ", ".join(off))
PYEOF
} 2>&1 | tee "$OUT/versions.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("versions")

echo "== GPU-marked tests"
taskset -c 0-3 "$PY" -m pytest -q -s -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("gpu tests")

echo "== benchmark data: ImageNet-size real photos (~500 px)"
DATA=${BENCH_DATA:-/tmp/dali_pipe_bench500}
"$PY" -c "from dali_pipe.demo import make_photo_dataset as m; m('$DATA', classes=7, per_class=96, side=(400, 600))" \
  || failed+=("benchmark data")

bench() {  # bench PRECISION LOADERS OUTDIR
  taskset -c 0-3 "$PY" train.py --benchmark --data "$DATA" --model vit-b16-random --precision "$1" \
    --device gpu --batch-size 128 --steps "$STEPS" --warmup 15 --cpus 4 --loaders "$2" --repeat 2 \
    --val-fraction 0 --scan off --cache-dir /tmp/dali_pipe_cache --output "$3"
}
echo "== benchmark: ViT-B/16, --precision auto, 4 cores, dali vs baseline vs synthetic"
bench auto dali,baseline,synthetic "$OUT" 2>&1 | tee "$OUT/benchmark.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("benchmark auto")
echo "== benchmark: ViT-B/16, 16-mixed (the T4 path: GradScaler, fused AdamW), dali vs synthetic"
bench 16-mixed dali,synthetic "$OUT/16mixed" 2>&1 | tail -n 12
[ "${PIPESTATUS[0]}" -eq 0 ] && mv "$OUT/16mixed/benchmark.json" "$OUT/benchmark-16mixed.json" || failed+=("benchmark 16-mixed")
rm -rf "$OUT/16mixed"

"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/summary.md"
import json, os, sys, time
out = sys.argv[1]
rows, env = [], {}
for name in ("benchmark.json", "benchmark-16mixed.json"):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        continue
    r = json.load(open(path))
    for loader, m in r["loaders"].items():
        s = m["images_per_sec_rounds"]
        rows.append(f"| {r['config']['precision']} | {loader} | {s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f}) | "
                    f"{m['data_wait_fraction']:.1%} | {m['gpu_util_mean'] or 0:.0f} | {m['gpu_util_p5'] or 0:.0f} | "
                    f"{m['cpu_util_mean']:.0f} |")
    env = r["env"]
print(f"GPU check {time.strftime('%Y-%m-%d')}, {env.get('gpu')}, {env.get('cpus')} cores, ViT-B/16 batch 128:")
print("| precision | loader | images/s median (min-max) | data-wait | GPU % mean | GPU % p5 | CPU % |")
print("|---|---|---|---|---|---|---|")
print("\n".join(rows))
for name in ("benchmark.json", "benchmark-16mixed.json"):
    path = os.path.join(out, name)
    if os.path.exists(path):
        for k, v in json.load(open(path))["ratios"].items():
            print(f"- {name}: {k} {v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})")
PYEOF

if [ "${#failed[@]}" -gt 0 ]; then echo "GPU check: FAILED: ${failed[*]}"; exit 1; fi
echo "GPU check: all steps passed"
