"""Clear cached auth records whenever a key or tenant row changes, whoever changes it.

The services, the Django admin and a shell all save through the ORM, so these hooks are the one
place that keeps the Redis cache (`tenants.auth_cache`) in step with PostgreSQL. They act after the
transaction commits: cleared earlier, a concurrent lookup could re-cache the old row. Bulk
`QuerySet.update()` sends no signal; code that uses one on these columns must clear the cache itself.
"""

from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from tenants.models import ApiKey, Tenant
from tenants.services import apikey_cache_forget_on_commit


@receiver(post_save, sender=ApiKey, dispatch_uid="tenants.apikey_saved")
@receiver(post_delete, sender=ApiKey, dispatch_uid="tenants.apikey_deleted")
def _apikey_changed(sender, instance: ApiKey, **kwargs) -> None:
    apikey_cache_forget_on_commit(prefixes=[instance.prefix])


@receiver(post_save, sender=Tenant, dispatch_uid="tenants.tenant_saved")
def _tenant_changed(sender, instance: Tenant, created: bool, **kwargs) -> None:
    # Every key's record carries its tenant's name and state. (A deleted tenant's keys are deleted
    # with it, one post_delete each.)
    if not created:
        prefixes = list(ApiKey.objects.filter(tenant=instance).values_list("prefix", flat=True))
        apikey_cache_forget_on_commit(prefixes=prefixes)
