# SageMaker bring-your-own-container image: `docker run IMAGE train` (SageMaker), or locally
# `docker run --gpus all -v $PWD/opt_ml:/opt/ml IMAGE train`, or `docker run --gpus all IMAGE --data ...`.
# With no arguments it runs the contract inside a SageMaker job (SDK 3's ModelTrainer starts it so), and
# the demo elsewhere, as `python train.py` does; so there is no CMD.
#
# torch is PyTorch's CUDA 12.6 build (`+cu126`) of the locked version: PyTorch publishes torch 2.13 for
# CUDA 12.6 and 13.0 (13.2 experimental), no 12.8 (tests/test_dockerfile.py keeps the list and its
# source). A CUDA 12 build is the one that runs on the R470/R535/R550 drivers of SageMaker's g4dn, g5
# and p4d hosts (CUDA 13 needs R580, or R535+ with its compat package), and its wheels carry sm_75
# kernels for the T4. uv's --torch-backend takes torch (and triton) from PyTorch's cu126 index and every
# other package from PyPI only, pinned by requirements.lock, the stack CI tests; DALI is the cuda120 extra
# (DALI's CUDA 12 wheel, the lock's).
#
# Base: NVIDIA's CUDA 12.6 image, whose forward-compatibility libraries (/usr/local/cuda/compat, from
# driver 560) still support R470 hosts (12.8's no longer do); the entry point enables them when the host
# driver is older and the GPU supports them (data-center GPUs), else runs on the driver's own CUDA 12
# (R525 and later). The CPython is the one the tests run (3.11), installed by uv.
FROM ghcr.io/astral-sh/uv:0.13.9 AS uv

FROM nvidia/cuda:12.6.3-base-ubuntu24.04

# Bytecode is compiled once, at install (uv does not by default): with PYTHONDONTWRITEBYTECODE, which keeps
# a container from writing __pycache__ at run time, every start would otherwise compile torch, Lightning
# and transformers again (tests/test_dockerfile.py has the cost).
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    UV_COMPILE_BYTECODE=1 \
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
       --index-url https://pypi.org/simple --torch-backend cu126 \
       "torch==2.13.0+cu126" --requirement pyproject.toml --extra cuda120

COPY README.md train.py ./
COPY dali_pipe ./dali_pipe
COPY model ./model
RUN uv pip install --python /opt/venv/bin/python --no-deps . \
    && install -m 0755 dali_pipe/cli/entrypoint.sh /opt/program/entrypoint

# Exec form: the entry point execs Python, which is PID 1 and gets SIGTERM. Root, as SageMaker needs.
ENTRYPOINT ["/opt/program/entrypoint"]
