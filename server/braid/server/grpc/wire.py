"""Finds the field that made a request undecodable, so the client hears which one it was.

protobuf refuses a string field holding invalid UTF-8 without saying which; this walks the raw wire
format against the message's descriptor and names the first bad field (e.g. `messages[1].content`).
"""

from __future__ import annotations

from typing import Iterator

from google.protobuf.descriptor import Descriptor, FieldDescriptor


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data):
            raise ValueError("truncated varint")
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            return value, i
        shift += 7


def _length_delimited(data: bytes) -> Iterator[tuple[int, bytes]]:
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, i = _varint(data, i)
        elif wire_type == 1:
            i += 8
        elif wire_type == 5:
            i += 4
        elif wire_type == 2:
            size, i = _varint(data, i)
            yield number, data[i : i + size]
            i += size
        else:
            raise ValueError(f"unsupported wire type {wire_type}")


def invalid_utf8_field(data: bytes, descriptor: Descriptor, prefix: str = "") -> str | None:
    """The path of the first string field that is not valid UTF-8, or None."""
    seen: dict[int, int] = {}
    try:
        for number, payload in _length_delimited(data):
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            index = seen.get(number, 0)
            seen[number] = index + 1
            is_repeated = field.is_repeated
            path = f"{prefix}{field.name}" + (f"[{index}]" if is_repeated else "")
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    payload.decode("utf-8")
                except UnicodeDecodeError:
                    return path
            elif field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type is not None:
                found = invalid_utf8_field(payload, field.message_type, path + ".")
                if found:
                    return found
    except ValueError:
        return None
    return None
