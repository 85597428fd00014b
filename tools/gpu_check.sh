#!/usr/bin/env bash
# The GPU check: every open GPU question in one run of a few minutes, on any CUDA stack (the image's, or
# another DALI CUDA variant and torch CUDA build: the differences are reported, and the results then speak for
# that stack). Steps, in this order, each under a time limit cut to what is left of the whole check's budget
# (GPU_CHECK_BUDGET, default 480 s; the steps' own limits, sized from an H200's runs on 2026-12-04, add up to
# 470 s, so a step is cut only by its own overrun); a step that fails or runs out of time is reported and the
# next one runs:
#   1. versions: nvidia-smi, the stack against the image's (tools/gpu_probe.py versions), and DALI and torch
#      sharing the GPU in one process (a DALI GPU decode read by torch, against DALI's CPU decode);
#   2. data: 672 real photos at 400-600 px (ImageNet-size), and their pack;
#   3. the GPU-marked tests (nvJPEG against PIL and the CPU pipeline, outputs on the GPU, 16-mixed and bf16
#      training with and without clipping and no host sync in any step, the recipe on a pack, ViT-B/16's
#      memory budget), printing what they measure;
#   4. the probe (tools/gpu_probe.py probe): the training decode as an ROI decode and as a whole decode + GPU
#      crop (the nvJPEG < 13.2 path), each with libjpeg's chroma upsampling, and the ROI decode without it; with
#      and without the hardware JPEG decoder (a T4 has none) and with --hybrid-huffman-threshold 0; the
#      validation decode with and without the upsampling; the training decode from the pack (our shard reader);
#      the images nvImageCodec's GPU decoders refused (decoded on the CPU) in every run; with an older nvJPEG
#      in GPU_CHECK_OLD_NVJPEG (a folder with libnvjpeg.so.N; default .gpu-nvjpeg/ where present), the two
#      training decodes again under it, in a second process; ViT-B/16 steps from DALI and from synthetic data
#      under bf16-mixed and 16-mixed, with and without --clip-grad-norm, timed by CUDA events against the
#      host's next() on a loader with a length (as training's);
#   5. the recipe benchmark: ViT-B/16, 16-mixed (the T4 path: GradScaler, fused AdamW), --auto-augment rand,
#      mixup and cutmix, --clip-grad-norm 1.0, dali vs packed vs synthetic;
#   6. the benchmark: ViT-B/16 at 224, --precision auto, dali vs baseline vs synthetic;
#   7. the summary (tools/gpu_probe.py summary), which always runs.
# All under `taskset -c 0-3` (a 4-vCPU g4dn.xlarge's cores). Without a GPU the GPU steps are reported as not
# run and the check still ends in its summary. Writes under OUT (default ./gpu-check) 8 files: log.txt,
# versions.txt, gpu-tests.txt, probe.json, benchmark-recipe.json, benchmark.json, benchmark.png, summary.md.
# GPU_CHECK_SKIP (step names, comma-separated: "recipe benchmark,data") skips steps; GPU_CHECK_PROBE_PARTS (of
# decode,old,steps) picks the probe's parts. Exits 0 when every step passed (a skipped one counts as passed), 1
# otherwise (2: OUT cannot be written).
#
#   usage: tools/gpu_check.sh [OUT] [STEPS]          (STEPS: timed steps per benchmark run, default 20)
set -uo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,/^$/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
  -*) echo "error: unknown option $1 (usage: tools/gpu_check.sh [OUT] [STEPS]; --help says more)" >&2; exit 2 ;;
esac
mkdir -p "${1:-gpu-check}" || exit 2
OUT=$(cd "${1:-gpu-check}" && pwd) || exit 2
if ! : > "$OUT/log.txt"; then echo "error: cannot write to $OUT: pass another OUT" >&2; exit 2; fi
STEPS=${2:-20}
BUDGET=${GPU_CHECK_BUDGET:-480}
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX") || exit 1
trap 'rm -rf "$WORK"' EXIT
DATA=${BENCH_DATA:-/tmp/dali_pipe_bench500}
PACK=$WORK/pack
export DALI_PIPE_CACHE=${DALI_PIPE_CACHE:-/tmp/dali_pipe_cache}
START=$SECONDS
GPU=unknown

PIN=()
if command -v taskset >/dev/null; then
  n=$(nproc --all 2>/dev/null || echo 1)
  PIN=(taskset -c "0-$(( n < 4 ? n - 1 : 3 ))")
fi
LIMIT=()
command -v timeout >/dev/null && LIMIT=(timeout --kill-after=10)

record() {  # record NAME STATUS SECONDS
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$WORK/steps.tsv"
  echo "-- $1: $2 ($3 s)"
}

step() {  # step NAME LIMIT_S [--gpu] [--tee FILE] COMMAND...
  local name=$1 limit=$2 gpu=0 tee=/dev/null
  shift 2
  [ "${1:-}" = --gpu ] && { gpu=1; shift; }
  [ "${1:-}" = --tee ] && { tee=$2; shift 2; }
  local left=$((BUDGET - (SECONDS - START)))
  case ",${GPU_CHECK_SKIP:-}," in *",$name,"*) record "$name" "not run: skipped (GPU_CHECK_SKIP)" 0; return 0 ;; esac
  if [ "$gpu" = 1 ] && [ "$GPU" = none ]; then record "$name" "not run: no CUDA GPU visible" 0; return 0; fi
  if [ "$left" -lt 20 ]; then record "$name" "not run: the check's budget (${BUDGET} s) is spent" 0; return 0; fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name (at most ${limit} s; $((SECONDS - START)) s into the check)"
  local t0=$SECONDS rc
  if [ "${#LIMIT[@]}" -gt 0 ]; then "${LIMIT[@]}" "$limit" "$@" 2>&1 | tee "$tee"; rc=${PIPESTATUS[0]}
  else "$@" 2>&1 | tee "$tee"; rc=${PIPESTATUS[0]}; fi
  local status="passed"
  case $rc in
    0) ;;
    124|137) status="FAILED: timed out after ${limit} s" ;;
    3) [ "$name" = versions ] && status="FAILED: no CUDA GPU visible" || status="FAILED (exit 3)" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  record "$name" "$status" "$((SECONDS - t0))"
  return "$rc"
}

# ViT-B/16, batch 128, 4 cores, 2 rounds
BENCH=(train.py --benchmark --data "$DATA" --model vit-b16-random --device gpu --batch-size 128 --steps "$STEPS" \
       --warmup 6 --cpus 4 --repeat 2 --val-fraction 0 --scan off)
OLD_NVJPEG=${GPU_CHECK_OLD_NVJPEG:-}
[ -z "$OLD_NVJPEG" ] && [ -d .gpu-nvjpeg ] && OLD_NVJPEG=$PWD/.gpu-nvjpeg
PROBE_OLD=()
[ -n "$OLD_NVJPEG" ] && PROBE_OLD=(--old-nvjpeg "$OLD_NVJPEG")

check() {
  echo "GPU check: $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET} s, ${STEPS} timed steps per benchmark run," \
       "cores: ${PIN[*]:-all (no taskset)}"
  [ "${#LIMIT[@]}" -gt 0 ] || echo "note: no timeout(1) here: the steps run without their time limits"
  step versions 30 --tee "$OUT/versions.txt" "$PY" tools/gpu_probe.py versions
  case $? in 3) GPU=none ;; *) GPU=yes ;; esac

  step data 30 --gpu "$PY" tools/gpu_probe.py data "$DATA" "$PACK"

  step "gpu tests" 70 --gpu --tee "$OUT/gpu-tests.txt" \
    "${PIN[@]}" "$PY" -m pytest -q -s -rfEs -m gpu -p no:cacheprovider --durations=8 tests

  step probe 150 --gpu "${PIN[@]}" "$PY" tools/gpu_probe.py probe "$DATA" "$OUT/probe.json" --pack "$PACK" \
    --steps 16 --warmup 4 --parts "${GPU_CHECK_PROBE_PARTS:-decode,old,steps}" "${PROBE_OLD[@]}"

  step "recipe benchmark" 60 --gpu "${PIN[@]}" "$PY" "${BENCH[@]}" --output "$WORK/recipe" --precision 16-mixed \
    --loaders dali,packed,synthetic \
    --packed "$PACK" --auto-augment rand --mixup-alpha 0.8 --cutmix-alpha 1.0 --label-smoothing 0.1 \
    --random-erase 0.25 --clip-grad-norm 1.0
  [ -f "$WORK/recipe/benchmark.json" ] && cp "$WORK/recipe/benchmark.json" "$OUT/benchmark-recipe.json"

  step benchmark 130 --gpu "${PIN[@]}" "$PY" "${BENCH[@]}" --output "$WORK/auto" --precision auto \
    --loaders dali,baseline,synthetic
  for f in benchmark.json benchmark.png; do [ -f "$WORK/auto/$f" ] && cp "$WORK/auto/$f" "$OUT/$f"; done

  "$PY" tools/gpu_probe.py summary "$OUT" "$WORK/steps.tsv" "$((SECONDS - START))" | tee "$OUT/summary.md"
  if awk -F'\t' '$2 != "passed" && $2 !~ /skipped/ { bad = 1 } END { exit !bad }' "$WORK/steps.tsv"; then
    echo "GPU check: FAILED (see summary.md)"
    return 1
  fi
  echo "GPU check: all steps passed"
}

check 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
