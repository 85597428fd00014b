# SageMaker bring-your-own-container image: `docker run IMAGE train` (SageMaker), or locally
# `docker run --gpus all -v $PWD/opt_ml:/opt/ml IMAGE train`.
# The CUDA 12 runtime comes with the wheels (torch cu124 pulls nvidia-*-cu12, DALI cuda120 carries
# its own); the host driver (525 or newer) is mounted by the NVIDIA container runtime, so no driver
# is installed here. torch's cu124 wheels include sm75 kernels: the T4 of ml.g4dn runs them.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PATH=/opt/program:$PATH

# Dependencies first, in a layer that changes rarely: torch for CUDA 12.4, then the rest.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cu124 torch==2.5.1 \
    && pip install --no-cache-dir "nvidia-dali-cuda120>=1.40" "pytorch-lightning>=2.3" "transformers>=4.40" \
       "pandas>=2.0" "boto3>=1.34" "numpy>=1.24" "pillow>=10.0" "psutil>=5.9" "nvidia-ml-py>=12.535" \
       "matplotlib>=3.7" "scikit-image>=0.22" "tqdm>=4.66" "tensorboard>=2.14"

WORKDIR /opt/program
COPY pyproject.toml README.md train.py ./
COPY dali_pipe ./dali_pipe
COPY model ./model
# `train` on PATH: SageMaker runs `docker run IMAGE train`, as root, with /opt/ml mounted.
RUN pip install --no-cache-dir --no-deps . \
    && printf '#!/bin/sh\nexec python /opt/program/train.py train "$@"\n' > /opt/program/train \
    && chmod +x /opt/program/train

CMD ["train"]
