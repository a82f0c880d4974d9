# syntax=docker/dockerfile:1.7
# Pool-scaler operator image: kopf + the official kubernetes client, nothing of Django or vLLM.
#
#   docker build -f deploy/docker/operator.Dockerfile -t gemma-platform/operator:0.1.0 .

ARG PYTHON_IMAGE=python:3.11.14-slim-trixie

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
COPY requirements.txt /tmp/requirements.txt
# Only the operator's own dependencies, with the pins requirements.txt holds for the whole project
# (its lines, not `-c requirements.txt`: pip refuses constraints with extras such as psycopg[binary]).
RUN grep -E '^(kopf|kubernetes)[=<>~!]' /tmp/requirements.txt > /tmp/operator-requirements.txt \
 && test "$(wc -l < /tmp/operator-requirements.txt)" -eq 2 \
 && /opt/venv/bin/pip install --no-compile -r /tmp/operator-requirements.txt

FROM ${PYTHON_IMAGE}
ARG APP_UID=10001
LABEL org.opencontainers.image.title="gemma-platform-operator" \
      org.opencontainers.image.description="Gemma hosting platform ModelPool operator (kopf)" \
      org.opencontainers.image.source="https://github.com/gemma-platform/gemma-platform" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid "${APP_UID}" app \
 && useradd --system --uid "${APP_UID}" --gid app --home-dir /home/app --create-home \
            --shell /usr/sbin/nologin app
COPY --from=build /opt/venv /opt/venv
# poolscaler.py imports its sibling module `scaling`.
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=/app/deploy/operator:/app
WORKDIR /app
COPY deploy/__init__.py deploy/
COPY deploy/operator/ deploy/operator/
USER ${APP_UID}:${APP_UID}
EXPOSE 8080
# kopf's own liveness endpoint (enabled by --liveness below) answers while the operator loop runs.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
CMD ["kopf", "run", "--standalone", "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz", "deploy/operator/poolscaler.py"]
