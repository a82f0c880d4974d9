"""Prompt tokenization in the gateway, with the served model's own tokenizer and chat template.

The gateway tokenizes so that admission knows the exact prompt size (context-length checks and
token reservations happen before anything is enqueued), and the worker receives token ids.
"""

import threading

from gateway import images
from gateway.errors import InvalidRequest, ServiceUnavailable

_load_lock = threading.Lock()
_tokenizers: dict = {}  # model path -> tokenizer; at most a handful of models per deployment
_longest_token: dict[str, int] = {}  # model path -> characters of its vocabulary's longest token


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


def chat_prompt_ids(path: str, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The rendered conversation's token ids; the tool definitions are part of it (the model's chat
    template renders them), so they count as prompt tokens."""
    tokenizer = tokenizer_for(path)
    try:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
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


def check_logit_bias(path: str, logit_bias: dict[str, float] | None) -> None:
    if logit_bias and max(int(token) for token in logit_bias) >= len(tokenizer_for(path)):
        raise InvalidRequest("'logit_bias' holds a token id outside the vocabulary.", param="logit_bias")


def prompt_tokens_at_least(path: str, *, messages: list[dict] | None, prompt: str | list[int] | None) -> int:
    """A lower bound of the prompt's token count, found without tokenizing it, so that admission can
    refuse an oversized prompt before paying for its tokenization.

    No token covers more characters of text than the longest token of the vocabulary (in byte-level
    BPE a token's string has a character per byte; a SentencePiece piece has a character per
    character). This holds for tokenizers that drop no characters of the text (byte-level BPE and
    SentencePiece drop none) and chat templates that keep each message's content, at most trimmed
    (Gemma's do)."""
    if isinstance(prompt, list):
        return len(prompt)
    if prompt is not None:
        chars = len(prompt)
    else:
        chars = sum(len(images.text_of(message["content"]).strip()) for message in messages or ())
    return -(-chars // _longest_token_chars(path))


def _longest_token_chars(path: str) -> int:
    longest = _longest_token.get(path)
    if longest is None:
        tokenizer = tokenizer_for(path)
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        longest = _longest_token[path] = max((len(piece) for piece in pieces if piece), default=1)
    return longest


def preload_tokenizers() -> int:
    """Load the tokenizer of every enabled model now (a web process calls it before serving),
    so that no client request waits seconds for the first load. Returns how many were loaded."""
    from catalog.models import ServedModel

    loaded = 0
    for path in set(ServedModel.objects.filter(is_enabled=True).values_list("path", flat=True)):
        tokenizer_for(path)
        _longest_token_chars(path)
        loaded += 1
    return loaded
