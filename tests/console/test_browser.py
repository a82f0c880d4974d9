"""The console in a real browser (Debian chromium through Playwright) against the live stack:
gunicorn serving the console and its static files (whitenoise), a Celery worker running vLLM.

Screenshots go to SCREENSHOT_DIR when it is set (`SCREENSHOT_DIR=docs/screenshots` refreshes the
README's), else to the test's temporary folder.
"""

import os
import re
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.console.conftest import OPERATOR_PASSWORD, TENANT_ADMIN_PASSWORD
from tests.e2e.stack import ROOT

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
MODEL = "tiny-gemma4"


@pytest.fixture
def stack(tiny_stack):
    return tiny_stack


@pytest.fixture
def shots(tmp_path):
    folder = Path(os.environ["SCREENSHOT_DIR"]) if os.environ.get("SCREENSHOT_DIR") else tmp_path
    folder = folder if folder.is_absolute() else ROOT / folder
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def browser(stack, monkeypatch):
    """A chromium page on the stack; fails the test if the page asked any other origin for anything."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not found: install Debian's chromium (make test-deps)")
    # Playwright's sync API keeps an asyncio loop in this thread; the test's own ORM calls are synchronous.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    from playwright.sync_api import sync_playwright

    origin = urlparse(stack.base_url).netloc
    foreign = []
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = chromium.new_context(viewport={"width": 1280, "height": 860}, base_url=stack.base_url)
        page = context.new_page()
        page.on("request", lambda request: urlparse(request.url).netloc != origin and foreign.append(request.url))
        errors = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        # A Content-Security-Policy violation is reported on the console, not as a page error.
        page.on("console", lambda msg: msg.type == "error" and "Content Security Policy" in msg.text
                and errors.append(msg.text))  # fmt: skip
        yield page
        chromium.close()
    assert foreign == [], f"the console fetched from another origin: {foreign}"
    assert errors == [], f"JavaScript errors: {errors}"


def sign_in(page, username: str, password: str) -> None:
    page.goto("/console/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    page.wait_for_load_state()
    assert "/console/login/" not in page.url, page.inner_text("main")


def chat(stack, key: str, content: str) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 24},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def wait_for_ledger(tenant_name: str, count: int, timeout: float = 20.0) -> None:
    from ledger.models import UsageRecord

    deadline = time.monotonic() + timeout
    while UsageRecord.objects.filter(tenant__name=tenant_name).count() < count:
        assert time.monotonic() < deadline, f"fewer than {count} ledger rows for {tenant_name}"
        time.sleep(0.2)


def chart_points(page, canvas_id: str) -> list[float]:
    page.wait_for_function(f"() => window.Chart && Chart.getChart('{canvas_id}')")
    return page.evaluate(f"() => Chart.getChart('{canvas_id}').data.datasets.flatMap(d => d.data)")


def test_an_operator_creates_a_tenant_and_key_sees_its_usage_and_revokes_it(stack, browser, shots, django_user_model):
    page = browser
    django_user_model.objects.create_user("ops", password=OPERATOR_PASSWORD, is_staff=True)
    sign_in(page, "ops", OPERATOR_PASSWORD)
    assert page.url.endswith("/console/overview/")
    page.wait_for_selector("text=ready")  # the live worker's engine state, from Redis

    page.click("nav.mainnav >> text=Tenants")
    page.click("text=New tenant")
    page.fill("#id_name", "alice")
    page.fill("#id_display_name", "Alice Research")
    page.click("button:has-text('Create tenant')")
    assert page.url.endswith("/console/tenants/alice/keys/")

    page.fill("#id_name", "notebook")
    page.click("button:has-text('Create key')")
    secret = page.inner_text("[data-testid=new-key-secret]").strip()
    assert re.fullmatch(r"gpk_[A-Za-z0-9]{12}_[A-Za-z0-9]{40}", secret)
    page.screenshot(path=shots / "key-created.png", full_page=True)
    prefix = secret.split("_")[1]

    # Afterwards only the prefix: not on the list, not on a reload of the creation page.
    page.goto("/console/tenants/alice/keys/")
    assert prefix in page.content() and secret not in page.content()
    assert secret.split("_")[2] not in page.content()

    for content in ("Tell me about the sea.", "Write a haiku.", "What is 2 + 2?"):
        reply = chat(stack, secret, content)
        assert reply.status_code == 200, reply.text
    wait_for_ledger("alice", 3)

    page.goto("/console/overview/")
    assert float(page.inner_text("[data-testid=rps]")) > 0
    page.screenshot(path=shots / "overview.png", full_page=True)

    page.goto("/console/tenants/alice/usage/?period=1h")
    assert page.inner_text("[data-testid=usage-requests]") == "3"
    tokens = chart_points(page, "chart-tokens")
    assert sum(tokens) > 0
    requests = chart_points(page, "chart-requests")
    assert sum(requests) == 3
    assert any(value for value in chart_points(page, "chart-ttft") if value)
    assert page.locator("#model-table").inner_text().count(MODEL) == 1
    page.screenshot(path=shots / "usage.png", full_page=True)

    # A plan with prices, given to alice; then her invoice for this month, computed from the ledger.
    page.goto("/console/plans/new/")
    page.fill("#id_name", "pro")
    page.fill("#id_display_name", "Pro")
    page.fill("#id_rpm", "600")
    page.fill("#id_price_input", "0.15")
    page.fill("#id_price_output", "0.60")
    page.click("button:has-text('Save plan')")
    assert page.url.endswith("/console/plans/")
    page.screenshot(path=shots / "plans.png", full_page=True)
    page.goto("/console/tenants/alice/limits/")
    page.select_option("#id_plan", label="pro")
    page.click("button:has-text('Save limits')")
    assert "600" in page.locator("#limits-table").inner_text()
    page.screenshot(path=shots / "limits.png", full_page=True)
    page.goto("/console/tenants/alice/invoices/")
    page.click("button:has-text('Compute draft')")
    assert "/console/tenants/alice/invoices/alice-" in page.url
    assert "tiny-gemma4" in page.inner_text("main")
    page.screenshot(path=shots / "invoice.png", full_page=True)

    page.goto("/console/tenants/")
    page.fill("input[name=q]", "ali")
    page.wait_for_selector("#tenant-table >> text=alice")
    page.screenshot(path=shots / "tenants.png", full_page=True)
    page.goto("/console/tenants/alice/")
    page.screenshot(path=shots / "tenant-detail.png", full_page=True)

    page.goto("/console/tenants/alice/keys/")
    page.click(f"tr[data-prefix='{prefix}'] >> text=Revoke")
    page.click("button:has-text('Revoke key')")
    assert page.locator(f"tr[data-prefix='{prefix}'] .badge").inner_text().startswith("revoked")
    page.screenshot(path=shots / "keys.png", full_page=True)
    refused = chat(stack, secret, "Still there?")
    assert refused.status_code == 401
    assert "revoked" in refused.json()["error"]["message"]


def test_a_tenant_admin_sees_only_their_tenant(stack, browser, shots):
    from console.services import tenant_admin_create
    from quotas.services import tenant_quota_set
    from tenants.services import apikey_create, tenant_create

    page = browser
    alice, bob = tenant_create(name="alice"), tenant_create(name="bob")
    alice_key, _ = apikey_create(tenant=alice, name="alice-prod")
    bob_key, bob_plaintext = apikey_create(tenant=bob, name="bob-prod")
    tenant_admin_create(tenant=alice, username="alice-admin", password=TENANT_ADMIN_PASSWORD)
    tenant_admin_create(tenant=bob, username="bob-admin", password=TENANT_ADMIN_PASSWORD)

    # Bob may send one request a minute: his second is refused, and his admin can see why.
    tenant_quota_set(tenant=bob, rpm=1)
    assert chat(stack, bob_plaintext, "one").status_code == 200
    refused = chat(stack, bob_plaintext, "two")
    if refused.status_code == 200:  # "one" fell in the minute before: "two" began a new window
        refused = chat(stack, bob_plaintext, "three")
    assert refused.status_code == 429 and refused.headers["x-ratelimit-exceeded"] == "requests"

    sign_in(page, "bob-admin", TENANT_ADMIN_PASSWORD)
    assert page.url.endswith("/console/tenants/bob/")
    assert page.goto("/console/tenants/bob/keys/").status == 200
    assert "bob-prod" in page.content() and "alice-prod" not in page.content()
    page.screenshot(path=shots / "tenant-admin-keys.png", full_page=True)
    page.click("nav.subnav >> text=Throttling")
    row = page.locator("#throttle-table tbody tr").first
    assert bob_key.prefix in row.inner_text() and "requests per minute (RPM)" in row.inner_text()
    page.screenshot(path=shots / "throttling.png", full_page=True)

    for url in [
        "/console/tenants/alice/",
        "/console/tenants/alice/keys/",
        "/console/tenants/alice/usage/",
        f"/console/tenants/alice/keys/{alice_key.id}/revoke/",
        f"/console/tenants/bob/keys/{alice_key.id}/revoke/",
        "/console/overview/",
        "/console/tenants/",
        "/console/usage/",
    ]:
        assert page.goto(url).status == 404, url
    assert page.locator("nav.mainnav a").count() == 0  # no operator navigation at all
