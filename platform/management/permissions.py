"""Two kinds of caller: operators (active staff) see everything; a tenant admin sees its own tenant."""

from rest_framework.permissions import BasePermission

from management.authentication import TenantAdmin
from tenants.models import Tenant


def is_operator(user) -> bool:
    return bool(getattr(user, "is_authenticated", False) and user.is_active and user.is_staff)


def is_tenant_admin(user) -> bool:
    return isinstance(user, TenantAdmin)


def tenants_visible(user):
    """Every tenant for an operator; only its own for a tenant admin. Lookups outside it are 404."""
    if is_operator(user):
        return Tenant.objects.all()
    if is_tenant_admin(user):
        return Tenant.objects.filter(pk=user.tenant.pk)
    return Tenant.objects.none()


class OperatorOrTenantAdmin(BasePermission):
    message = "Use an operator session or staff token, or a tenant admin API key."

    def has_permission(self, request, view):
        return is_operator(request.user) or is_tenant_admin(request.user)
