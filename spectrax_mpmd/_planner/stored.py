"""Profiles as data: a file is one JSON header line, then the profile as JSON.

The header names the format (`MAGIC`), its version (`FORMAT`), the profile's key
and the SHA-256 of the rest of the file. The rest is the value `encode` made of
the profile's records: each record an object of its fields, each tuple a list,
numbers, strings and nulls. Reading parses JSON only, and `decode` rebuilds the
value from the record types the caller names, checking each field against its
annotation: nothing in the file chooses what is built, so reading it never runs
code. Any mismatch is an `Unreadable` saying what was found.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import types
import typing
from collections.abc import Callable

import numpy as np

MAGIC = "spectrax_mpmd profile"  # the first field of every profile file
FORMAT = 2  # bump when the file's layout or what a profile holds changes


class Unreadable(Exception):
    """A cache file that is not a profile this version reads (the reason)."""


def encode(value):
    """`value` (records, tuples, numbers, strings, None) as plain JSON data: a record as an
    object of its fields, a tuple as a list."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [encode(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"profile cache: a {type(value).__name__} cannot be stored; profiles hold records, tuples, "
        "numbers, strings and None."
    )


def decode(data, kind):
    """`data` (parsed JSON) as a value of type `kind`: a record type (its fields decoded by their
    annotations), `tuple[X, ...]`, `tuple[X, Y]`, a bare `tuple` (nested lists of numbers),
    `X | None`, `int`, `float`, `bool` or `str`. Raises `Unreadable` when `data` does not
    have that shape."""
    return _decoder(kind)(data)


@functools.cache
def _decoder(kind) -> Callable:
    """The function that decodes data of type `kind` (see `decode`), made once per type."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        fields = {f.name: _decoder(hints[f.name]) for f in dataclasses.fields(kind)}
        return functools.partial(_record, kind, fields)
    if origin in (typing.Union, types.UnionType):  # `X | None`
        (present,) = [_decoder(a) for a in args if a is not type(None)]
        return lambda data: None if data is None else present(data)
    if kind is tuple:
        return _numbers
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        each = _decoder(args[0])
        return lambda data: tuple(map(each, _list(data, kind)))
    if origin is tuple:
        parts = [_decoder(a) for a in args]
        return lambda data: tuple(part(d) for part, d in zip(parts, _list(data, kind, len(parts))))
    if kind is float:
        return lambda data: float(_number(data))
    if kind in (int, bool, str):
        return functools.partial(_exact, kind)
    raise TypeError(f"profile cache: no decoding for {kind}; profiles hold records, tuples, numbers, text.")


def _record(kind: type, fields: dict, data):
    if not isinstance(data, dict) or data.keys() != fields.keys():
        raise Unreadable(f"{kind.__name__} expects the fields {list(fields)}")
    try:
        return kind(**{name: field(data[name]) for name, field in fields.items()})
    except ValueError as err:  # the record's own checks
        raise Unreadable(str(err)) from None


def _list(data, kind, length: int | None = None) -> list:
    """`data` when it is a list (of `length` entries, when given)."""
    if not isinstance(data, list) or length not in (None, len(data)):
        count = "a list" if length is None else f"a list of {length}"
        raise Unreadable(f"expected {count} for {kind}, found {data!r:.40}")
    return data


def _numbers(data) -> tuple:
    """A bare `tuple`: nested lists of numbers as nested tuples."""
    return tuple(_numbers(d) if isinstance(d, list) else _number(d) for d in _list(data, tuple))


def _number(data) -> int | float:
    if isinstance(data, bool) or not isinstance(data, (int, float)):
        raise Unreadable(f"expected a number, found {data!r:.40}")
    return data


def _exact(kind: type, data):
    if type(data) is not kind:
        raise Unreadable(f"expected {kind.__name__}, found {data!r:.40}")
    return data


def dumped(key: str, value) -> bytes:
    """The file that stores `value` (see `encode`) under `key`: the header line, then the data."""
    body = json.dumps(encode(value), separators=(",", ":")).encode()
    header = {"format": MAGIC, "version": FORMAT, "key": key, "sha256": hashlib.sha256(body).hexdigest()}
    return json.dumps(header).encode() + b"\n" + body


def parsed(raw: bytes, key: str, kind):
    """The value of type `kind` that `raw`, a file's bytes, stores under `key`. Raises
    `Unreadable` naming why it holds none."""
    return decode(_data(raw, key), kind)


def _data(raw: bytes, key: str):
    """The JSON data in `raw` once its header says it is a profile of `key` and its checksum holds."""
    head, newline, body = raw.partition(b"\n")
    try:
        header = json.loads(head)
        if not isinstance(header, dict) or header.get("format") != MAGIC:
            raise Unreadable("not a profile file")
        if header.get("version") != FORMAT:
            raise Unreadable(f"format version {header.get('version')!r}, this version reads {FORMAT}")
        if header.get("key") != key:
            raise Unreadable("it holds the profile of another key")
        if not newline or header.get("sha256") != hashlib.sha256(body).hexdigest():
            raise Unreadable("its checksum does not match: cut short or changed")
        return json.loads(body)
    except (ValueError, RecursionError) as err:  # not JSON (a pickle, a truncated header)
        raise Unreadable(f"not JSON ({type(err).__name__})") from None
