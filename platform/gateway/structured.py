"""Validation of the request fields that constrain or parse the output: `response_format`, `tools`,
`tool_choice`, `parallel_tool_calls`, tool calls and tool results in the history, `logit_bias`.

Structured outputs and forced tool calls become one JSON schema the engine enforces while it
decodes (vLLM's structured outputs, xgrammar backend), so even a model that would never produce
JSON on its own returns JSON that validates. A schema is compiled into a grammar on the worker,
where a hostile one could stall the engine's grammar threads: it is bounded here first, in size, in
the repetition counts and pattern quantifiers that make a grammar grow, and in the string length
bounds that make its compile slow (MAX_SCHEMA_BYTES, MAX_REPETITION, MAX_STRING_LENGTH_BOUNDS), and
checked against the JSON Schema meta-schema, so an invalid one is a 400 naming
its param rather than an engine error.
"""

import json
import re
from dataclasses import dataclass

from gateway.errors import InvalidRequest

MAX_SCHEMA_BYTES = 16 * 1024
# Upper bound of minItems/maxItems/minLength/maxLength/minProperties/maxProperties and of a pattern's
# {n,m} quantifiers: a grammar unrolls such counts, so its size (and compile time) grows with them.
MAX_REPETITION = 256
MAX_PATTERN_CHARS = 512
# The distinct minLength/maxLength values of a schema's strings, summed, at most: xgrammar compiles a
# bounded JSON string into a grammar whose token masks it precomputes per length, so the compile
# time grows with each distinct bound times the vocabulary. Measured with a 262,144-token
# vocabulary (gemma-4-E4B-it's size) on this 2-core machine: maxLength 16 2.2 s, 64 7.8 s, 256 15.5 s,
# 300 properties of maxLength 256 64 s; a `pattern` such as ^.{0,256}$ 0.05 s.
MAX_STRING_LENGTH_BOUNDS = 64
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128
_REPETITION_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# A forced call with no declared parameters: an empty object.
_NO_PARAMETERS = {"type": "object", "properties": {}}


def _invalid(message: str, param: str, code: str = "invalid_value") -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)


def check_schema(schema, param: str) -> dict:
    """`schema` if it is a JSON Schema within this server's bounds; else a 400 naming `param`."""
    if not isinstance(schema, dict):
        raise _invalid(f"'{param}' must be a JSON Schema object.", param, "invalid_type")
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_BYTES:
        raise _invalid(f"'{param}' is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} are accepted.", param)
    _check_bounds(schema, param)
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(part) for part in exc.path) or "(root)"
        raise _invalid(f"'{param}' is not a valid JSON Schema at {where}: {exc.message}", param) from None
    return schema


def _check_bounds(schema: dict, param: str) -> None:
    """Repetition counts, string length bounds and pattern quantifiers, anywhere in the schema
    (iteratively: the body's depth is bounded already, but no recursion is needed)."""
    lengths = _string_length_bounds(schema)
    if sum(lengths) > MAX_STRING_LENGTH_BOUNDS:
        raise _invalid(
            f"'{param}': the distinct minLength/maxLength values of its strings sum to {sum(lengths)}; at most "
            f"{MAX_STRING_LENGTH_BOUNDS} are accepted (each costs grammar compile time). A 'pattern' such as "
            "'^.{0,200}$' bounds a string's length at a fraction of the cost.",
            param,
        )
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for keyword in _REPETITION_KEYWORDS:
            value = node.get(keyword)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_REPETITION:
                raise _invalid(f"'{param}': '{keyword}' is {value}; at most {MAX_REPETITION} is accepted.", param)
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            _check_pattern(pattern, param)
        pending.extend(value for value in node.values() if isinstance(value, dict | list))


def _string_length_bounds(schema) -> set[int]:
    bounds: set[int] = set()
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
        elif isinstance(node, dict):
            for keyword in ("minLength", "maxLength"):
                value = node.get(keyword)
                if isinstance(value, int) and not isinstance(value, bool):
                    bounds.add(value)
            pending.extend(value for value in node.values() if isinstance(value, dict | list))
    return bounds


def _check_pattern(pattern: str, param: str) -> None:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise _invalid(f"'{param}': a 'pattern' has {len(pattern)} characters; at most {MAX_PATTERN_CHARS}.", param)
    for low, high in _QUANTIFIER.findall(pattern):
        if int(low) > MAX_REPETITION or (high and int(high) > MAX_REPETITION):
            raise _invalid(f"'{param}': a 'pattern' repeats more than {MAX_REPETITION} times.", param)
    try:
        re.compile(pattern)
    except re.error as exc:
        raise _invalid(f"'{param}': a 'pattern' is not a valid regular expression: {exc}", param) from None


def response_format(value) -> dict | None:
    """The engine's structured-output constraint for `response_format`, or None (plain text)."""
    param = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _invalid("'response_format' must be an object with a 'type'.", param, "invalid_type")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise _invalid(
            f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
            "response_format.type",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _invalid("'response_format.json_schema' must be an object.", param, "invalid_type")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _invalid("'response_format.json_schema.name' must match ^[a-zA-Z0-9_-]{1,64}$.", param)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _invalid("'response_format.json_schema.strict' must be a boolean.", param, "invalid_type")
    if spec.get("schema") is None:
        return {"json_object": True}
    # Strict or not, the engine enforces the schema (a model is never allowed to stray from it).
    return {"json": check_schema(spec["schema"], param)}


def logit_bias(value, most: int) -> dict[str, float] | None:
    """`logit_bias` as token id (a decimal string, as JSON keys are) -> bias in [-100, 100]."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > most:
        raise _invalid(f"'logit_bias' must be an object of at most {most} token ids.", "logit_bias")
    for token, bias in value.items():
        number = isinstance(bias, int | float) and not isinstance(bias, bool)
        if not (token.isascii() and token.isdigit()) or len(token) > 9 or not number or not -100 <= bias <= 100:
            raise _invalid("'logit_bias' maps token ids (decimal strings) to numbers in [-100, 100].", "logit_bias")
    return {str(int(token)): float(bias) for token, bias in value.items()} or None


@dataclass(frozen=True)
class ToolSpec:
    definitions: list[dict] | None = None  # for the chat template
    mode: str = ""  # "", "auto", "required", "named"
    name: str | None = None  # the named tool
    schema: dict | None = None  # what the engine enforces for a forced call


def chat_tools(body: dict) -> ToolSpec:
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _invalid("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls", "invalid_type")
    if tools is None:
        if choice not in (None, "none"):
            raise _invalid("'tool_choice' is only allowed when 'tools' are given.", "tool_choice")
        return ToolSpec()
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise _invalid(f"'tools' must be an array of 1 to {MAX_TOOLS} tools.", "tools")
    functions = [_tool(i, tool) for i, tool in enumerate(tools)]
    names = [function["name"] for function in functions]
    if len(set(names)) != len(names):
        raise _invalid("'tools' holds two functions of the same name.", "tools")
    definitions = [{"type": "function", "function": function} for function in functions]
    if choice is None or choice == "auto":
        return ToolSpec(definitions, "auto")
    if choice == "none":
        return ToolSpec(definitions)
    if choice == "required":
        schema = _calls_schema(functions, single=parallel is False)
        _check_bounds(schema, "tools")  # all the tools' parameters in one grammar
        return ToolSpec(definitions, "required", schema=schema)
    name = _named_choice(choice)
    if name not in names:
        raise _invalid(f"'tool_choice' names the function {name!r}, which is not in 'tools'.", "tool_choice")
    parameters = functions[names.index(name)].get("parameters") or _NO_PARAMETERS
    return ToolSpec(definitions, "named", name, parameters)


def _named_choice(choice) -> str:
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _invalid(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}.",
            "tool_choice",
        )
    return function["name"]


def _tool(index: int, tool) -> dict:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise _invalid(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}.", where)
    function = tool["function"]
    unknown = set(function) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise _invalid(f"'{where}.function' has unknown fields: {', '.join(sorted(unknown))}.", where)
    if not isinstance(function.get("name"), str) or not _NAME.match(function["name"]):
        raise _invalid(f"'{where}.function.name' must match ^[a-zA-Z0-9_-]{{1,64}}$.", f"{where}.function.name")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise _invalid(f"'{where}.function.description' must be a string.", f"{where}.function.description")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise _invalid(f"'{where}.function.strict' must be a boolean.", f"{where}.function.strict")
    if function.get("parameters") is not None:
        check_schema(function["parameters"], f"{where}.function.parameters")
    return {key: value for key, value in function.items() if value is not None}


def _calls_schema(functions: list[dict], *, single: bool) -> dict:
    """A JSON array of calls, each {"name": <one of the tools>, "parameters": <its arguments>} (the
    shape vLLM's own server enforces for tool_choice "required")."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [function["name"]]},
                "parameters": function.get("parameters") or _NO_PARAMETERS,
            },
            "required": ["name", "parameters"],
            # Nothing beside the two: an open object would let a model add members without end.
            "additionalProperties": False,
        }
        for function in functions
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if single:
        schema["maxItems"] = 1
    return schema


def tool_message_fields(where: str, message: dict, result: dict) -> None:
    """Copy an assistant message's `tool_calls` and a tool message's `tool_call_id` into `result` (the
    message the chat template renders), validated; arguments as objects, as templates expect."""
    if result["role"] == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise _invalid(f"'{where}.tool_call_id' is required for a tool message.", f"{where}.tool_call_id")
        result["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            result["name"] = message["name"]
        return
    calls = message.get("tool_calls")
    if calls is None or result["role"] != "assistant":
        return
    if not isinstance(calls, list) or not 1 <= len(calls) <= MAX_TOOL_CALLS:
        raise _invalid(f"'{where}.tool_calls' must be an array of 1 to {MAX_TOOL_CALLS} calls.", f"{where}.tool_calls")
    result["tool_calls"] = [_history_call(f"{where}.tool_calls[{i}]", call) for i, call in enumerate(calls)]


def _history_call(where: str, call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if (
        not isinstance(function, dict)
        or not isinstance(call.get("id"), str)
        or not isinstance(function.get("name"), str)
        or not isinstance(function.get("arguments"), str)
    ):
        raise _invalid(
            f"'{where}' must be {{'id': str, 'type': 'function', 'function': {{'name': str, 'arguments': str}}}}.",
            where,
        )
    try:
        arguments = json.loads(function["arguments"]) if function["arguments"].strip() else {}
    except (ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        raise _invalid(f"'{where}.function.arguments' must be a JSON object.", f"{where}.function.arguments")
    return {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def name_tool_results(messages: list[dict]) -> None:
    """Give each tool message the name of the function whose call it answers (templates that render a
    result by function name need it; OpenAI's messages carry only the call id)."""
    names = {call["id"]: call["function"]["name"] for message in messages for call in message.get("tool_calls", ())}
    for message in messages:
        if message["role"] == "tool" and "name" not in message and message["tool_call_id"] in names:
            message["name"] = names[message["tool_call_id"]]
