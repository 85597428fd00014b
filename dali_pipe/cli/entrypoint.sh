#!/bin/sh
# The container's entry point (Dockerfile ENTRYPOINT): say which driver and CUDA meet, turn on CUDA
# forward compatibility when the host driver is older than the image's CUDA needs (as AWS's own
# start_cuda_compat.sh does), refuse --device gpu without a visible GPU, then exec Python so that it is
# PID 1 and receives SIGTERM itself (spot reclaim, docker stop).
#
#   SageMaker:  docker run IMAGE train          -> python train.py train
#   locally:    docker run --gpus all IMAGE ARGS -> python train.py ARGS
#
# The paths below are variables so that the tests can point them at fakes.
set -eu
PYTHON=${DALI_PIPE_PYTHON:-/opt/venv/bin/python}
PROGRAM=${DALI_PIPE_PROGRAM:-/opt/program/train.py}
COMPAT_DIR=${DALI_PIPE_COMPAT_DIR:-/usr/local/cuda/compat}
DRIVER_FILE=${DALI_PIPE_DRIVER_FILE:-/proc/driver/nvidia/version}

older() {  # older A B: version A sorts before version B
    [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1)" = "$1" ]
}

driver=""
if [ -r "$DRIVER_FILE" ]; then
    driver=$(sed -n 's/^NVRM.*Kernel Module[^0-9]*\([0-9][0-9.]*\).*$/\1/p' "$DRIVER_FILE" | head -n1)
fi
compat=""
for lib in "$COMPAT_DIR"/libcuda.so.*.*; do
    [ -e "$lib" ] && compat=${lib##*/libcuda.so.}
done

if [ -z "$driver" ]; then
    echo "entrypoint: no NVIDIA driver visible; CUDA ${CUDA_VERSION:-?} unused (CPU only)"
    for arg in "$@"; do
        case "$arg" in
            gpu|--device=gpu) if [ "${prev:-}" = "--device" ] || [ "$arg" = "--device=gpu" ]; then
                echo "entrypoint: --device gpu was asked but no GPU is visible; run with 'docker run --gpus all' or a GPU instance" >&2
                exit 2
            fi ;;
        esac
        prev=$arg
    done
elif [ -n "$compat" ] && older "$driver" "$compat"; then
    export LD_LIBRARY_PATH="$COMPAT_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "entrypoint: driver $driver is older than CUDA ${CUDA_VERSION:-?} needs ($compat): using the forward-compatibility libraries in $COMPAT_DIR"
else
    echo "entrypoint: driver $driver, CUDA ${CUDA_VERSION:-?}"
fi
exec "$PYTHON" "$PROGRAM" "$@"
