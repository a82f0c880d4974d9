"""Periodic routing bookkeeping (Celery, `control` queue)."""

from celery import shared_task

from gateway.routing import routing_reap


@shared_task(name="routing.reap", ignore_result=True)
def route_reap() -> int:
    """Drop the routing state of lost workers and of requests no gateway released (gateway/routing.py)."""
    return routing_reap()
