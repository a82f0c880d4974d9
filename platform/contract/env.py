"""Typed readers for configuration from environment variables.

Every reader accepts a `<NAME>_FILE` variant (a path to a mounted Kubernetes secret) and fails at
start with a message naming the variable, instead of failing later on the request path.
"""

import os
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse


class ConfigError(ValueError):
    """A configuration variable is missing or malformed."""


_UNSET = object()


def _raw(name: str) -> str | None:
    file_path = os.environ.get(f"{name}_FILE")
    if file_path:
        try:
            return Path(file_path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{name}_FILE={file_path!r} cannot be read: {exc}") from exc
    return os.environ.get(name)


def env_str(name: str, default: object = _UNSET) -> str:
    value = _raw(name)
    if value is None or value == "":
        if default is _UNSET:
            raise ConfigError(f"{name} must be set (or {name}_FILE pointing to a file holding it)")
        return default  # type: ignore[return-value]
    return value


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    value = _raw(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {number}")
    return number


def env_float(name: str, default: float, *, minimum: float | None = None, maximum: float | None = None) -> float:
    value = _raw(name)
    if value is None or value == "":
        return default
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    low = float("-inf") if minimum is None else minimum
    high = float("inf") if maximum is None else maximum
    if not low <= number <= high:
        raise ConfigError(f"{name} must be within {low:g}..{high:g}, got {value!r}")
    return number


def env_bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None or value == "":
        return default
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{name} must be a boolean (true/false/1/0), got {value!r}")


def env_list(name: str, default: list[str]) -> list[str]:
    value = _raw(name)
    if value is None or value == "":
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


def database_from_url(url: str) -> dict:
    """Django DATABASES entry from a postgres:// URL (the only engine we support)."""
    parsed = urlparse(url)
    if parsed.scheme not in {"postgres", "postgresql"}:
        raise ConfigError(f"DATABASE_URL must be a postgres:// URL, got scheme {parsed.scheme!r}")
    name = unquote(parsed.path.lstrip("/"))
    if not name:
        raise ConfigError("DATABASE_URL must name a database, e.g. postgres://user@host:5432/gemma")
    options = {key: values[-1] for key, values in parse_qs(parsed.query).items()}
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": unquote(parsed.username or ""),
        "PASSWORD": unquote(parsed.password or ""),
        "HOST": parsed.hostname or "",
        "PORT": str(parsed.port or ""),
        "OPTIONS": options,
    }


def redis_url_checked(url: str) -> str:
    if urlparse(url).scheme not in {"redis", "rediss", "unix"}:
        raise ConfigError(f"REDIS_URL must be a redis:// URL, got {url!r}")
    return url
