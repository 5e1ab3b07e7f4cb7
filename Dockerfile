# syntax=docker/dockerfile:1
# Two images from one tree (docs/images.md):
#   docker build --target operator -t malleus-operator .   # kopf operator + planner, no torch
#   docker build --target trainer  -t malleus-trainer  .   # torch + the trainer (torchrun entry)
# The trainer defaults to PyPI's torch (a CUDA build on Linux x86_64; the node's NVIDIA runtime
# provides the driver). A CPU-only trainer (emulated GPUs, CI clusters):
#   docker build --target trainer --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
# Every install step is scripts/docker-install.sh, which the test suite runs without Docker.
# Building, pushing, CI and pull secrets: docs/images.md.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TRAINER_BASE_IMAGE=${PYTHON_IMAGE}

# ---- build: the malleus wheel -----------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY malleus ./malleus
COPY operator ./operator
COPY trainer ./trainer
COPY scripts/docker-install.sh ./scripts/docker-install.sh
RUN ./scripts/docker-install.sh wheel /wheels

# ---- operator: kopf, the kubernetes client, the planner; no torch --------------------------------
FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN groupadd --gid 10001 malleus \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin malleus
COPY --from=build /wheels /wheels
COPY scripts/docker-install.sh /usr/local/bin/malleus-docker-install
RUN malleus-docker-install operator /wheels && rm -rf /wheels
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 8081
ENTRYPOINT ["python", "-m", "malleus.operator"]

# ---- trainer: torch + malleus[trainer]; the operator's pods run `torchrun ... -m malleus.trainer`
FROM ${TRAINER_BASE_IMAGE} AS trainer
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/tmp
RUN groupadd --gid 1000 malleus \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin malleus
COPY --from=build /wheels /wheels
COPY scripts/docker-install.sh /usr/local/bin/malleus-docker-install
# RDMA user space (rdma-core's libibverbs and providers): NCCL over InfiniBand or RoCE loads it
RUN malleus-docker-install rdma
RUN TORCH_VERSION=${TORCH_VERSION} TORCH_INDEX_URL=${TORCH_INDEX_URL} \
    malleus-docker-install trainer /wheels && rm -rf /wheels
USER 1000:1000
WORKDIR /tmp
EXPOSE 8040 29500
CMD ["python", "-m", "malleus.trainer", "--help"]
