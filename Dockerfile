# Shoal's serving image: `docker build -t shoal .` in the checkout (deploy/kubernetes uses it).
# CUDA base with Ubuntu 24.04's Python 3.12, the PyTorch CUDA 13.0 wheel and Triton as the GPU
# machines run them, then `pip install .` as README.md / scripts/setup.sh install Shoal.
# tests/test_deploy_manifests.py checks what can be checked without building it.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ARG TRITON_VERSION=3.6.0

# python3.12-dev and gcc: Triton compiles its small CUDA launcher stub at first use.
# tini: PID 1 that forwards SIGTERM to `shoal serve` and reaps the engine process.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev gcc tini \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/shoal/venv \
    PATH=/opt/shoal/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1
RUN python3.12 -m venv /opt/shoal/venv \
    && python -m pip install --upgrade pip \
    && python -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
    && python -m pip install "triton==${TRITON_VERSION}"

WORKDIR /opt/shoal/src
COPY pyproject.toml README.md ./
COPY shoal ./shoal
# The postgres extra: replicas share one PostgreSQL database (--database-url).
RUN python -m pip install ".[postgres]"

RUN groupadd --system --gid 10001 shoal \
    && useradd --system --uid 10001 --gid shoal --create-home --home-dir /home/shoal shoal \
    && mkdir -p /var/lib/shoal \
    && chown shoal:shoal /var/lib/shoal
USER 10001:10001
WORKDIR /home/shoal
ENV SHOAL_HOST=0.0.0.0 \
    SHOAL_PORT=8080 \
    SHOAL_DATA_DIR=/var/lib/shoal
EXPOSE 8080

ENTRYPOINT ["/usr/bin/tini", "--", "shoal"]
CMD ["serve"]
