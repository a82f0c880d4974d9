"""The bottom layer: application errors and billing periods."""

import datetime as dt
import json

import pytest

from core.errors import AppError, Conflict, RateLimited
from core.periods import Period, truncate


def test_a_period_is_a_utc_calendar_month_and_knows_the_one_before():
    december = Period.containing(dt.datetime(2026, 12, 31, 23, 30, tzinfo=dt.timezone(dt.timedelta(hours=-5))))
    assert december.id == "2027-01"  # 04:30 UTC on January 1st
    january = Period.parse("2027-01")
    assert january == december and january.previous() == Period.parse("2026-12")
    assert (january.start, january.end) == (
        dt.datetime(2027, 1, 1, tzinfo=dt.UTC),
        dt.datetime(2027, 2, 1, tzinfo=dt.UTC),
    )
    with pytest.raises(ValueError):
        Period.parse("2027-13")


def test_truncate_cuts_to_the_start_of_a_minute_hour_or_day_in_utc():
    moment = dt.datetime(2026, 12, 1, 20, 45, 30, 12, tzinfo=dt.UTC)
    assert truncate(moment, "minute") == dt.datetime(2026, 12, 1, 20, 45, tzinfo=dt.UTC)
    assert truncate(moment, "hour") == dt.datetime(2026, 12, 1, 20, tzinfo=dt.UTC)
    assert truncate(moment, "day") == dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    with pytest.raises(ValueError):
        truncate(moment, "week")


def test_an_app_error_carries_data_and_the_gateway_renders_it_as_an_openai_error():
    from gateway.errors import error_response

    error = RateLimited("Slow down.", code="rate_limit_exceeded", headers={"Retry-After": "3"})
    assert not hasattr(error, "response")  # no HTTP in core: each face renders it
    response = error_response(error)
    assert (response.status_code, response["Retry-After"]) == (429, "3")
    assert json.loads(response.content) == {
        "error": {"message": "Slow down.", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}
    }


def test_the_gateway_names_the_same_error_classes():
    from gateway import errors

    # Its views catch OpenAIError: that must catch what the domain apps raise.
    assert errors.OpenAIError is AppError and errors.RateLimited is RateLimited


def test_the_management_api_maps_an_app_error_to_its_own_error_types():
    from management.errors import exception_handler

    response = exception_handler(Conflict("It is closed.", param="invoice", code="conflict"), {})
    assert response.status_code == 409
    assert response.data == {
        "error": {"message": "It is closed.", "type": "invalid_request_error", "param": "invoice", "code": "conflict"}
    }
