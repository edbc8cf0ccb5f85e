"""Reading a run's files: one that cannot be read, is empty, is not JSON, or has a field of the wrong type is a
``BadFile`` whose message names the file and the field.

A shape is ``NUMBER``, ``COUNT`` (bytes, blocks and the like), ``TEXT``, ``dict`` (any object), ``list`` (any
list), ``[shape]`` (a list of that shape), ``Values(shape)`` (an object whose every value has that shape) or a dict of
field -> shape (an object; every listed field is optional, ``null`` reads as missing, other fields are not looked at).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NUMBER = "a number"
COUNT = "a non-negative integer"
TEXT = "a string"


@dataclass(frozen=True)
class Values:
    shape: object


class BadFile(ValueError):
    """A file that is not what its name says."""


def read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError as exc:
        raise BadFile(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def read_json(path: str | Path, shape: object) -> Any:
    """The JSON in ``path``, checked against ``shape``."""
    text = read_text(path)
    if not text.strip():
        raise BadFile(f"{path}: empty file")
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise BadFile(f"{path}: not valid JSON, truncated or corrupt ({exc})") from None
    _check(path, data, shape, "")
    return data


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return NUMBER
    return {str: TEXT, list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _shown(value: object) -> str:
    return _kind(value) if value is None or isinstance(value, (list, dict)) else json.dumps(value)[:60]


def _fits(value: object, shape: object) -> bool:
    if shape == COUNT:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
    if shape == NUMBER:
        return _kind(value) == NUMBER and abs(value) <= sys.float_info.max
    return _kind(value) == _wanted(shape)


def _wanted(shape: object) -> str:
    if shape is list or isinstance(shape, list):
        return "a list"
    if shape is dict or isinstance(shape, (dict, Values)):
        return "an object"
    return str(shape)


def _check(path: str | Path, value: object, shape: object, where: str) -> None:
    if not _fits(value, shape):
        raise BadFile(f"{path}: {where or 'the top level'} should be {_wanted(shape)}, got {_shown(value)}")
    if isinstance(shape, list):
        for i, item in enumerate(value):
            _check(path, item, shape[0], f"{where}[{i}]")
    elif isinstance(shape, Values):
        for key, item in value.items():
            _check(path, item, shape.shape, f"{where}.{key}")
    elif isinstance(shape, dict):
        for key, field in shape.items():
            if value.get(key) is not None:
                _check(path, value[key], field, f"{where}.{key}" if where else key)
