"""manage.py beside a local stack: it reads the settings `make up` saved, or fails in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.stack import database_url

REPO_ROOT = Path(__file__).resolve().parents[2]
PLATFORM_VARIABLES = ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "API_KEY_HMAC_KEY", "DJANGO_DEBUG", "DATABASE_POOL")


def _manage(state_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """manage.py in an environment that names no stack (as a second terminal), with `state_dir`
    as the local stack's state folder."""
    env = {name: value for name, value in os.environ.items() if name not in PLATFORM_VARIABLES}
    env.update(UP_STATE_DIR=str(state_dir))
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def _save(state_dir: Path, **settings: str) -> None:
    (state_dir / "settings.json").write_text(json.dumps(settings))


def test_with_no_stack_configured_a_command_fails_in_one_line(tmp_path):
    result = _manage(tmp_path, "createtenant", "acme")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "manage.py: SECRET_KEY must be set (or SECRET_KEY_FILE pointing to a file holding it); "
        "start the local stack (make up) or set DATABASE_URL, REDIS_URL and SECRET_KEY"
    ]


@pytest.mark.django_db(transaction=True)
def test_a_command_uses_the_settings_the_local_stack_saved(tmp_path):
    from django.conf import settings

    from tenants.models import Tenant

    _save(tmp_path, DATABASE_URL=database_url(settings.DATABASES["default"]), REDIS_URL=os.environ["REDIS_URL"],
          SECRET_KEY="saved-by-make-up", DATABASE_POOL="0")  # fmt: skip
    result = _manage(tmp_path, "createtenant", "acme")
    assert result.returncode == 0, result.stderr
    assert Tenant.objects.filter(name="acme").exists()


def test_a_stopped_local_stack_is_named_in_one_line(tmp_path):
    _save(tmp_path, DATABASE_URL="postgres://postgres@127.0.0.1:1/gone", REDIS_URL="redis://127.0.0.1:1/0",
          SECRET_KEY="saved-by-make-up", DATABASE_POOL="0")  # fmt: skip
    result = _manage(tmp_path, "createtenant", "acme")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("manage.py: cannot reach the local stack's database") and "is make up running?" in line
