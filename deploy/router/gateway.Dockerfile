# The SGLang Model Gateway image that deploy/kubernetes runs (image name sglang-gateway, tagged
# with the sglang-router version). Build from the repository root:
#   docker build -f deploy/router/gateway.Dockerfile -t sglang-gateway:0.3.2 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG SGLANG_ROUTER_VERSION=0.3.2
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

RUN pip install "sglang-router==${SGLANG_ROUTER_VERSION}" \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin gateway

USER 10001:10001
# 30000: the OpenAI API; 29000: Prometheus metrics
EXPOSE 30000 29000
ENTRYPOINT ["sglang-router", "launch"]
