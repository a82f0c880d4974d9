"""The console's front-end files: vendored as the manifest says, and nothing loaded from elsewhere."""

import hashlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONSOLE = ROOT / "platform" / "console"
VENDOR = CONSOLE / "static" / "console" / "vendor"


def test_vendored_files_are_the_ones_the_manifest_pins():
    manifest = json.loads((VENDOR / "VENDORED.json").read_text())
    assert set(manifest) == {"chart.js", "htmx.org"}
    for package in manifest.values():
        assert package["integrity"].startswith("sha512-")
        for name, sha256 in package["files"].items():
            assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == sha256, name


def test_no_template_or_script_refers_to_another_origin():
    external = re.compile(r"""(src|href|action)\s*=\s*["']?(https?:)?//""", re.IGNORECASE)
    files = list((CONSOLE / "templates").rglob("*.html")) + [CONSOLE / "static" / "console" / "console.js"]
    offenders = [str(path) for path in files if external.search(path.read_text())]
    assert offenders == []


@pytest.mark.django_db
def test_the_console_pages_load_the_vendored_libraries(client, operator):
    client.force_login(operator)
    page = client.get("/console/usage/").content.decode()
    assert 'src="/static/console/vendor/chart.umd.min.js"' in page
    assert 'src="/static/console/vendor/htmx.min.js"' in page
    csp = client.get("/console/usage/")["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "default-src 'self'" in csp
    script = client.get("/static/console/vendor/chart.umd.min.js")
    assert script.status_code == 200 and b"sourceMappingURL" not in b"".join(script.streaming_content)
