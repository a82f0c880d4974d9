"""JSON as RFC 8259 defines it, within limits, for every face that reads a JSON body (the inference
API's validation, the management API's parser): a body nested too deep, a NaN, an overflowing
number, a huge integer literal or a lone surrogate is an InvalidRequest (400), never a 500."""

import json
import math
from collections import deque

from core.errors import InvalidRequest

# A valid request nests 5 levels at most (body, messages, a message, its content parts, a part).
MAX_JSON_DEPTH = 32
# Far more than any field's range (64-bit at most) needs, and cheap to convert: Python refuses
# integer literals over 4300 digits with a ValueError of its own.
MAX_INTEGER_DIGITS = 100


def strict_json_loads(raw: bytes | str):
    """JSON as RFC 8259 defines it, within limits: no NaN/Infinity (Python's json accepts them), no
    number that overflows to infinity, no integer literal over MAX_INTEGER_DIGITS digits, no nesting
    deeper than MAX_JSON_DEPTH, and no lone UTF-16 surrogate in a string (no tokenizer or database
    encodes one). Each is an InvalidRequest; a lone surrogate's names the param that holds it."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant, parse_int=_bounded_int, parse_float=_finite_float)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise _too_deep() from None
    _check_depth_and_strings(value)
    return value


def _refuse_constant(name: str):
    raise InvalidRequest(f"The request body holds {name}, which is not a JSON number.", code="invalid_json")


def _bounded_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise InvalidRequest(
            f"The request body holds an integer literal of more than {MAX_INTEGER_DIGITS} digits.", code="invalid_json"
        )
    return int(literal)


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise InvalidRequest(f"The request body holds a number out of range ({literal[:40]}).", code="invalid_json")
    return value


def _too_deep() -> InvalidRequest:
    return InvalidRequest(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.", code="invalid_json")


def _check_depth_and_strings(value) -> None:
    """Breadth first, without recursion (so a deep value cannot exhaust the stack): the first problem
    found is the shallowest one."""
    pending = deque([(value, "", 1)])
    while pending:
        value, path, depth = pending.popleft()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key, path)
                    where = f"{path}.{key}" if path else key
                else:
                    where = f"{path}[{key}]"
                pending.append((item, where, depth + 1))


def _check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(
            f"'{param or 'body'}' holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape).",
            param=param or None,
            code="invalid_value",
        ) from None
