"""A hand-written protobuf codec for the data path: varints, tags, top-level fields, a ``data`` field kept as a view."""

from __future__ import annotations

from typing import Iterator, TypeVar

from google.protobuf.message import Message

from kvstore.errors import InvalidArgumentError

_ONE_BYTE_VARINTS = tuple(bytes((value,)) for value in range(0x80))


def encode_varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf base-128 varint."""
    if value < 0x80:
        return _ONE_BYTE_VARINTS[value]
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``buf[pos]`` and the position after it.

    Raises:
        InvalidArgumentError: if it runs past the end of ``buf`` or over 64 bits.
    """
    if pos < len(buf) and buf[pos] < 0x80:  # most tags and lengths: one byte
        return buf[pos], pos + 1
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise InvalidArgumentError("malformed message: a varint runs past its end")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def field_tag(number: int, wire_type: int) -> bytes:
    """The key of field ``number`` with ``wire_type`` (0: varint, 1: 64-bit, 2: length-delimited, 5: 32-bit), as
    the varint that starts the field on the wire."""
    return encode_varint(number << 3 | wire_type)


def encode_with_data(head: bytes, field_number: int, data: bytes | memoryview) -> bytes:
    """A serialized message: ``head`` (its other fields, already serialized) plus the bytes field ``data``.

    Args:
        head: ``SerializeToString()`` of the message with ``data`` unset.
        field_number: number of the ``data`` field.
        data: the field's value; copied once, into the result.
    """
    return b"".join((head, encode_varint(field_number << 3 | 2), encode_varint(len(data)), data))


def iter_fields(view: memoryview) -> Iterator[tuple[int, int, int, int | memoryview | None]]:
    """Each top-level field of a serialized message, in order: ``(number, start, end, value)``.

    ``view[start:end]`` is the whole field, tag included; ``value`` is the
    integer of a varint field, a view of a length-delimited field's bytes, and
    ``None`` for a fixed-width (32- or 64-bit) one.

    Raises:
        InvalidArgumentError: if the message is not well-formed protobuf.
    """
    pos, end = 0, len(view)
    while pos < end:
        start = pos
        tag, pos = read_varint(view, pos)
        wire_type = tag & 7
        value: int | memoryview | None = None
        if wire_type == 0:
            value, pos = read_varint(view, pos)
        elif wire_type == 2:
            length, pos = read_varint(view, pos)
            value = view[pos: pos + length]
            pos += length
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise InvalidArgumentError(f"malformed message: unsupported wire type {wire_type}")
        if pos > end:
            raise InvalidArgumentError("malformed message: a field runs past its end")
        yield tag >> 3, start, pos, value


def split_data_field(message: bytes, field_number: int) -> tuple[bytes, memoryview]:
    """Split a serialized message into its other fields and the value of one bytes field, without copying it.

    Args:
        message: a serialized protobuf message.
        field_number: number of a length-delimited field (the last occurrence wins, as in protobuf).

    Returns:
        ``(rest, data)``: the message without that field (for protobuf to parse)
        and a view of the field's bytes inside ``message`` (empty if absent).

    Raises:
        InvalidArgumentError: if the message is not well-formed protobuf.
    """
    view = memoryview(message)
    kept: list[memoryview] = []
    data = view[0:0]
    for number, start, end, value in iter_fields(view):
        if number == field_number and isinstance(value, memoryview):
            data = value
        else:
            kept.append(view[start:end])
    rest = kept[0].tobytes() if len(kept) == 1 else b"".join(kept)
    return rest, data


_M = TypeVar("_M", bound=Message)


def parse_request(message_type: type[_M], raw: bytes | _M) -> _M:
    """Parse a request received as bytes (a message passes through, for direct calls).

    Raises:
        InvalidArgumentError: if the bytes are not a well-formed ``message_type``.
    """
    if isinstance(raw, Message):
        message: _M = raw
        return message
    try:
        parsed: _M = message_type.FromString(raw)
    except Exception as exc:  # google.protobuf.message.DecodeError, or a non-bytes value
        raise InvalidArgumentError(f"malformed {message_type.__name__}: {exc}") from None
    return parsed
