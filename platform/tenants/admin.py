"""Django admin for tenants and keys. Saves and deletes clear the auth cache (`tenants.signals`);
revoking goes through the same service as the API, console and CLI."""

from django.contrib import admin, messages

from tenants.models import ApiKey, Tenant
from tenants.services import apikey_revoke


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
    actions = ["revoke_now"]

    @admin.action(description="Revoke selected keys now (also those in a rotation's grace period)")
    def revoke_now(self, request, queryset):
        revoked = sum(apikey_revoke(api_key=api_key) for api_key in queryset)
        self.message_user(request, f"{revoked} key(s) revoked; requests with them are refused from now on.")
        if revoked < queryset.count():
            self.message_user(request, "The others were revoked already.", level=messages.INFO)
