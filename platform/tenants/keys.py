"""API key format, generation and digests.

A key looks like `gpk_<prefix>_<secret>`: the prefix (12 chars) finds the row by an index lookup,
the secret (40 chars, 238 bits) is never stored; the row holds an HMAC digest of the whole key.
"""

import hashlib
import hmac
import secrets
import string
from dataclasses import dataclass

from django.conf import settings

KEY_SCHEME = "gpk"
PREFIX_LENGTH = 12
SECRET_LENGTH = 40
_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True)
class NewKey:
    plaintext: str
    prefix: str
    digest: str


def key_digest(plaintext: str) -> str:
    return hmac.new(settings.API_KEY_HMAC_KEY.encode(), plaintext.encode(), hashlib.sha256).hexdigest()


def key_generate(scheme: str = KEY_SCHEME) -> NewKey:
    """A new credential ``<scheme>_<prefix>_<secret>``: tenant API keys (``gpk``), and every other
    secret the platform hands out in the same form (the operators' staff tokens, ``gps``)."""
    prefix = "".join(secrets.choice(_ALPHABET) for _ in range(PREFIX_LENGTH))
    secret = "".join(secrets.choice(_ALPHABET) for _ in range(SECRET_LENGTH))
    plaintext = f"{scheme}_{prefix}_{secret}"
    return NewKey(plaintext=plaintext, prefix=prefix, digest=key_digest(plaintext))


def key_prefix(plaintext: str, scheme: str = KEY_SCHEME) -> str | None:
    """The lookup prefix of a well-formed credential of ``scheme``, or None for anything else."""
    parts = plaintext.split("_")
    if len(parts) != 3 or parts[0] != scheme:
        return None
    prefix, secret = parts[1], parts[2]
    if len(prefix) != PREFIX_LENGTH or len(secret) != SECRET_LENGTH:
        return None
    if not (prefix.isalnum() and secret.isalnum() and prefix.isascii() and secret.isascii()):
        return None
    return prefix


def digests_match(expected: str, plaintext: str) -> bool:
    return hmac.compare_digest(expected, key_digest(plaintext))
