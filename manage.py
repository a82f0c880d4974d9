#!/usr/bin/env python
"""Django's command-line utility for the control plane.

`platform/` is a source root, not a package: a top-level `platform` package would shadow the
standard library's `platform` module (see docs/architecture.md). It and the repository are on the
path of every interpreter of the virtual environment (`make venv` writes a .pth file; the images set
PYTHONPATH).

Settings come from the environment. When it names no database and a local stack (`make up`) has
saved its settings (`.run/settings.json`, or under `UP_STATE_DIR`), those are used, so an
operator's command in a second terminal talks to that stack.
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def _local_stack_settings() -> Path | None:
    if os.environ.get("DATABASE_URL") or os.environ.get("DATABASE_URL_FILE"):
        return None
    saved = Path(os.environ.get("UP_STATE_DIR") or ROOT / ".run") / "settings.json"
    if not saved.is_file():
        return None
    for name, value in json.loads(saved.read_text()).items():
        os.environ.setdefault(name, value)
    return saved


def _fail(message: str) -> None:
    print(f"manage.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    saved = _local_stack_settings()
    from django.core.management import execute_from_command_line
    from django.db import OperationalError

    from contract.env import ConfigError

    try:
        execute_from_command_line(sys.argv)
    except ConfigError as exc:
        missing = "must be set" in str(exc)
        _fail(
            f"{exc}; start the local stack (make up) or set DATABASE_URL, REDIS_URL and SECRET_KEY"
            if missing
            else str(exc)
        )
    except OperationalError as exc:
        where = f"the local stack's database ({saved})" if saved else "the database (DATABASE_URL)"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _fail(f"cannot reach {where}: {first_line}" + ("; is make up running?" if saved else ""))


if __name__ == "__main__":
    main()
