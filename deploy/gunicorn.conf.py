"""gunicorn settings for the control plane: ``gunicorn -c deploy/gunicorn.conf.py``.

Every value comes from the environment so the same file serves ``make up``, docker-compose and the Helm
chart. gunicorn manages the processes; each one serves the ASGI application (config/asgi.py) on an
event loop (uvicorn), where an open SSE stream is a coroutine waiting on Redis, not a thread: how
many streams a process relays is bounded by its Redis connections (REDIS_MAX_CONNECTIONS), not by
threads. No request timeout, so long generations are never cut.
"""

import math
import os

from contract.env import ConfigError, env_bool, env_int


def _int(name: str, default: int) -> int:
    try:
        return env_int(name, default)
    except ConfigError as exc:  # gunicorn prints a SystemExit's message and stops
        raise SystemExit(str(exc)) from None


def _flag(name: str, default: bool = False) -> bool:
    try:
        return env_bool(name, default)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None


# The most web processes the default starts: each holds ~300 MB of its own (the served models'
# tokenizers among it), and on the 16-core H200 host 12 processes admitted a burst no faster than 8
# (docs/gpu.md).
MAX_DEFAULT_WORKERS = 8
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # "<quota> <period>" in microseconds, or "max <period>"


def usable_cores() -> int:
    """The cores this server may run on: its CPU affinity, bounded by the CPU limit of its container
    (the cgroup v2 quota), where it has one."""
    cores = len(os.sched_getaffinity(0))
    try:
        with open(CGROUP_CPU_MAX) as limit:
            quota, period = limit.read().split()
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):
        pass  # no cgroup v2 limit readable: the affinity alone
    return max(1, cores)


def default_workers(cores: int) -> int:
    return min(cores, MAX_DEFAULT_WORKERS)


# All interfaces by default: in a container the port is reached from outside it. make up binds 127.0.0.1.
bind = os.environ.get("GUNICORN_BIND") or f"{os.environ.get('HOST', '0.0.0.0')}:{_int('PORT', 8000)}"  # noqa: S104
# The application, so that command lines need only ``-c deploy/gunicorn.conf.py``.
wsgi_app = "config.asgi:application"
# uvicorn's worker (uvloop event loop, httptools parser) under gunicorn's process management.
worker_class = "uvicorn_worker.UvicornWorker"
# One process per core it may use, by default: a process serves all its requests on one event loop,
# so more processes than cores only take turns on them. On a 2-core host whose serving processes
# were pinned to one core, one web process spent 11-22% less CPU per request than two
# (docs/benchmarks.md): two event loops, stream readers and ledger writers taking turns on one core.
workers = _int("WEB_CONCURRENCY", default_workers(usable_cores()))
# The worker heartbeat runs on the event loop, so open streams do not delay it. 0 (off) by default:
# a worker loads the served models' tokenizers before its loop starts, which can take longer than
# any timeout that would still catch a wedged loop promptly.
timeout = _int("GUNICORN_TIMEOUT", 0)
# On SIGTERM, let streams in flight finish for this long before the workers are killed.
graceful_timeout = _int("GUNICORN_GRACEFUL_TIMEOUT", 30)
# Each worker process listens on a socket of its own, bound with SO_REUSEPORT, and the kernel hashes
# each new connection to one of them. With the master's one shared socket, the event loop awake when
# a burst arrives accepts all it can before the others wake: 128 clients connecting at once to 8
# processes were taken 66 / 48 / 11 / 2 / 1 / 0 / 0 / 0 in one try and 113 / 7 / 3 / 2 / 1 / 1 / 1 / 0
# in another (10-22 each with a socket per process), and as clients keep their connections alive,
# every later wave of requests landed the same way, queueing most admissions and most of the
# streams' relay on one process while others idled (docs/gpu.md: 121 ms of waiting at 128 streams).
# The cost: a restarted process's share of new connections waits in its socket's backlog while it
# boots. GUNICORN_REUSE_PORT=0: the shared socket.
reuse_port = _flag("GUNICORN_REUSE_PORT", True)
# How long an idle keep-alive connection stays open (uvicorn's timeout_keep_alive). Longer than the
# idle timeout of the proxies in front (60 s for AWS's ALB and for ingress-nginx's upstream
# connections), so that the proxy, not this server, closes an idle connection: a server that closes
# it races the next request the proxy or client sends on it, which then fails as a disconnected
# connection before it reaches the gateway. With 5 s, a GPU bench turn at 512 streams lost 10 of 768
# requests to "Server disconnected", most likely so: its clients reuse pooled
# connections, some left idle for seconds while the engine was full.
keepalive = _int("GUNICORN_KEEPALIVE", 75)
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


def on_starting(server):
    # Each open stream holds a client socket and a Redis connection: a process serving hundreds of
    # streams needs more descriptors than the usual soft limit of 1,024. Raise it to the hard limit.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def post_worker_init(worker):
    import importlib

    for name in filter(None, _warm_imports):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            worker.log.warning("GUNICORN_WARM_IMPORTS: cannot import %s: %s", name, exc)
    _preload_tokenizers(worker)
    from contract.heap import freeze_startup_heap

    # Last, once everything this process keeps is loaded (contract/heap.py says why).
    worker.log.info("froze %d start-up objects out of the garbage collector's passes", freeze_startup_heap())


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
