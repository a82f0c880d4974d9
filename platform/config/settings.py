"""Control-plane settings, all from environment variables (see docs/configuration.md).

Required: SECRET_KEY, DATABASE_URL, REDIS_URL. Every variable also accepts a `<NAME>_FILE` variant.
"""

from pathlib import Path

from contract.adapter_store import store_config
from contract.env import (
    ConfigError,
    database_from_url,
    env_bool,
    env_float,
    env_int,
    env_list,
    env_str,
    redis_url_checked,
)

BASE_DIR = Path(__file__).resolve().parent.parent
REPO_DIR = BASE_DIR.parent

DEBUG = env_bool("DJANGO_DEBUG", False)
SECRET_KEY = env_str("SECRET_KEY")
# API keys are stored as HMAC digests under this key; kept apart from SECRET_KEY so that rotating
# the session secret does not invalidate every customer's API key.
API_KEY_HMAC_KEY = env_str("API_KEY_HMAC_KEY", SECRET_KEY)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

DATABASES = {"default": database_from_url(env_str("DATABASE_URL"))}
# A connection pool per process (psycopg_pool): a web process does its database work on up to
# GATEWAY_THREADS threads (gateway/offload.py), each giving its connection back at the end of every
# call; the pool bounds the process's connections and saves a PostgreSQL connect per call.
if env_bool("DATABASE_POOL", True):
    DATABASES["default"]["OPTIONS"]["pool"] = {
        "min_size": 1,
        "max_size": env_int("DATABASE_POOL_MAX_SIZE", 16, minimum=1),
        # Short: a gateway thread never waits for a connection (GATEWAY_THREADS <= the pool), and
        # during an outage the one request that tries PostgreSQL again waits this long (config/database.py).
        "timeout": env_float("DATABASE_POOL_TIMEOUT", 5.0),
    }
    DATABASES["default"]["CONN_MAX_AGE"] = 0  # Django requires it with a pool
else:
    DATABASES["default"]["CONN_MAX_AGE"] = env_int("DATABASE_CONN_MAX_AGE", 60, minimum=0)
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
REDIS_URL = redis_url_checked(env_str("REDIS_URL"))

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "tenants",
    "catalog",
    "adapters",
    "ledger",
    "gateway",
    "quotas",
    "billing",
    "management",
    "drf_spectacular_sidecar",
    "console",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # whitenoise, async-capable: every entry here is, so /v1/* stays on the event loop under ASGI.
    "config.middleware.StaticFilesMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "console.middleware.ConsoleSecurityHeadersMiddleware",
]
# The inference API (/v1/*) runs behind these only under ASGI (config/asgi.py): none of Django's own
# middleware, whose hooks cost two sync-thread hops each per request for sessions, users and CSRF
# tokens the API never uses.
INFERENCE_MIDDLEWARE = [
    "config.middleware.ApiSecurityHeadersMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"
# What gunicorn serves (uvicorn workers, deploy/gunicorn.conf.py); the WSGI entry is for tools.
ASGI_APPLICATION = "config.asgi.application"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = REPO_DIR / "staticfiles"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": (
            "django.contrib.staticfiles.storage.StaticFilesStorage"
            if DEBUG
            else "whitenoise.storage.CompressedManifestStaticFilesStorage"
        )
    },
}
# Serve app static files straight from their folders when collectstatic has not been run
# (the embedded developer setup); production images run collectstatic.
WHITENOISE_USE_FINDERS = DEBUG

# Inference request bodies above this size get a 413 before they are parsed.
MAX_REQUEST_BYTES = env_int("MAX_REQUEST_BYTES", 1_048_576, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BYTES

# Images in chat messages (gateway/images.py, docs/api.md). A data URL also counts in MAX_REQUEST_BYTES.
IMAGE_MAX_BYTES = env_int("IMAGE_MAX_BYTES", 5_242_880, minimum=1024)
IMAGE_MAX_PER_REQUEST = env_int("IMAGE_MAX_PER_REQUEST", 4, minimum=0)
IMAGE_MAX_PIXELS = env_int("IMAGE_MAX_PIXELS", 16_777_216, minimum=1)
# Hosts (`name` or `name:port`) whose http(s) image URLs the gateway fetches; none by default.
IMAGE_URL_ALLOWED_HOSTS = [host.lower() for host in env_list("IMAGE_URL_ALLOWED_HOSTS", [])]
IMAGE_FETCH_TIMEOUT_SECONDS = env_float("IMAGE_FETCH_TIMEOUT_SECONDS", 5.0)

# Gateway and dispatch tuning (see docs/architecture.md, "The request path").
AUTH_CACHE_SECONDS = env_int("AUTH_CACHE_SECONDS", 30, minimum=0)
# A worker whose heartbeat is older than this is considered dead.
WORKER_HEARTBEAT_TIMEOUT = env_float("WORKER_HEARTBEAT_TIMEOUT", 10.0)
# How long a request may wait in the pool's queue before it is given up with a 503.
QUEUE_TIMEOUT_SECONDS = env_float("QUEUE_TIMEOUT_SECONDS", 300.0)
# How long a request a worker claimed (took from Redis) may go without its start entry before the
# gateway ends it as worker_lost (a claimer that stops heartbeating ends it sooner).
WORKER_START_TIMEOUT_SECONDS = env_float("WORKER_START_TIMEOUT_SECONDS", 30.0)
# The gateway writes finished requests' ledger rows in batches this often (ledger/writer.py);
# quotas settle at once either way. 0: one INSERT per request, in the request's thread.
LEDGER_BATCH_SECONDS = max(0.0, env_float("LEDGER_BATCH_SECONDS", 0.1))
# Threads per web process for the inference path's blocking steps (authentication to enqueue, which
# includes waiting for a pool's fair share or for a pool scaling from zero); open streams hold none.
GATEWAY_THREADS = env_int("GATEWAY_THREADS", 16, minimum=1)
# SSE keep-alive comment interval while nothing is generated (also detects gone clients).
SSE_KEEPALIVE_SECONDS = env_float("SSE_KEEPALIVE_SECONDS", 5.0)
OPERATOR_TOKEN = env_str("OPERATOR_TOKEN", "")
METRICS_TOKEN = env_str("METRICS_TOKEN", "")
# Fair share of a saturated pool (docs/quotas-and-billing.md): on/off, the slots of a worker that does
# not report its concurrency, and how often a request waiting for a slot polls.
FAIR_SHARE = env_bool("FAIR_SHARE", True)
FAIR_SHARE_SLOTS_PER_WORKER = env_int("FAIR_SHARE_SLOTS_PER_WORKER", 64, minimum=1)
FAIR_SHARE_POLL_SECONDS = env_float("FAIR_SHARE_POLL_SECONDS", 0.05)
# Which worker of a pool runs a request (gateway/routing.py: the decision, its inputs and weights).
ROUTING_POLICY = env_str("ROUTING_POLICY", "cache_aware")
if ROUTING_POLICY not in ("cache_aware", "least_loaded", "round_robin", "pool"):
    raise ConfigError(
        f"ROUTING_POLICY must be cache_aware, least_loaded, round_robin or pool, not {ROUTING_POLICY!r}"
    )
ROUTING_CHUNK_TOKENS = env_int("ROUTING_CHUNK_TOKENS", 64, minimum=1)
ROUTING_INDEX_CHUNKS = env_int("ROUTING_INDEX_CHUNKS", 65_536, minimum=1)
ROUTING_PREFILL_WEIGHT = env_float("ROUTING_PREFILL_WEIGHT", 1.0, minimum=0)
ROUTING_LOAD_WEIGHT = env_float("ROUTING_LOAD_WEIGHT", 1.0, minimum=0)
ROUTING_ADAPTER_LOAD_TOKENS = env_int("ROUTING_ADAPTER_LOAD_TOKENS", 4096, minimum=0)
# How many times a request whose worker is lost continues on another worker of its pool before it
# ends with `worker_lost` (gateway/dispatch.py `_continue`); 0: never.
MAX_CONTINUATIONS = env_int("MAX_CONTINUATIONS", 2, minimum=0)

# Tenants' LoRA adapters (docs/api.md, "Adapters"): where their files are stored (content-addressed,
# contract/adapter_store.py), the largest upload and the largest rank (at most the workers' engine
# max_lora_rank, workers/profiles.py).
# ADAPTER_STORE_URL=s3://bucket/prefix puts them in an S3-compatible bucket (MinIO in docker-compose
# and the chart) that every web and worker process reaches, downloaded into ADAPTER_CACHE_DIR where
# used; unset, they live in ADAPTER_STORE_DIR, a directory every process must share (`make up`).
store_config()  # checked at start: a bad ADAPTER_STORE_* variable stops the process here
ADAPTER_MAX_BYTES = env_int("ADAPTER_MAX_BYTES", 64 * 1024 * 1024, minimum=1024)
ADAPTER_MAX_RANK = env_int("ADAPTER_MAX_RANK", 16, minimum=1)

# The same Redis as REDIS_URL: the gateway pushes its inference tasks with its own client, in the
# MULTI/EXEC that stores their input (gateway/dispatch.py `enqueue`).
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # What docs/api.md documents, for every DRF view including the schema and docs pages: staff
    # tokens, tenant admin keys and the operator's session. Never DRF's default Basic auth, which
    # would check passwords with no rate limit (passwords are checked only by the throttled
    # sign-in forms, console.signin).
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "management.authentication.StaffTokenAuthentication",
        "management.authentication.TenantAdminKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Gemma hosting platform management API",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI and Redoc served from our own static files (drf-spectacular-sidecar), not a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
}

if not DEBUG:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", True)
    CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", True)
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)
    # Probes and in-cluster callers (Prometheus, the operator's pool calls) speak plain http.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$", r"^api/v1/pools/"]
    if env_bool("HTTPS_REDIRECTED_BY_PROXY", False):
        # An ingress or load balancer that terminates TLS sends plain http to https before Django
        # sees it: the check that asks for SECURE_SSL_REDIRECT does not apply.
        SILENCED_SYSTEM_CHECKS = ["security.W008"]
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
    SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
