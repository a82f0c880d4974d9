"""A LiteLLM proxy in front of the bare engine: what most users would pick instead of the platform.

LiteLLM's pins clash with vLLM's, so it lives in its own virtual environment, ``.venv-litellm``,
created on first use with ``litellm[proxy]`` (LITELLM_VERSION). It runs in master-key mode: LiteLLM's
virtual keys (its per-tenant keys, budgets and rate limits, the part comparable to the platform's
admission) need its Prisma database layer, which downloads engine binaries at run time and cannot
start on machines without access to them. So the comparison is with LiteLLM's lightest mode: one
master key, no database, no per-key accounting; the platform does key checks, usage ledger and
per-tenant isolation on every request.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

from benchmarks.procs import ROOT, STATE_DIR, Child, free_port

# 1.106.12 is the newest litellm whose [proxy] extra installs from PyPI here (later ones pin
# litellm-proxy / litellm-proxy-extras releases that are not published).
LITELLM_VERSION = "1.106.12"
VENV = ROOT / ".venv-litellm"
START_TIMEOUT_S = 300


def ensure_venv() -> Path:
    """The ``litellm`` command of .venv-litellm, creating the environment on first use."""
    command = VENV / "bin" / "litellm"
    marker = VENV / f".litellm-{LITELLM_VERSION}"
    if command.exists() and marker.exists():
        return command
    print(f"bench: installing litellm[proxy]=={LITELLM_VERSION} into {VENV} (first run only)", flush=True)
    # The base interpreter of this venv: a venv made from a venv's python would chain to it.
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", str(VENV)], check=True)
    subprocess.run(
        [str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", f"litellm[proxy]=={LITELLM_VERSION}"],
        check=True,
    )
    marker.touch()
    return command


def proxy_config(model_name: str, upstream_base_url: str, master_key: str) -> dict:
    """LiteLLM config: one model routed to the vLLM server, master-key auth, no database."""
    return {
        "model_list": [
            {
                "model_name": model_name,
                "litellm_params": {
                    # hosted_vllm passes vLLM's extra sampling parameters (ignore_eos) through.
                    "model": f"hosted_vllm/{model_name}",
                    "api_base": upstream_base_url,
                    "api_key": "none",
                },
            }
        ],
        "litellm_settings": {"drop_params": False, "telemetry": False, "set_verbose": False},
        "general_settings": {"master_key": master_key},
    }


class LiteLLMProxy:
    """The proxy on a free local port; ``base_url`` ends in /v1, ``api_key`` is the master key."""

    def __init__(self, model_name: str, upstream_base_url: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        # LiteLLM refuses a weak master key; it must start with "sk-".
        self.api_key = "sk-" + secrets.token_urlsafe(32)
        self.model_name, self.upstream = model_name, upstream_base_url
        self.child: Child | None = None

    def __enter__(self) -> LiteLLMProxy:
        command = ensure_venv()
        config_path = STATE_DIR / "litellm.json"  # YAML is a superset of JSON
        config_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(json.dumps(proxy_config(self.model_name, self.upstream, self.api_key)))
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "VIRTUAL_ENV")}
        # No network here: use the bundled model cost map instead of fetching it at start.
        env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR", PYTHONUNBUFFERED="1")
        argv = [str(command), "--config", str(config_path), "--host", "127.0.0.1", "--port", str(self.port),
                "--num_workers", "1", "--telemetry", "False"]  # fmt: skip
        self.child = Child("litellm", argv, env).start()
        try:
            self.child.wait_http(f"http://127.0.0.1:{self.port}/health/liveliness", START_TIMEOUT_S)
        except BaseException:
            self.child.stop()
            raise
        return self

    def pause(self) -> None:
        if self.child is not None:
            self.child.pause()

    def resume(self) -> None:
        if self.child is not None:
            self.child.resume()
            self.child.wait_http(f"http://127.0.0.1:{self.port}/health/liveliness", 60)

    def __exit__(self, *exc: object) -> None:
        if self.child is not None:
            self.child.stop()
