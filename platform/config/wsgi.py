"""WSGI entry point (Django's WSGI_APPLICATION); the servers run the ASGI one (config/asgi.py)."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

from django.core.wsgi import get_wsgi_application  # noqa: E402

application = get_wsgi_application()
