"""Prompt tokenization in the gateway, with the served model's own tokenizer and chat template.

The gateway tokenizes so that admission knows the exact prompt size (context-length checks and
token reservations happen before anything is enqueued), and the worker receives token ids.
"""

import threading

from gateway.errors import InvalidRequest, ServiceUnavailable

_load_lock = threading.Lock()
_tokenizers: dict = {}  # model path -> tokenizer; at most a handful of models per deployment


def tokenizer_for(path: str):
    tokenizer = _tokenizers.get(path)  # no lock on the hot path: dict reads are atomic
    if tokenizer is not None:
        return tokenizer
    # transformers' loading is not thread-safe; the first request per model and process pays for it.
    with _load_lock:
        if path not in _tokenizers:
            try:
                from transformers import AutoTokenizer

                _tokenizers[path] = AutoTokenizer.from_pretrained(path)
            except Exception as exc:  # a missing or broken tokenizer is our fault, not the client's
                raise ServiceUnavailable(
                    f"The model's tokenizer cannot be loaded: {exc}", code="tokenizer_unavailable"
                ) from exc
        return _tokenizers[path]


def chat_prompt_ids(path: str, messages: list[dict]) -> list[int]:
    tokenizer = tokenizer_for(path)
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as exc:  # the template rejects e.g. a conversation that does not alternate roles
        raise InvalidRequest(f"The messages cannot be formatted for this model: {exc}", param="messages") from None
    return list(ids)


def completion_prompt_ids(path: str, prompt: str | list[int]) -> list[int]:
    tokenizer = tokenizer_for(path)
    if isinstance(prompt, list):
        if max(prompt) >= len(tokenizer):
            raise InvalidRequest("'prompt' holds a token id outside the vocabulary.", param="prompt")
        return prompt
    return list(tokenizer.encode(prompt, add_special_tokens=True))


def preload_tokenizers() -> int:
    """Load the tokenizer of every enabled model now (a web process calls it before serving),
    so that no client request waits seconds for the first load. Returns how many were loaded."""
    from catalog.models import ServedModel

    loaded = 0
    for path in set(ServedModel.objects.filter(is_enabled=True).values_list("path", flat=True)):
        tokenizer_for(path)
        loaded += 1
    return loaded
