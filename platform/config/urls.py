from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("management.urls")),
    path("console/", include("console.urls")),
    path("", include("gateway.urls")),
]

# JSON errors in the API's shape under /v1/ and /api/v1/, HTML elsewhere (config/error_views.py).
handler400 = "config.error_views.bad_request"
handler403 = "config.error_views.permission_denied"
handler404 = "config.error_views.not_found"
handler500 = "config.error_views.server_error"
