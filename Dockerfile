# SageMaker bring-your-own-container image: `docker run IMAGE train` (SageMaker), or locally
# `docker run --gpus all -v $PWD/opt_ml:/opt/ml IMAGE train`, or `docker run --gpus all IMAGE --data ...`.
#
# Base: NVIDIA's CUDA 12.8 image, which carries the forward-compatibility libraries
# (/usr/local/cuda/compat); the entry point enables them when the host driver is older than CUDA 12.8
# needs (g4dn and g5 hosts may run R470/R535). torch is PyTorch's CUDA 12.8 build of the locked
# version (its wheels include sm_75 kernels for the T4); everything else is exactly requirements.lock,
# the stack CI tests. The CPython is the one the tests run (3.11), installed by uv.
FROM ghcr.io/astral-sh/uv:0.13.9 AS uv

FROM nvidia/cuda:12.8.1-base-ubuntu24.04

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    UV_NO_CACHE=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility,video \
    PATH=/opt/venv/bin:$PATH

COPY --from=uv /uv /usr/local/bin/uv

WORKDIR /opt/program
# Dependencies first, in a layer that changes only with the lock.
COPY pyproject.toml requirements.lock ./
RUN uv venv --python 3.11.7 /opt/venv \
    && uv pip install --python /opt/venv/bin/python --constraint requirements.lock \
       --index-url https://pypi.org/simple --extra-index-url https://download.pytorch.org/whl/cu128 \
       --index-strategy unsafe-best-match "torch==2.13.0+cu128" --requirement pyproject.toml

COPY README.md train.py ./
COPY dali_pipe ./dali_pipe
COPY model ./model
RUN uv pip install --python /opt/venv/bin/python --no-deps . \
    && install -m 0755 dali_pipe/cli/entrypoint.sh /opt/program/entrypoint

# Exec form: the entry point execs Python, which is PID 1 and gets SIGTERM. Root, as SageMaker needs.
ENTRYPOINT ["/opt/program/entrypoint"]
