# syntax=docker/dockerfile:1.7
# Control-plane image: Django + DRF under gunicorn (web), Celery beat and the migration Job.
# No GPU libraries: the engine lives in worker.Dockerfile.
#
#   docker build -f deploy/docker/web.Dockerfile -t gemma-platform/web:0.1.0 .
#
# The build context is the repository root (see .dockerignore).

ARG PYTHON_IMAGE=python:3.11.14-slim-trixie

# ---- build: resolve and install the runtime requirements into a relocatable venv ----
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
COPY requirements.txt /tmp/requirements.txt
RUN /opt/venv/bin/pip install --no-compile -r /tmp/requirements.txt

# ---- runtime ----
FROM ${PYTHON_IMAGE}
ARG APP_UID=10001
LABEL org.opencontainers.image.title="gemma-platform-web" \
      org.opencontainers.image.description="Gemma hosting platform control plane (Django, gunicorn, Celery beat)" \
      org.opencontainers.image.source="https://github.com/gemma-platform/gemma-platform" \
      org.opencontainers.image.licenses="Apache-2.0"

# ~/.cache holds the tokenizers the gateway downloads (HF_HOME); it exists in the image so that
# a volume mounted there starts out owned by the app user.
RUN groupadd --system --gid "${APP_UID}" app \
 && useradd --system --uid "${APP_UID}" --gid app --home-dir /home/app --create-home \
            --shell /usr/sbin/nologin app \
 && mkdir -p /home/app/.cache \
 && chown app:app /home/app/.cache

COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONPATH=/app/platform:/app \
    DJANGO_SETTINGS_MODULE=config.settings \
    WEB_CONCURRENCY=4

WORKDIR /app
# Application code is owned by root and read-only for the app user.
COPY manage.py ./
COPY platform/ platform/
COPY workers/ workers/
COPY deploy/__init__.py deploy/gunicorn.conf.py deploy/

# Static files are collected at build time (settings need their required variables to import; the
# placeholders below exist only for this step and are not kept in the image's environment).
RUN SECRET_KEY=collectstatic-only \
    DATABASE_URL=postgres://collectstatic@127.0.0.1:5432/collectstatic \
    REDIS_URL=redis://127.0.0.1:6379/0 \
    python manage.py collectstatic --noinput \
 && python -m compileall -q platform workers

USER ${APP_UID}:${APP_UID}
EXPOSE 8000

# Liveness only: /readyz also depends on the GPU workers. Host "localhost" must be in ALLOWED_HOSTS
# (the chart and docker-compose.yml add it).
HEALTHCHECK --interval=30s --timeout=5s --start-period=40s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; r = urllib.request.Request('http://127.0.0.1:8000/healthz', headers={'Host': 'localhost'}); sys.exit(0 if urllib.request.urlopen(r, timeout=4).status == 200 else 1)"]

CMD ["gunicorn", "-c", "deploy/gunicorn.conf.py", "--bind", "0.0.0.0:8000"]
