"""Hypothesis strategies for JSON-ish request bodies: arbitrary nesting, huge integer literals, NaN and
infinities, lone surrogates, wrong types; and the settings every fuzz test uses (deterministic, no
example database, modest example counts: the suite runs on 2 busy cores)."""

import json

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ = settings(
    derandomize=True,  # the same examples on every run: CI stays deterministic
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Raw(str):
    """A literal written into the body as is: what json.dumps cannot (or will not) write."""


def encode(value) -> bytes:
    """`value` as a request body; strings keep their lone surrogates as \\uXXXX escapes."""
    return _text(value).encode("utf-8")


def _text(value) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(key)}: {_text(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_text(item) for item in value) + "]"
    return json.dumps(value, allow_nan=True)


_SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d"])
texts = st.text(alphabet=st.characters() | _SURROGATES, max_size=12)
raw_literals = st.one_of(
    st.integers(min_value=1, max_value=6000).map(lambda digits: Raw("9" * digits)),
    st.sampled_from([Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"), Raw("1e-400")]),
    st.integers(min_value=1, max_value=3000).map(lambda depth: Raw("[" * depth + "]" * depth)),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    texts,
)
json_values = st.recursive(
    scalars | raw_literals,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4),
    max_leaves=10,
)


def body_with(fields: dict) -> st.SearchStrategy:
    """An object holding any of `fields` (name: strategy of a well-formed value), each either
    well-formed or any JSON-ish value, and now and then a field nobody knows."""
    return st.fixed_dictionaries(
        {},
        optional={name: strategy | json_values for name, strategy in fields.items()} | {"unknown_field": json_values},
    )


def bodies(fields: dict) -> st.SearchStrategy:
    """Request bodies: mostly objects (body_with), sometimes any JSON-ish value at all."""
    return st.one_of(body_with(fields), body_with(fields), json_values).map(encode)
