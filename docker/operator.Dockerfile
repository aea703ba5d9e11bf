# syntax=docker/dockerfile:1
# `loraplane operator`: kopf, the kubernetes client and the adapter checks; no torch, no CUDA.
# Build from the repository root: docker build -f docker/operator.Dockerfile -t ghcr.io/loraplane/operator:0.1.0 .
# Any base with python3 (3.11 or newer) and its venv module; the test cluster builds on a Debian
# base of its own (tests/helpers/images.py), since it reaches no registry.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/loraplane/bin:$PATH

# A virtual environment, so that the base's own Python packages stay as they are.
RUN python3 -m venv /opt/loraplane

# Unused by the build itself: a builder whose layer cache cannot see into the bind mount below
# (buildah's) is given a digest of the source here, so that a changed part rebuilds the next step.
ARG SOURCE_DIGEST=

# The source is bind-mounted (read-write, for setuptools' build folder, discarded after the step),
# so no layer keeps it. One folder per part (see pyproject.toml): the command with its operator
# extra and every part that extra reaches, all given at once so that pip meets each `loraplane-*`
# requirement from its folder and never looks for one on an index. No part here needs torch.
RUN --mount=type=bind,source=.,target=/src,rw \
    cd /src && pip install "./cli[operator]" ./operator ./adapter_format ./admin_api ./eviction ./node_cache ./routing ./sim ./usage

# Numeric, so that Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin loraplane
USER 10001

# The subcommand is an argument: the chart passes `operator ...`, its bucket Job runs `python`
# (the environment's, first on PATH).
ENTRYPOINT ["loraplane"]
CMD ["operator"]
