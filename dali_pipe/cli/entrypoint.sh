#!/bin/sh
# The container's entry point (Dockerfile ENTRYPOINT): say which driver and CUDA meet, choose how CUDA 12
# runs on the host's driver, refuse --device gpu without a usable GPU, then exec Python so that it is
# PID 1 and receives SIGTERM itself (spot reclaim, docker stop).
#
#   SageMaker:  docker run IMAGE train          -> python train.py train
#               docker run IMAGE                -> python train.py (inside a job: the contract; else the demo)
#   locally:    docker run --gpus all IMAGE ARGS -> python train.py ARGS
#
# A driver older than the image's forward-compatibility libraries (CUDA_VERSION's driver, e.g. R470, R535
# and R550 under CUDA 12.6's 560): those libraries are tried first (cuInit through them, as AWS's own
# start_cuda_compat.sh enables them, but checked: they work on data-center GPUs only). When they do not
# work, a driver of R525 or later still runs CUDA 12 (minor version compatibility); an older one cannot.
#
# The paths below are variables so that the tests can point them at fakes.
set -eu
PYTHON=${DALI_PIPE_PYTHON:-/opt/venv/bin/python}
PROGRAM=${DALI_PIPE_PROGRAM:-/opt/program/train.py}
COMPAT_DIR=${DALI_PIPE_COMPAT_DIR:-/usr/local/cuda/compat}
DRIVER_FILE=${DALI_PIPE_DRIVER_FILE:-/proc/driver/nvidia/version}
CUDA12_DRIVER=525.60.13  # the first driver with CUDA 12: minor version compatibility from there on

older() {  # older A B: version A sorts before version B
    [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1)" = "$1" ]
}

cuinit() {  # cuinit DIR: 0 when cuInit succeeds with the libcuda in DIR, else its error (100: no GPU)
    LD_LIBRARY_PATH="$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$PYTHON" -c \
        'import ctypes, sys; sys.exit(ctypes.CDLL("libcuda.so.1").cuInit(0) % 256)' 2>/dev/null
}

asks_cpu() {  # asks_cpu ARGS...: the arguments say --device cpu
    prev=""
    for arg in "$@"; do
        if [ "$arg" = "--device=cpu" ] || { [ "$prev" = "--device" ] && [ "$arg" = "cpu" ]; }; then return 0; fi
        prev=$arg
    done
    return 1
}

asks_gpu() {  # asks_gpu ARGS...: the arguments say --device gpu
    prev=""
    for arg in "$@"; do
        if [ "$arg" = "--device=gpu" ] || { [ "$prev" = "--device" ] && [ "$arg" = "gpu" ]; }; then return 0; fi
        prev=$arg
    done
    return 1
}

refuse() {  # refuse MESSAGE: one line on stderr (and in output/failure when this is a SageMaker job), exit 2
    echo "entrypoint: $1" >&2
    job=${SAGEMAKER_BASE_DIR:-/opt/ml}
    if [ -d "$job/input/config" ] && [ -d "$job/output" ]; then
        printf '%s' "$1" > "$job/output/failure" || true
    fi
    exit 2
}

driver=""
if [ -r "$DRIVER_FILE" ]; then
    driver=$(sed -n 's/^NVRM.*Kernel Module[^0-9]*\([0-9][0-9.]*\).*$/\1/p' "$DRIVER_FILE" | head -n1)
fi
compat=""
for lib in "$COMPAT_DIR"/libcuda.so.*.*; do
    [ -e "$lib" ] && compat=${lib##*/libcuda.so.}
done

no_gpu() {  # no_gpu WHY ARGS...: say so; refuse when ARGS ask for --device gpu
    echo "entrypoint: $1; CUDA ${CUDA_VERSION:-?} unused (CPU only)"
    shift
    if asks_gpu "$@"; then
        refuse "--device gpu was asked but no GPU is visible; run with 'docker run --gpus all' or a GPU instance"
    fi
}

if [ -z "$driver" ]; then
    no_gpu "no NVIDIA driver visible" "$@"
elif [ -n "$compat" ] && older "$driver" "$compat"; then
    if cuinit "$COMPAT_DIR"; then
        export LD_LIBRARY_PATH="$COMPAT_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "entrypoint: driver $driver is older than CUDA ${CUDA_VERSION:-?} needs ($compat): using the forward-compatibility libraries in $COMPAT_DIR"
    else
        error=$?
        if [ "$error" = 100 ]; then
            no_gpu "driver $driver but no GPU in this container" "$@"
        elif ! older "$driver" "$CUDA12_DRIVER"; then
            echo "entrypoint: driver $driver, CUDA ${CUDA_VERSION:-?}: this GPU cannot use the forward-compatibility libraries (cuInit error $error; data-center GPUs only): running on the driver's own CUDA 12 (minor version compatibility)"
        elif asks_cpu "$@"; then
            echo "entrypoint: driver $driver cannot run CUDA 12 on this GPU; --device cpu was asked, so the GPU stays unused"
        else
            refuse "driver $driver has no CUDA 12 and this GPU cannot use the forward-compatibility libraries (cuInit error $error; they work on data-center GPUs only): install driver $CUDA12_DRIVER or later, or pass --device cpu"
        fi
    fi
else
    echo "entrypoint: driver $driver, CUDA ${CUDA_VERSION:-?}"
fi
exec "$PYTHON" "$PROGRAM" "$@"
