"""/api/v1/ management routes. /api/v1/pools/... belongs to the operator endpoints (gateway.urls)."""

from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from management import views

T = "tenants/<slug:tenant>"
K = f"{T}/keys/<str:prefix>"
I = f"{T}/invoices/<str:number>"  # noqa: E741

urlpatterns = [
    path("schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("redoc/", SpectacularRedocView.as_view(url_name="api-schema"), name="api-redoc"),
    path("plans/", views.PlanListView.as_view(), name="api-plans"),
    path("plans/<slug:plan>/", views.PlanDetailView.as_view(), name="api-plan"),
    path("tenants/", views.TenantListView.as_view(), name="api-tenants"),
    path(f"{T}/", views.TenantDetailView.as_view(), name="api-tenant"),
    path(f"{T}/quota/", views.TenantQuotaView.as_view(), name="api-tenant-quota"),
    path(f"{T}/keys/", views.KeyListView.as_view(), name="api-keys"),
    path(f"{K}/", views.KeyDetailView.as_view(), name="api-key"),
    path(f"{K}/revoke/", views.KeyRevokeView.as_view(), name="api-key-revoke"),
    path(f"{K}/rotate/", views.KeyRotateView.as_view(), name="api-key-rotate"),
    path(f"{K}/quota/", views.KeyQuotaView.as_view(), name="api-key-quota"),
    path(f"{T}/usage/", views.UsageView.as_view(), name="api-usage"),
    path(f"{T}/invoices/", views.InvoiceListView.as_view(), name="api-invoices"),
    path(f"{I}/", views.InvoiceDetailView.as_view(), name="api-invoice"),
    path(f"{I}/csv/", views.InvoiceCsvView.as_view(), name="api-invoice-csv"),
    path(f"{I}/close/", views.InvoiceCloseView.as_view(), name="api-invoice-close"),
    path(f"{T}/adapters/", views.AdapterListView.as_view(), name="api-adapters"),
    path(f"{T}/adapters/<path:adapter>/", views.AdapterDetailView.as_view(), name="api-adapter"),
]
