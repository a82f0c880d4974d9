"""How the two bearer schemes appear in the OpenAPI schema (drf-spectacular extensions)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class StaffTokenScheme(OpenApiAuthenticationExtension):
    target_class = "management.authentication.StaffTokenAuthentication"
    name = "staffToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "An operator's staff token, gps_..."}


class TenantAdminKeyScheme(OpenApiAuthenticationExtension):
    target_class = "management.authentication.TenantAdminKeyAuthentication"
    name = "tenantAdminKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "A tenant admin API key, gpk_... (is_admin)"}
