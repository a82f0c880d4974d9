from django.contrib import admin

from ledger.models import UsageRecord


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    list_display = ["request_id", "tenant", "model", "prompt_tokens", "completion_tokens", "status", "finished_at"]
    list_filter = ["status", "model"]
    search_fields = ["request_id", "tenant__name"]
    list_select_related = ["tenant"]

    def has_change_permission(self, request, obj=None):
        return False  # the ledger is append-only

    def has_delete_permission(self, request, obj=None):
        return False
