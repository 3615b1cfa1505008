"""Prometheus remote write 1.0 on the wire: a hand-written protobuf encoder and the snappy block.

Only four messages are needed (``prometheus.WriteRequest``, ``TimeSeries``, ``Label``, ``Sample`` from
prompb/remote.proto and types.proto), all built from length-delimited fields, a double and a varint,
so a protobuf runtime would cost more to import than these few lines. As with the page
(:mod:`gpumon.render`), encoding is the cost of a run: each series' encoded labels are kept between
snapshots and only the value and timestamp are packed anew.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

from gpumon.model import Labels, MetricFamily
from gpumon.sources import protowire

STALE_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000002))[0]
"""Prometheus' staleness marker: the NaN a scrape writes for a series that disappeared."""

_DOUBLE = struct.Struct("<d")
_WRITE_REQUEST_TIMESERIES = 0x0A  # field 1, length-delimited
_TIMESERIES_LABEL = 0x0A  # field 1
_TIMESERIES_SAMPLE = 0x12  # field 2
_LABEL_NAME, _LABEL_VALUE = 0x0A, 0x12
_SAMPLE_VALUE, _SAMPLE_TIMESTAMP = 0x09, 0x10  # double (fixed64), int64 varint


def varint(value: int) -> bytes:
    """Protobuf base-128 varint; a negative int64 takes ten bytes, as in two's complement."""
    out = bytearray()
    protowire.write_varint(value, out)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    out = bytearray()
    protowire.write_len(tag >> 3, payload, out)
    return bytes(out)


def encode_labels(pairs: Iterable[tuple[str, str]]) -> bytes:
    """The ``repeated Label labels = 1`` part of a TimeSeries, pairs in the order given."""
    out = []
    for name, value in pairs:
        label = _field(_LABEL_NAME, name.encode()) + _field(_LABEL_VALUE, value.encode())
        out.append(_field(_TIMESERIES_LABEL, label))
    return b"".join(out)


def series_labels(name: str, labels: Labels, external: Mapping[str, str]) -> list[tuple[str, str]]:
    """What Prometheus would store for one sample of the page: ``__name__``, the sample's labels, then
    the external labels it lacks; empty values left out (a scrape drops them too), sorted by name."""
    pairs = {"__name__": name}
    for key, value in labels:
        if value:
            pairs[key] = value
    for key, value in external.items():
        if value and key not in pairs:
            pairs[key] = value
    return sorted(pairs.items())


class Encoder:
    """Turns families into one serialized WriteRequest per snapshot, one sample per series.

    Keeps each series' bytes up to its sample (field tag, length, encoded labels) between calls, for
    the latest call's series only, so a churning label set cannot grow it; and writes a staleness
    marker for every series that was in the previous request and is not in this one, as a scrape
    would. Not thread-safe.
    """

    def __init__(self, external_labels: Mapping[str, str] | None = None) -> None:
        self.external = dict(external_labels or {})
        self._prefixes: dict[tuple[str, Labels], bytes] = {}
        self._sample_len = 0

    def encode(self, families: Iterable[MetricFamily], timestamp_ms: int) -> tuple[bytes, int]:
        """(serialized WriteRequest, number of samples in it, staleness markers included)."""
        stamp = bytes((_SAMPLE_TIMESTAMP,)) + varint(timestamp_ms)
        sample_len = 1 + _DOUBLE.size + len(stamp)
        head = bytes((_TIMESERIES_SAMPLE,)) + varint(sample_len) + bytes((_SAMPLE_VALUE,))
        if sample_len != self._sample_len:  # a prefix holds the series length, which includes the sample
            self._prefixes, self._sample_len = {}, sample_len
        sample_field = len(head) + _DOUBLE.size + len(stamp)
        old, new = self._prefixes, {}
        parts: list[bytes] = []
        append = parts.append
        pack = _DOUBLE.pack
        for fam in families:
            name = fam.spec.name
            for labels, value in fam.samples:
                key = (name, labels)
                prefix = old.get(key)
                if prefix is None:
                    encoded = encode_labels(series_labels(name, labels, self.external))
                    prefix = bytes((_WRITE_REQUEST_TIMESERIES,)) + varint(len(encoded) + sample_field) + encoded
                new[key] = prefix
                append(prefix)
                append(head + pack(value) + stamp)
        stale = [prefix for key, prefix in old.items() if key not in new]
        marker = head + pack(STALE_NAN) + stamp
        for prefix in stale:
            append(prefix)
            append(marker)
        self._prefixes = new
        return b"".join(parts), len(new) + len(stale)


def split_request(body: bytes) -> tuple[bytes, bytes]:
    """Cut a serialized WriteRequest into two halves of its series (a 413 retries them apart).

    Raises ValueError when there is fewer than two series or the bytes are not a WriteRequest."""
    fields = list(_top_level_fields(body))
    if len(fields) < 2:
        raise ValueError("a single series cannot be split")
    middle = fields[len(fields) // 2][0]
    return body[:middle], body[middle:]


def _top_level_fields(body: bytes) -> Iterable[tuple[int, int]]:
    """(start, end) of each length-delimited top-level field; anything else is refused."""
    pos = 0
    while pos < len(body):
        start = pos
        if body[pos] & 0x07 != protowire.LEN:
            raise ValueError(f"unexpected wire type at byte {pos}")
        try:
            length, pos = protowire.read_varint(body, pos + 1)
        except protowire.WireError as exc:
            raise ValueError(str(exc)) from exc
        pos += length
        if pos > len(body):
            raise ValueError("truncated field")
        yield start, pos


def compress(body: bytes) -> bytes:
    """Snappy block format (not framed), as remote write requires; cramjam is the optional extra."""
    import cramjam

    return bytes(cramjam.snappy.compress_raw(body))


def decompress(body: bytes) -> bytes:
    import cramjam

    return bytes(cramjam.snappy.decompress_raw(body))
