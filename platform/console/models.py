"""Who may use the console for which tenant.

Operators are Django staff users and see every tenant. A tenant admin is a (non-staff) Django user
with a TenantMembership: the console resolves their tenant from it and shows nothing else.
"""

from django.conf import settings
from django.db import models

from tenants.models import Tenant


class TenantMembership(models.Model):
    # One tenant per user keeps "which tenant am I acting for" unambiguous; a person who administers
    # two tenants gets two logins.
    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tenant_membership")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant__name", "user__username"]

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant}"
