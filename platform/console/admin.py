from django.contrib import admin

from console.models import TenantMembership


@admin.register(TenantMembership)
class TenantMembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "created_at"]
    search_fields = ["user__username", "tenant__name"]
    list_select_related = ["user", "tenant"]
    raw_id_fields = ["user", "tenant"]
