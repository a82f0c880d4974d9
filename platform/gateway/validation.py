"""Validation of OpenAI request bodies into small typed objects; every failure names its `param`."""

import math
from dataclasses import dataclass, field

from core.strictjson import strict_json_loads
from gateway import images, structured
from gateway.errors import InvalidRequest

# Fields OpenAI defines that this platform does not implement: a clear 400, never silence.
# (functions/function_call: the deprecated spelling of tools; best_of/echo/suffix: legacy completion
# options vLLM's V1 engine dropped; the rest are OpenAI platform features with no engine behind them.)
_UNSUPPORTED = {
    "functions", "function_call", "best_of", "echo", "suffix", "audio", "modalities",
    "prediction", "web_search_options", "reasoning_effort", "service_tier", "store", "metadata",
}  # fmt: skip
_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream", "stream_options",
    "user", "presence_penalty", "frequency_penalty", "logprobs", "ignore_eos", "logit_bias",
}  # fmt: skip
_CHAT_ONLY = {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls",
}  # fmt: skip
_COMPLETION_ONLY = {"prompt"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 8  # n
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat; completions' `logprobs` allows 5
MAX_COMPLETION_LOGPROBS = 5
MAX_LOGIT_BIAS = 300  # entries, as OpenAI


@dataclass
class InferenceRequest:
    kind: str  # "chat" | "completion"
    model: str
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    sampling: dict = field(default_factory=dict)  # temperature, top_p, stop, seed, penalties, ignore_eos
    n: int = 1
    # Top alternatives per token to return (0: the chosen token's logprob only); None: no logprobs.
    logprobs: int | None = None
    # StructuredOutputsParams fields for the engine ({"json": schema} or {"json_object": True}).
    structured: dict | None = None
    tools: list[dict] | None = None  # function definitions as the chat template takes them
    # How the worker reads tool calls from the output: "" none, "auto" (the model's own syntax),
    # "required" (a guided JSON array of calls), "named" (guided arguments of `tool_name`).
    tool_mode: str = ""
    tool_name: str | None = None


def parse_json_body(raw: bytes) -> dict:
    body = strict_json_loads(raw)
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    return body


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(body: dict, name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    # A range test that NaN (false in every comparison) fails, as it must.
    in_range = _is_number(value) and math.isfinite(value) and low <= value <= high
    if not in_range or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise InvalidRequest(f"'{name}' must be a number in {bound}, got {value!r}.", param=name, code="invalid_value")
    return float(value)


def _positive_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise InvalidRequest(f"'{name}' must be a positive integer, got {value!r}.", param=name, code="invalid_value")
    return value


def _check_fields(body: dict, allowed: set[str]) -> None:
    for name in body:
        if name in _UNSUPPORTED:
            raise InvalidRequest(f"'{name}' is not supported by this server.", param=name, code="unsupported_parameter")
        if name not in allowed:
            raise InvalidRequest(
                f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter"
            )


def _stop(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list)
        or not 1 <= len(stop) <= MAX_STOP_SEQUENCES
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise InvalidRequest(
            f"'stop' must be a non-empty string or a list of 1 to {MAX_STOP_SEQUENCES} non-empty strings.",
            param="stop",
            code="invalid_value",
        )
    return stop


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean.", param="stream", code="invalid_type")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise InvalidRequest(
            "'stream_options' is only allowed when 'stream' is true.", param="stream_options", code="invalid_value"
        )
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise InvalidRequest(
            "'stream_options' must be an object with only 'include_usage'.",
            param="stream_options",
            code="invalid_value",
        )
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise InvalidRequest(
            "'stream_options.include_usage' must be a boolean.",
            param="stream_options.include_usage",
            code="invalid_type",
        )
    return stream, include_usage


def _sampling(body: dict) -> dict:
    sampling = {
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": _number(body, "top_p", 0.0, 1.0, low_open=True),
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0),
        "stop": _stop(body),
    }
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**63):
        raise InvalidRequest("'seed' must be a 64-bit integer.", param="seed", code="invalid_value")
    sampling["seed"] = seed
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise InvalidRequest("'ignore_eos' must be a boolean.", param="ignore_eos", code="invalid_type")
    sampling["ignore_eos"] = ignore_eos
    return {name: value for name, value in sampling.items() if value is not None}


def _common(body: dict) -> dict:
    model = body.get("model")
    if model is None:
        raise InvalidRequest("You must provide a model parameter.", param="model", code="missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string.", param="model", code="invalid_type")
    n = body.get("n")
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest(
            f"'n' must be an integer in [1, {MAX_CHOICES}], got {n!r}.", param="n", code="invalid_value"
        )
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("'user' must be a string.", param="user", code="invalid_type")
    stream, include_usage = _stream_flags(body)
    sampling = _sampling(body)
    logit_bias = structured.logit_bias(body.get("logit_bias"), MAX_LOGIT_BIAS)
    if logit_bias:
        sampling["logit_bias"] = logit_bias
    return {"model": model, "stream": stream, "include_usage": include_usage, "sampling": sampling, "n": n}


def _message(index: int, message) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequest(f"'{where}' must be an object.", param=where, code="invalid_type")
    role = message.get("role")
    if role not in _ROLES:
        raise InvalidRequest(
            f"'{where}.role' must be one of {sorted(_ROLES)}, got {role!r}.",
            param=f"{where}.role",
            code="invalid_value",
        )
    content = message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        content = ""
    if isinstance(content, list):
        # Text parts joined; with an image part, the parts themselves (gateway/images.py).
        content = images.message_content(where, role, content)
    if not isinstance(content, str | list):
        raise InvalidRequest(f"'{where}.content' must be a string.", param=f"{where}.content", code="invalid_type")
    # Gemma's chat template knows system, user and assistant; OpenAI's "developer" is a system message.
    result = {"role": "system" if role == "developer" else role, "content": content}
    structured.tool_message_fields(where, message, result)
    return result


def chat_request(body: dict) -> InferenceRequest:
    _check_fields(body, _COMMON | _CHAT_ONLY)
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest("'messages' is required.", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array.", param="messages", code="invalid_value")
    max_tokens = _positive_int(body, "max_completion_tokens")
    legacy = _positive_int(body, "max_tokens")
    parsed = [_message(i, m) for i, m in enumerate(messages)]
    images.check_count(parsed)
    structured.name_tool_results(parsed)
    tools = structured.chat_tools(body)
    request = InferenceRequest(
        kind="chat",
        messages=parsed,
        max_tokens=max_tokens if max_tokens is not None else legacy,
        logprobs=_chat_logprobs(body),
        tools=tools.definitions,
        tool_mode=tools.mode,
        tool_name=tools.name,
        **_common(body),
    )
    response_format = structured.response_format(body.get("response_format"))
    if tools.schema is not None and response_format is not None:
        raise InvalidRequest(
            "'response_format' cannot be combined with a 'tool_choice' that forces a tool call.",
            param="response_format",
            code="invalid_value",
        )
    request.structured = {"json": tools.schema} if tools.schema is not None else response_format
    return request


def _chat_logprobs(body: dict) -> int | None:
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidRequest("'logprobs' must be a boolean.", param="logprobs", code="invalid_type")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}].", param="top_logprobs",
                code="invalid_value",
            )  # fmt: skip
        if not logprobs:
            raise InvalidRequest(
                "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs", code="invalid_value"
            )
    return (top or 0) if logprobs else None


def _completion_logprobs(body: dict) -> int | None:
    logprobs = body.get("logprobs")
    if logprobs is None:
        return None
    if not _is_int(logprobs) or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise InvalidRequest(
            f"'logprobs' must be an integer in [0, {MAX_COMPLETION_LOGPROBS}].", param="logprobs",
            code="invalid_value",
        )  # fmt: skip
    return logprobs


def completion_request(body: dict) -> InferenceRequest:
    _check_fields(body, _COMMON | _COMPLETION_ONLY)
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidRequest("'prompt' is required.", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    valid_ids = isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not valid_ids:
        raise InvalidRequest(
            "'prompt' must be a non-empty string or array of token ids (one prompt per request).",
            param="prompt",
            code="invalid_value",
        )
    return InferenceRequest(
        kind="completion", prompt=prompt, max_tokens=_positive_int(body, "max_tokens"),
        logprobs=_completion_logprobs(body), **_common(body),
    )  # fmt: skip
