"""The per-process catalog snapshot: never makes a request wait for another thread's refresh."""

import threading

import pytest

from catalog import selectors
from catalog.models import ServedModel

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def empty_snapshot(monkeypatch):
    monkeypatch.setattr(selectors, "_cache", {"at": float("-inf"), "models": {}})


def _register(model_id: str) -> ServedModel:
    return ServedModel.objects.create(model_id=model_id, path=f"/models/{model_id}", pool=model_id, context_length=2048)


def test_a_stale_snapshot_is_served_while_another_thread_refreshes_it():
    _register("gemma-a")
    assert set(selectors._enabled_models()) == {"gemma-a"}
    _register("gemma-b")
    selectors._cache["at"] = float("-inf")  # stale

    # Another thread is refreshing (and may be waiting for a pooled database connection that this
    # request's thread holds): this request must not wait for it.
    with selectors._refreshing:
        answer = []
        reader = threading.Thread(target=lambda: answer.append(selectors._enabled_models()))
        reader.start()
        reader.join(timeout=5)
        assert not reader.is_alive(), "a request waited for another thread's refresh"
    assert set(answer[0]) == {"gemma-a"}

    assert set(selectors._enabled_models()) == {"gemma-a", "gemma-b"}  # the next stale read refreshes


def test_a_model_missing_from_the_snapshot_is_looked_up_at_once():
    _register("gemma-a")
    selectors._enabled_models()
    _register("gemma-new")
    with selectors._refreshing:  # even while a refresh is in progress elsewhere
        assert set(selectors._enabled_models(refresh=True)) == {"gemma-a", "gemma-new"}
