"""JSON: the result object itself, with its schema name and version (docs/json-schema.md)."""

from __future__ import annotations

import json
import math


def _clean(value):
    # JSON has no NaN; a coefficient of variation over a zero mean is reported as null.
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def render(result) -> str:
    return json.dumps(_clean(result.to_dict()), indent=2) + "\n"
