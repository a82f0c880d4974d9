"""The Celery worker's entry module: ``celery -A workers.worker worker ...`` (GPU and control workers).

The application is ``workers.celery_app``'s; importing the worker runtime (workers/serving.py) here
connects its signal handlers: the engine starts before the worker consumes anything (when
SERVED_MODEL is set), then the heartbeat, the drain and the stop. Web processes import only
``workers.celery_app`` and never load this runtime.
"""

from workers import serving  # noqa: F401  (connects the worker's signal handlers)
from workers.celery_app import app

__all__ = ["app"]
