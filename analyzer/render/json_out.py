"""JSON: the result object itself, with its schema name and version (docs/json-schema.md)."""

from __future__ import annotations

import json
import math

import numpy as np

from kvtrace.analyzer.render.units import shown_path


# Fields that hold a file or run directory: shown by name (units.shown_path), as in every other report.
PATH_FIELDS = frozenset({"source", "sqlite", "sources", "runs", "run", "path", "log"})


def _clean(value):
    # JSON has no NaN or Infinity (json.dumps would write them, and strict readers refuse the file); a coefficient
    # of variation over a zero mean is reported as null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _shown(v) if k in PATH_FIELDS else _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, np.ndarray):  # per-request samples (serving.RequestSamples)
        return value.tolist()
    return value


def _shown(value):
    if isinstance(value, str):
        return shown_path(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return [shown_path(v) for v in value]
    return _clean(value)


def render(result) -> str:
    return json.dumps(_clean(result.to_dict()), indent=2, allow_nan=False) + "\n"
