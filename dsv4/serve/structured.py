"""Grammar-constrained sampling for response formats (json_schema, json_object)."""

from __future__ import annotations


def constraint_for(response_format, service, param: str):
    return None
