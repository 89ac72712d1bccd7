# syntax=docker/dockerfile:1
# Conveyor model server, CPU image.
#
#   docker build -t conveyor:0.1.0 .
#   docker run --rm -p 8080:8080 -p 8082:8082 -v "$PWD/models:/mnt/models:ro" conveyor:0.1.0
#
# /mnt/models holds config/config.properties and model-store/*.mar (KServe's layout: the storage
# initializer puts the storageUri there). See docs/deploy.md.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# PyTorch's CPU wheels: PyPI's torch for Linux pulls the CUDA stack (GBs) a CPU image never uses.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY setup.py ./
COPY backend/ backend/
COPY frontend/ frontend/
COPY handlers/ handlers/
# The torch version is the one setup.py pins (one source of truth); the CPU build of that version
# ("2.13.0+cpu") satisfies setup.py's "torch==2.13.0", so the project install keeps it.
RUN python -m venv /opt/conveyor \
    && torch_version="$(sed -n 's/.*"torch==\([0-9][0-9.]*\)".*/\1/p' setup.py)" \
    && test -n "$torch_version" \
    && /opt/conveyor/bin/pip install --index-url "$TORCH_INDEX_URL" "torch==${torch_version}" \
    && /opt/conveyor/bin/pip install /src \
    && /opt/conveyor/bin/python -c "import torch, frontend.cli; assert '+cpu' in torch.__version__, torch.__version__"

FROM ${PYTHON_IMAGE}
# tini: PID 1 that forwards SIGTERM to the server and reaps any orphaned process.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 1000 model-server \
    && useradd --uid 1000 --gid model-server --create-home --home-dir /home/model-server --shell /usr/sbin/nologin model-server \
    && mkdir -p /mnt/models/config /mnt/models/model-store \
    && chown -R model-server:model-server /mnt/models
COPY --from=build /opt/conveyor /opt/conveyor
COPY deploy/docker/config.properties /etc/conveyor/config.properties
COPY --chmod=0755 deploy/docker/entrypoint.sh /usr/local/bin/conveyor-entrypoint
ENV PATH=/opt/conveyor/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    CONVEYOR_MODEL_DIR=/mnt/models
USER 1000:1000
WORKDIR /home/model-server
# REST inference, management, metrics; gRPC inference, management.
EXPOSE 8080 8081 8082 7070 7071
# /ping needs no token (TorchServe's rule): 200 Healthy / Partial Healthy, 500 Unhealthy.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/ping', timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["tini", "--", "conveyor-entrypoint"]
CMD []
