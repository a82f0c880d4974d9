from django.urls import path, re_path

from gateway import ops_views, views

urlpatterns = [
    path("v1/models", views.models_list),
    re_path(r"^v1/models/(?P<model_id>.+)$", views.model_detail),
    path("v1/chat/completions", views.chat_completions),
    path("v1/completions", views.completions),
    re_path(r"^v1/(?P<path>.*)$", views.not_found),
    path("healthz", ops_views.healthz),
    path("readyz", ops_views.readyz),
    path("metrics", ops_views.metrics),
    path("api/v1/pools/<slug:pool>/demand", ops_views.demand),
    path("api/v1/pools/<slug:pool>/workers/<str:pod>/drain", ops_views.drain),
]
