#!/usr/bin/env bash
# The GPU check, run ON a GPU machine in a few minutes, with the image's stack (the locked versions and
# the image's torch build, e.g. inside the image):
#   1. nvidia-smi and versions, and whether they are the locked ones (requirements.lock); torch's CUDA is
#      the image's (Dockerfile: torch==...+cu126 -> 12.6), its kernels include sm_75 (the T4), and DALI and
#      torch share the GPU in one process (a DALI GPU decode handed to torch, checked against DALI's CPU
#      decode of the same JPEG);
#   2. the GPU-marked tests (mixed decode vs PIL, outputs on the GPU, 16-mixed and bf16 training,
#      no host sync inside steps, ViT-B/16 memory budget);
#   3. the benchmark: ViT-B/16 at 224 (config built locally, random weights), dali vs baseline vs
#      synthetic, --precision auto and forced 16-mixed (the T4 path), under `taskset -c 0-3` to stand in
#      for a 4-vCPU g4dn.xlarge;
#   4. T4-like decoding: the hardware JPEG decoder off (--hw-decoder-load 0: the T4 has none, and an A100's
#      or H100's would hide the host-side Huffman decoding a T4 pays on 4 vCPUs) on 4 cores, loaders alone,
#      --hybrid-huffman-threshold at DALI's default (ImageNet-size photos: Huffman on the CPU) and at 0 (all
#      on the GPU), alternating, 2 rounds each;
#   5. one summary table.
# Writes under OUT (default ./gpu-check): versions.txt, gpu-tests.txt, benchmark.{json,png,txt},
# benchmark-16mixed.json, t4like-{default,0}-{1,2}.json, summary.md. Exits non-zero when any step failed.
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
import platform, re, sys, torch, pytorch_lightning, transformers
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
problems = list(off)
build = re.search(r'"torch==[0-9.]+\+cu(\d+)(\d)"', open("Dockerfile").read())
want = f"{build.group(1)}.{build.group(2)}"
if torch.version.cuda != want:
    problems.append(f"torch is the CUDA {torch.version.cuda} build; the image's is {want} (Dockerfile)")
arch = torch.cuda.get_arch_list()
print("torch kernels:", " ".join(arch))
if "sm_75" not in arch:
    problems.append("torch has no sm_75 kernels: it would not run on a T4")
# DALI and torch on one GPU in one process: torch holds memory, DALI decodes on the GPU, torch reads it
import numpy as np
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import feed_ndarray
from dali_pipe.demo import make_photo_dataset
import tempfile, pathlib
root = make_photo_dataset(pathlib.Path(tempfile.mkdtemp()), classes=2, per_class=1)
jpeg = str(sorted(root.rglob("*.jpg"))[0])
held = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB that torch keeps
@pipeline_def(batch_size=1, num_threads=1, device_id=0)
def decode(device):
    data, _ = fn.readers.file(files=[jpeg])
    return fn.decoders.image(data, device=device, output_type=types.RGB)
gpu_pipe, cpu_pipe = decode("mixed"), decode("cpu")
gpu_pipe.build(); cpu_pipe.build()
out = gpu_pipe.run()[0].as_tensor()
img = torch.empty(out.shape(), dtype=torch.uint8, device="cuda")
feed_ndarray(out, img, cuda_stream=torch.cuda.current_stream())
torch.cuda.synchronize()
ref = torch.from_numpy(np.array(cpu_pipe.run()[0].as_tensor()))
diff = (img.cpu().int() - ref.int()).abs().float().mean().item()
ok = held.sum().item() == held.numel() and img.shape == ref.shape and diff < 3
print(f"dali+torch in one process: GPU decode {tuple(img.shape)} read by torch, mean |GPU - CPU decode| {diff:.2f}:",
      "ok" if ok else "FAILED")
if not ok:
    problems.append("DALI's GPU decode, handed to torch in the same process, differs from its CPU decode")
print("checks: " + ("all passed" if not problems else "FAILED: " + "; ".join(problems)))
sys.exit(1 if problems else 0)
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

echo "== T4-like decoding: hardware JPEG decoder off, 4 cores, loaders alone, Huffman threshold default vs 0"
for round in 1 2; do
  for threshold in default 0; do
    extra=()
    [ "$threshold" = default ] || extra=(--hybrid-huffman-threshold "$threshold")
    taskset -c 0-3 "$PY" train.py --benchmark --data "$DATA" --model none --device gpu --batch-size 128 \
      --steps "$STEPS" --warmup 15 --cpus 4 --loaders dali --repeat 1 --val-fraction 0 --scan off \
      --hw-decoder-load 0 "${extra[@]}" --cache-dir /tmp/dali_pipe_cache --output "$OUT/t4like" 2>&1 | tail -n 4
    if [ "${PIPESTATUS[0]}" -eq 0 ]; then mv "$OUT/t4like/benchmark.json" "$OUT/t4like-$threshold-$round.json"
    else failed+=("T4-like threshold $threshold round $round"); fi
  done
done
rm -rf "$OUT/t4like"

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
t4 = {}
for threshold in ("default", "0"):
    for rnd in (1, 2):
        path = os.path.join(out, f"t4like-{threshold}-{rnd}.json")
        if os.path.exists(path):
            m = json.load(open(path))["loaders"]["dali"]
            t4.setdefault(threshold, []).append((m["images_per_sec_rounds"]["median"], m["cpu_util_mean"]))
if t4:
    print("\nT4-like decoding (--hw-decoder-load 0, 4 cores, loaders alone, batch 128; runs alternating):")
    print("| --hybrid-huffman-threshold | images/s per round | CPU % per round |")
    print("|---|---|---|")
    for threshold, runs in t4.items():
        print(f"| {threshold} | {', '.join(f'{r[0]:.0f}' for r in runs)} | {', '.join(f'{r[1]:.0f}' for r in runs)} |")
    if len(t4) == 2:
        a, b = (sorted(r[0] for r in t4[k]) for k in ("default", "0"))
        print(f"- threshold 0 / default: {b[len(b) // 2] / a[len(a) // 2]:.2f}x (rounds: "
              f"{', '.join(f'{y / x:.2f}' for x, y in zip([r[0] for r in t4['default']], [r[0] for r in t4['0']]))})")
PYEOF

if [ "${#failed[@]}" -gt 0 ]; then echo "GPU check: FAILED: ${failed[*]}"; exit 1; fi
echo "GPU check: all steps passed"
