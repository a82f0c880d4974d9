"""Console fixtures: an operator, the tenants alice, bob and charlie, and a tenant admin for each."""

import pytest

OPERATOR_PASSWORD = "operator-pass-4d8f"
TENANT_ADMIN_PASSWORD = "tenant-pass-7c2e"


@pytest.fixture
def operator(django_user_model):
    return django_user_model.objects.create_user("ops", password=OPERATOR_PASSWORD, is_staff=True)


@pytest.fixture
def tenants(db):
    from tenants.services import tenant_create

    return {name: tenant_create(name=name, display_name=name.title()) for name in ("alice", "bob", "charlie")}


@pytest.fixture
def tenant_admins(tenants):
    from console.services import tenant_admin_create

    return {
        name: tenant_admin_create(tenant=tenant, username=f"{name}-admin", password=TENANT_ADMIN_PASSWORD)
        for name, tenant in tenants.items()
    }
