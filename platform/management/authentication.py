"""Who calls the management API: a platform operator (staff user: session or staff token) or a
tenant's admin API key (an ApiKey flagged is_admin), which acts for its own tenant only."""

from dataclasses import dataclass

from django.utils import timezone
from rest_framework import authentication, exceptions

from config.bearer import bearer_token
from management.models import StaffToken
from tenants.keys import digests_match, key_generate, key_prefix
from tenants.models import ApiKey, Tenant
from tenants.services import AuthenticationFailed, apikey_authenticate

STAFF_SCHEME = "gps"


@dataclass
class TenantAdmin:
    """request.user for a tenant admin key."""

    tenant: Tenant
    api_key: ApiKey
    is_authenticated = True
    is_staff = False
    is_active = True

    @property
    def pk(self):  # what DRF's throttles and logging read
        return f"key:{self.api_key.pk}"


def staff_token_create(*, user, name: str = "") -> tuple[StaffToken, str]:
    new = key_generate(scheme=STAFF_SCHEME)
    token = StaffToken.objects.create(user=user, name=name, prefix=new.prefix, digest=new.digest)
    return token, new.plaintext


class StaffTokenAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request):
        token = bearer_token(request)
        if token is None or not token.startswith(f"{STAFF_SCHEME}_"):
            return None
        row = (
            StaffToken.objects.select_related("user")
            .filter(prefix=key_prefix(token, scheme=STAFF_SCHEME) or "")
            .first()
        )
        if row is None or not digests_match(row.digest, token) or row.revoked_at is not None:
            raise exceptions.AuthenticationFailed("Invalid staff token.")
        if not (row.user.is_active and row.user.is_staff):
            raise exceptions.AuthenticationFailed("This staff token's user is not active staff.")
        StaffToken.objects.filter(pk=row.pk).update(last_used_at=timezone.now())
        return row.user, row

    def authenticate_header(self, request):
        return "Bearer"


class TenantAdminKeyAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request):
        token = bearer_token(request)
        if token is None or token.startswith(f"{STAFF_SCHEME}_"):
            return None
        try:
            principal = apikey_authenticate(plaintext=token)
        except AuthenticationFailed as exc:
            raise exceptions.AuthenticationFailed(str(exc)) from None
        api_key = ApiKey.objects.select_related("tenant").get(pk=principal.key_id)
        if not api_key.is_admin:
            raise exceptions.PermissionDenied("This API key is not a tenant admin key.")
        return TenantAdmin(tenant=api_key.tenant, api_key=api_key), api_key

    def authenticate_header(self, request):
        return "Bearer"
