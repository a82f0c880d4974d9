from django.contrib import admin
from django.urls import reverse

from console.models import TenantMembership
from console.signin import AdminLoginForm, ThrottledPasswordChangeView

# /admin/login/ checks staff passwords: it shares the console's sign-in rate limit.
admin.site.login_form = AdminLoginForm


def _password_change(request, extra_context=None):
    """/admin/password_change/ as Django's ``AdminSite.password_change`` serves it (which offers no
    hook for its form), with the current-password check under the sign-in rate limit."""
    site = admin.site
    request.current_app = site.name
    return ThrottledPasswordChangeView.as_view(
        success_url=reverse("admin:password_change_done", current_app=site.name),
        extra_context={**site.each_context(request), **(extra_context or {})},
    )(request)


# Read by the site's URLs when they are built (after every app's admin module is imported).
admin.site.password_change = _password_change


@admin.register(TenantMembership)
class TenantMembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "created_at"]
    search_fields = ["user__username", "tenant__name"]
    list_select_related = ["user", "tenant"]
    raw_id_fields = ["user", "tenant"]
