# syntax=docker/dockerfile:1.7
# GPU worker image: a Celery worker hosting one vLLM AsyncLLM engine (CUDA build), for NVIDIA A10G
# (ENGINE_PROFILE=a10g) and other CUDA GPUs.
#
#   docker build -f deploy/docker/worker.Dockerfile -t gemma-platform/worker:0.1.0 .
#
# vllm==0.26.0 pins torch==2.11.0 built for CUDA 13; the torch wheels bring their own CUDA user-space
# libraries, so the base only needs to be a CUDA 13 runtime (the driver comes from the node through
# the NVIDIA container toolkit / GPU operator). Python 3.11 comes from uv's standalone builds because
# Ubuntu 24.04 ships 3.12 only.

ARG CUDA_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.9.7
ARG PYTHON_VERSION=3.11.14
ARG VLLM_VERSION=0.26.0

FROM ${UV_IMAGE} AS uv

# ---- build: Python + vLLM + the platform's runtime requirements into /opt/venv ----
FROM ${CUDA_IMAGE} AS build
ARG PYTHON_VERSION
ARG VLLM_VERSION
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_PYTHON_PREFERENCE=only-managed \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_NO_CACHE=1
RUN uv python install "${PYTHON_VERSION}" \
 && uv venv --python "${PYTHON_VERSION}" /opt/venv
COPY requirements.txt /tmp/requirements.txt
# One resolution for both, so vLLM's pins (torch, transformers) and ours must agree.
RUN uv pip install --python /opt/venv/bin/python "vllm==${VLLM_VERSION}" -r /tmp/requirements.txt

# ---- runtime ----
FROM ${CUDA_IMAGE}
ARG APP_UID=10001
LABEL org.opencontainers.image.title="gemma-platform-worker" \
      org.opencontainers.image.description="Gemma hosting platform GPU worker (Celery + vLLM CUDA)" \
      org.opencontainers.image.source="https://github.com/gemma-platform/gemma-platform" \
      org.opencontainers.image.licenses="Apache-2.0"

# Triton (used by vLLM kernels) compiles a small C launcher at run time: it needs a C compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# Ubuntu 24.04 images already hold a user with uid 1000 ("ubuntu"); ours is 10001 like the others.
RUN groupadd --system --gid "${APP_UID}" app \
 && useradd --system --uid "${APP_UID}" --gid app --home-dir /home/app --create-home \
            --shell /usr/sbin/nologin app \
 && mkdir -p /models /home/app/.cache \
 && chown -R app:app /models /home/app/.cache

COPY --from=build /opt/python /opt/python
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONPATH=/app/platform:/app \
    DJANGO_SETTINGS_MODULE=config.settings \
    HOME=/home/app \
    HF_HOME=/models/huggingface \
    VLLM_CACHE_ROOT=/home/app/.cache/vllm \
    ENGINE_PROFILE=a10g \
    SERVED_MODEL=google/gemma-4-E4B-it \
    WORKER_POOL=gemma-4-e4b \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

WORKDIR /app
COPY manage.py ./
COPY platform/ platform/
COPY workers/ workers/

USER ${APP_UID}:${APP_UID}
VOLUME ["/models"]

# Ready when this container's engine has loaded the model; loading takes minutes, hence the long
# start period.
HEALTHCHECK --interval=30s --timeout=20s --start-period=900s --retries=3 \
  CMD ["python", "-m", "workers.probe"]

# SIGTERM starts Celery's warm shutdown: it stops consuming and lets in-flight tasks finish.
# Give the container a long stop timeout (docker stop -t 600 / terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
CMD ["sh", "-c", "exec celery -A workers.worker worker --pool threads --concurrency \"${WORKER_CONCURRENCY:-64}\" -Q \"pool.${WORKER_POOL}\" -n 'worker@%h' --loglevel \"${LOG_LEVEL:-INFO}\""]
