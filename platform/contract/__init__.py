"""What the gateway and the workers share: the one package of platform/ that both sides import.

- `protocol`: the Redis protocol of a request (keys, `RequestInput`, `Usage`, workers' records).
- `task`: the Celery task message of an inference request, which the gateway pushes itself.
- `settle`: the settle of a request's quota reservation (Lua), run by both sides.
- `adapter_store`: tenants' adapter files, written by the control plane, read by the workers.
- `outage`: which Redis errors mean an outage, and retrying through one.
- `env`: typed readers of configuration from environment variables (`<NAME>_FILE` too).
- `heap`: keeping a serving process's start-up objects out of the garbage collector's full passes.

It imports nothing else of platform/ and no Django, so a worker process runs without the control plane's
settings (tests/test_layers.py holds both rules).
"""
