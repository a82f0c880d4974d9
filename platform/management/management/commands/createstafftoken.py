"""createstafftoken USERNAME [--name LABEL]: a bearer token for an operator's scripts (printed once)."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from management.authentication import staff_token_create


class Command(BaseCommand):
    help = "Create a management API token for a staff user. The token is printed once, as the last line."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--name", default="", help="Label for the token")

    def handle(self, *args, username, name, **options):
        user = get_user_model().objects.filter(username=username).first()
        if user is None or not (user.is_active and user.is_staff):
            raise CommandError(f"{username!r} is not an active staff user (createsuperuser, or set is_staff)")
        token, plaintext = staff_token_create(user=user, name=name)
        self.stdout.write(f"created staff token {token.prefix} for {user.username}; it is shown only once:")
        self.stdout.write(plaintext)
