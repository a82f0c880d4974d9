"""The local stack's PostgreSQL and Redis: given URLs pass through, otherwise real embedded servers."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlparse

import psycopg
import pytest
import redis

from deploy.local.services import REPO_ROOT, ensure_services, port_open, stop_services


@pytest.fixture
def state_dir():
    # Not pytest's tmp_path: as root, PostgreSQL runs as an unprivileged user that must traverse to
    # its data folder, and pytest's base temp folder is private (0700).
    folder = Path(tempfile.mkdtemp(prefix="local-services-test-"))
    folder.chmod(0o755)
    yield folder
    stop_services(folder)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def no_urls(monkeypatch):
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)


def test_it_returns_the_urls_from_the_environment_untouched(monkeypatch, tmp_path):
    monkeypatch.setenv("DATABASE_URL", "postgres://someone@db.example:6543/gemma")
    monkeypatch.setenv("REDIS_URL", "redis://cache.example:6380/2")

    services = ensure_services(tmp_path / "state")

    assert dict(services) == {
        "DATABASE_URL": "postgres://someone@db.example:6543/gemma",
        "REDIS_URL": "redis://cache.example:6380/2",
    }
    assert services.started == []
    assert not (tmp_path / "state").exists()
    services.stop()  # nothing was started: nothing to stop, no error


def test_the_env_command_prints_export_lines_for_the_given_urls(tmp_path):
    env = {**os.environ, "DATABASE_URL": "postgres://u@h:1/d", "REDIS_URL": "redis://h:2/0"}
    result = subprocess.run(
        [sys.executable, "-m", "deploy.local.services", "--env", "--state-dir", str(tmp_path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.splitlines() == [
        "export DATABASE_URL=postgres://u@h:1/d",
        "export REDIS_URL=redis://h:2/0",
    ]


@pytest.mark.timeout(60)
def test_without_urls_it_starts_embedded_servers_reuses_them_and_keeps_their_data(state_dir, no_urls):
    with ensure_services(state_dir) as services:
        pg_port = urlparse(services["DATABASE_URL"]).port
        redis_port = urlparse(services["REDIS_URL"]).port
        assert [server.name for server in services.started] == ["postgres", "redis"]
        # Free ports of their own, not the machine's usual servers.
        assert len({pg_port, redis_port, 5432, 6379}) == 4
        with psycopg.connect(services["DATABASE_URL"], autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (value text)")
            conn.execute("INSERT INTO kept VALUES ('across runs')")
            assert conn.execute("SHOW server_version").fetchone()[0].startswith("18.")
        client = redis.Redis.from_url(services["REDIS_URL"])
        client.set("kept", "across runs")
        assert client.info()["redis_version"] >= "6.2"
        client.save()
        client.close()

        again = ensure_services(state_dir)  # a second run while the first is up: reuse, start nothing
        assert dict(again) == dict(services)
        assert again.started == []

    assert not port_open(pg_port)
    assert not port_open(redis_port)

    with ensure_services(state_dir) as restarted:
        assert [server.name for server in restarted.started] == ["postgres", "redis"]
        with psycopg.connect(restarted["DATABASE_URL"]) as conn:
            assert conn.execute("SELECT value FROM kept").fetchone() == ("across runs",)
        client = redis.Redis.from_url(restarted["REDIS_URL"])
        assert client.get("kept") == b"across runs"
        client.close()
        # The same ports again when they are still free: URLs stay stable across runs.
        assert urlparse(restarted["DATABASE_URL"]).port == pg_port
        assert urlparse(restarted["REDIS_URL"]).port == redis_port


@pytest.mark.timeout(60)
def test_the_run_command_sets_the_urls_for_its_command_and_stops_the_servers_after(state_dir, no_urls):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    probe = (
        "import os, psycopg, redis;"
        "print(psycopg.connect(os.environ['DATABASE_URL']).execute('SELECT 41 + 1').fetchone()[0]);"
        "print(redis.Redis.from_url(os.environ['REDIS_URL']).ping())"
    )
    result = subprocess.run(
        [sys.executable, "-m", "deploy.local.services", "--state-dir", str(state_dir), "--run", "--"]
        + [sys.executable, "-c", probe],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["42", "True"]
    assert stop_services(state_dir) == []  # already stopped by --run
