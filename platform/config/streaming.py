"""The last part of a streamed response, which the inference API's ASGI handler (config/asgi.py)
sends in the message that ends the body."""


class FinalPart(bytes):
    """A streamed response's last part. uvicorn writes every body message to the socket at once and
    the chunked encoding's terminator with the message that ends the body; Django's handler ends a
    streamed body with an empty message of its own, a write (and, on a busy core, a wake-up of the
    client) per response for five bytes. Sent as the ending message, the part and the terminator go
    out in one write."""
