"""The protocol-buffers wire format (varints, length-delimited fields), read and written by hand.

gpumon speaks a few small, stable protobuf messages (the kubelet's PodResources, read here;
Prometheus remote write, written by gpumon.sinks.remote_write.encoding with these writers). A generated ``_pb2`` module ties the package to one protobuf runtime and needs protoc at build
time; these messages need two wire types, so a few dozen lines do it with no dependency. Field
numbers live beside each message's reader, with the ``.proto`` they come from.
"""

from __future__ import annotations

from collections.abc import Iterator

VARINT, I64, LEN, I32 = 0, 1, 2, 5


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    result = shift = 0
    end = len(buf)
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise WireError("varint longer than 10 bytes")


def fields(buf: bytes | memoryview) -> Iterator[tuple[int, int, int | bytes]]:
    """Each ``(field number, wire type, value)`` of one message: an int for varints and fixed
    fields, the raw bytes for length-delimited ones. Groups (wire types 3 and 4) are refused."""
    view = memoryview(buf)
    pos, end = 0, len(view)
    while pos < end:
        key, pos = read_varint(view, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if wire == VARINT:
            value, pos = read_varint(view, pos)
            yield number, wire, value
        elif wire == LEN:
            size, pos = read_varint(view, pos)
            if pos + size > end:
                raise WireError(f"field {number}: length {size} past the end")
            yield number, wire, bytes(view[pos:pos + size])
            pos += size
        elif wire in (I64, I32):
            width = 8 if wire == I64 else 4
            if pos + width > end:
                raise WireError(f"field {number}: truncated fixed{width * 8}")
            yield number, wire, int.from_bytes(view[pos:pos + width], "little")
            pos += width
        else:
            raise WireError(f"field {number}: unsupported wire type {wire}")


def text(raw: int | bytes) -> str:
    if not isinstance(raw, bytes):
        raise WireError("expected a string field, got a number")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"string field is not UTF-8: {exc}") from exc


def write_varint(value: int, out: bytearray) -> None:
    value &= (1 << 64) - 1  # negative int64 is ten bytes, two's complement
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def write_len(number: int, payload: bytes, out: bytearray) -> None:
    """A length-delimited field (string, bytes or embedded message)."""
    write_varint((number << 3) | LEN, out)
    write_varint(len(payload), out)
    out += payload
