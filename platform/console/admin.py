from django.contrib import admin

from console.models import TenantMembership
from console.signin import AdminLoginForm

# /admin/login/ checks staff passwords: it shares the console's sign-in rate limit.
admin.site.login_form = AdminLoginForm


@admin.register(TenantMembership)
class TenantMembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "created_at"]
    search_fields = ["user__username", "tenant__name"]
    list_select_related = ["user", "tenant"]
    raw_id_fields = ["user", "tenant"]
