from django.urls import path

from console import views

app_name = "console"

urlpatterns = [
    path("", views.home, name="home"),
    path("login/", views.LoginView.as_view(), name="login"),
    path("logout/", views.LogoutView.as_view(), name="logout"),
    path("overview/", views.overview, name="overview"),
    path("usage/", views.usage_all, name="usage"),
    path("tenants/", views.tenant_list, name="tenants"),
    path("tenants/new/", views.tenant_new, name="tenant_new"),
    path("tenants/<slug:tenant_name>/", views.tenant_detail, name="tenant_detail"),
    path("tenants/<slug:tenant_name>/keys/", views.tenant_keys, name="tenant_keys"),
    path("tenants/<slug:tenant_name>/keys/<int:key_id>/revoke/", views.key_revoke, name="key_revoke"),
    path("tenants/<slug:tenant_name>/keys/<int:key_id>/rotate/", views.key_rotate, name="key_rotate"),
    path("tenants/<slug:tenant_name>/keys/<int:key_id>/limits/", views.key_limits, name="key_limits"),
    path("tenants/<slug:tenant_name>/usage/", views.tenant_usage, name="tenant_usage"),
    path("tenants/<slug:tenant_name>/limits/", views.tenant_limits, name="tenant_limits"),
    path("tenants/<slug:tenant_name>/throttling/", views.tenant_throttles, name="tenant_throttles"),
    path("tenants/<slug:tenant_name>/invoices/", views.tenant_invoices, name="tenant_invoices"),
    path("tenants/<slug:tenant_name>/invoices/<str:number>/", views.invoice_detail, name="invoice_detail"),
    path("tenants/<slug:tenant_name>/adapters/", views.tenant_adapters, name="tenant_adapters"),
    path("tenants/<slug:tenant_name>/adapters/<int:adapter_id>/delete/", views.adapter_remove, name="adapter_remove"),
    path("plans/", views.plan_list, name="plans"),
    path("plans/new/", views.plan_edit, name="plan_new"),
    path("plans/<slug:plan_name>/", views.plan_edit, name="plan_edit"),
    path("invoices/", views.invoice_list, name="invoices"),
]
