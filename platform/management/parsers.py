"""The management API's JSON parser: the inference API's strict decoding (core/strictjson.py), so a
body nested too deep, a NaN, an overflowing number, a huge integer literal or a lone surrogate is a
400 in the API's error shape, never a 500 (DRF's own parser lets RecursionError and lone surrogates
through)."""

from django.conf import settings
from rest_framework import exceptions
from rest_framework.parsers import JSONParser

from core.errors import InvalidRequest
from core.strictjson import strict_json_loads


class StrictJSONParser(JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            raw = stream.read().decode(encoding)
        except UnicodeDecodeError as exc:
            raise exceptions.ParseError(f"JSON parse error - {exc}") from None
        try:
            return strict_json_loads(raw)
        except InvalidRequest as exc:
            if exc.param:
                raise exceptions.ValidationError({exc.param: [exc.message]}, code=exc.code) from None
            raise exceptions.ParseError(f"JSON parse error - {exc.message}") from None
