"""A round-robin HTTP proxy in front of several OpenAI-compatible servers (the fleet bench's bare side).

    python -m benchmarks.round_robin --port 9000 --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002

Each request goes to the next backend in turn, whatever it asks; the reply (a streamed one too) is
relayed chunk by chunk as it comes. It is what a plain Kubernetes Service in front of several vLLM
servers does (kube-proxy picks an endpoint per connection), per request rather than per connection,
so that a client's keep-alive connection does not pin it to one engine.
"""

from __future__ import annotations

import argparse
import itertools

import aiohttp
from aiohttp import web

# Hop-by-hop headers, and those aiohttp sets itself for the relayed body.
_SKIPPED = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host"}


def make_app(backends: list[str]) -> web.Application:
    """The proxy as an aiohttp application; ``backends`` are base URLs (scheme, host and port)."""
    turn = itertools.cycle([backend.rstrip("/") for backend in backends])
    app = web.Application(client_max_size=64 * 2**20)

    async def session_context(app: web.Application):
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        app["session"] = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        yield
        await app["session"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        url = next(turn) + request.rel_url.path_qs
        headers = {name: value for name, value in request.headers.items() if name.lower() not in _SKIPPED}
        body = await request.read()
        session: aiohttp.ClientSession = request.app["session"]
        async with session.request(request.method, url, headers=headers, data=body) as upstream:
            response = web.StreamResponse(status=upstream.status)
            for name, value in upstream.headers.items():
                if name.lower() not in _SKIPPED:
                    response.headers[name] = value
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app.cleanup_ctx.append(session_context)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", action="append", required=True, help="a backend's base URL (repeat)")
    args = parser.parse_args(argv)
    web.run_app(make_app(args.backend), host=args.host, port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
