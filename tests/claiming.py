"""A worker's claim of one request (the script of workers/claims.py), made synchronously: for tests
that play a worker's part over Redis."""

from contract import protocol
from workers.claims import CLAIM_SCRIPT, claim_keys


def claim_request(client, rid: str, worker: str) -> str | None:
    """What the worker's claim of ``rid`` returns: its input, or None where there was none to take."""
    [raw] = client.eval(CLAIM_SCRIPT, 2, *claim_keys([rid]), worker, protocol.REQUEST_TTL)
    return raw
