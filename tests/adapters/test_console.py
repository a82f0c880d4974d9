"""The console's adapters page: a tenant admin uploads, sees and deletes its adapters; another
tenant's admin gets a 404; a bad file is refused on the form and stores nothing."""

import io

import pytest

from adapters.models import Adapter
from tests.adapters.conftest import BASE, stored_files
from tests.adapters.lora import lora_files
from tests.console.conftest import tenant_admins, tenants  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice_admin(client, tenant_admins, base_model, store_dir):  # noqa: F811
    client.force_login(tenant_admins["alice"])
    return client


def _post(client, files, name="support-bot"):
    config, weights = (io.BytesIO(data) for data in files)
    config.name, weights.name = "adapter_config.json", "adapter_model.safetensors"
    body = {"name": name, "base_model": BASE, "config": config, "weights": weights}
    return client.post("/console/tenants/alice/adapters/", data=body)


def test_a_tenant_admin_uploads_and_deletes_an_adapter_in_the_console(alice_admin, tenants, store_dir):  # noqa: F811
    reply = _post(alice_admin, lora_files())
    assert reply.status_code == 302, reply.content.decode()[:2000]
    page = alice_admin.get("/console/tenants/alice/adapters/").content.decode()
    assert f"{BASE}:support-bot" in page
    adapter = Adapter.objects.get(tenant=tenants["alice"])
    assert alice_admin.post(f"/console/tenants/alice/adapters/{adapter.id}/delete/").status_code == 302
    assert not Adapter.objects.exists()


def test_a_bad_file_is_refused_on_the_form_and_stores_nothing(alice_admin, store_dir):
    config, weights = lora_files()
    reply = _post(alice_admin, (config, weights[:-100]))
    assert reply.status_code == 200 and "truncated" in reply.content.decode()
    assert not Adapter.objects.exists() and stored_files(store_dir) == []


def test_another_tenants_admin_gets_404(client, tenant_admins, tenants, base_model, store_dir):  # noqa: F811
    adapter = Adapter.objects.create(tenant=tenants["alice"], name="x", base_model=BASE, digest="ab" * 32, rank=8,
                                     size_bytes=1)  # fmt: skip
    client.force_login(tenant_admins["bob"])
    assert client.get("/console/tenants/alice/adapters/").status_code == 404
    assert client.post(f"/console/tenants/alice/adapters/{adapter.id}/delete/").status_code == 404
    assert client.post(f"/console/tenants/bob/adapters/{adapter.id}/delete/").status_code == 404
    assert Adapter.objects.filter(pk=adapter.pk).exists()
