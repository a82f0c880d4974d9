"""What the database's columns hold, for every face that checks a number before it is stored (the
management API's serializers, the console's forms)."""

from django.db import connection


def column_max(model, name: str) -> int:
    """The largest value the database column of `model.name` (an integer field) holds: a value past it
    is a 400 naming the field, not a database error."""
    return connection.ops.integer_field_range(model._meta.get_field(name).get_internal_type())[1]
