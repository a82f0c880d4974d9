"""gunicorn settings for the control plane: ``gunicorn config.wsgi:application -c deploy/gunicorn.conf.py``.

Every value comes from the environment so the same file serves ``make up``, docker-compose and the Helm
chart. Streaming (SSE) requests hold a worker thread for their whole length, so the thread pool, not
the CPU, bounds how many streams one process relays: keep many threads and no request timeout.
"""

import os


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{name} must be an integer, got {raw!r}") from None


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


# All interfaces by default: in a container the port is reached from outside it. make up binds 127.0.0.1.
bind = os.environ.get("GUNICORN_BIND") or f"{os.environ.get('HOST', '0.0.0.0')}:{_int('PORT', 8000)}"  # noqa: S104
# gthread that accepts a connection only when a thread is free for it (config/gunicorn_worker.py).
worker_class = "config.gunicorn_worker.StreamingThreadWorker"
workers = _int("WEB_CONCURRENCY", 2)
threads = _int("GUNICORN_THREADS", 64)
# 0 disables the worker timeout: with gthread the heartbeat runs on the main thread, so a long SSE
# stream does not starve it, and a fixed request timeout would cut long generations.
timeout = _int("GUNICORN_TIMEOUT", 0)
# On SIGTERM, let streams in flight finish for this long before the workers are killed.
graceful_timeout = _int("GUNICORN_GRACEFUL_TIMEOUT", 30)
keepalive = _int("GUNICORN_KEEPALIVE", 5)
backlog = _int("GUNICORN_BACKLOG", 2048)
# Recycle workers now and then (with jitter, so not all at once) to bound slow leaks; 0 = never.
max_requests = _int("GUNICORN_MAX_REQUESTS", 0)
max_requests_jitter = _int("GUNICORN_MAX_REQUESTS_JITTER", 0)
# Access logging formats and writes a line per request on the hot path: off unless asked for.
accesslog = "-" if _flag("GUNICORN_ACCESS_LOG") else None
errorlog = "-"
loglevel = os.environ.get("GUNICORN_LOG_LEVEL", "info")
# Behind a Kubernetes ingress / load balancer the client address comes in X-Forwarded-For.
forwarded_allow_ips = os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1")
proc_name = "gemma-platform-web"

# Modules each worker imports before it takes requests. The gateway tokenizes prompts with
# transformers' AutoTokenizer, whose first import takes seconds (it pulls in torch): done here, in
# each worker after the fork, it does not land on the first request. Empty to disable.
_warm_imports = [name.strip() for name in os.environ.get("GUNICORN_WARM_IMPORTS", "transformers").split(",")]


def post_worker_init(worker):
    import importlib

    for name in filter(None, _warm_imports):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            worker.log.warning("GUNICORN_WARM_IMPORTS: cannot import %s: %s", name, exc)
    _preload_tokenizers(worker)
    _prestart_request_threads(worker)


def _prestart_request_threads(worker) -> None:
    # gthread starts a request thread on a request that finds none idle, and its accept loop waits
    # until that thread runs (workers/threadpools.py): start them all now, off the request path.
    from concurrent.futures import ThreadPoolExecutor

    from workers.threadpools import prestart_threads

    if isinstance(getattr(worker, "tpool", None), ThreadPoolExecutor):
        prestart_threads(worker.tpool, worker.cfg.threads)


def _preload_tokenizers(worker) -> None:
    # The gateway tokenizes prompts; loading a model's tokenizer takes seconds, so do it before this
    # process takes requests (a model registered later is loaded on its first request).
    try:
        from django.db import connection

        from gateway.tokenization import preload_tokenizers

        worker.log.info("preloaded %d tokenizer(s)", preload_tokenizers())
        connection.close()
    except Exception as exc:  # e.g. a database not migrated yet: the first request loads it instead
        worker.log.warning("could not preload tokenizers: %s", exc)
