from django.contrib import admin

from tenants.models import ApiKey, Tenant


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["name", "display_name", "is_active", "created_at"]
    search_fields = ["name", "display_name"]
    list_filter = ["is_active"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "tenant", "name", "created_at", "expires_at", "revoked_at", "last_used_at"]
    search_fields = ["prefix", "tenant__name", "name"]
    list_select_related = ["tenant"]
    # The digest is not a secret one can use, but nobody needs to edit it by hand.
    readonly_fields = ["prefix", "digest", "created_at", "last_used_at"]
