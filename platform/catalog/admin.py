from django.contrib import admin

from catalog.models import ServedModel


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin):
    list_display = ["model_id", "pool", "context_length", "accepts_images", "is_enabled", "path"]
    list_filter = ["pool", "is_enabled"]
    search_fields = ["model_id"]
