"""Shared by the remote_write tests: a simulated ND H100 v5 snapshot, the sink under test, and a
decoder for what it sends (the inverse of gpumon.sinks.remote_write.encoding, written from the
.proto field numbers, not from the encoder)."""

from __future__ import annotations

import os
import struct
from typing import Any

from gpumon import cli, config, daemon
from gpumon.model import Snapshot
from gpumon.sinks.base import SinkContext
from gpumon.sinks.remote_write import RemoteWriteSink


class SimulatedHost:
    """`gpumon once --simulate nd-h100-v5` in process: each ``snapshot()`` is a fresh collection."""

    def __init__(self, state_dir: str) -> None:
        os.makedirs(state_dir, exist_ok=True)
        self.config = config.load(cli.schemas(), None, {"GPUMON_DAEMON_STATE_DIR": state_dir},
                                  {"simulate": "nd-h100-v5"})
        self.ctx = daemon.make_context(self.config)
        self.plan = daemon.plan_collectors(self.config, self.ctx)

    def snapshot(self) -> Snapshot:
        return daemon.collect_once(self.config, self.plan, self.ctx)


def make_sink(tmp_path: Any, url: str, **options: Any) -> RemoteWriteSink:
    cfg = {"url": url, "backoff_initial": 0.05, "backoff_max": 0.5, "timeout": 3.0, **options}
    ctx = SinkContext(hostname="nd-node", state_dir=str(tmp_path / "state"), version="test")
    return RemoteWriteSink(ctx, cfg, credential=options.pop("credential", None)) if "credential" in options \
        else RemoteWriteSink(ctx, cfg)


def delivered(sink: RemoteWriteSink) -> bool:
    """Everything spooled has been sent (or given up on) and at least one request went through."""
    health = sink.health()
    return health.extra["requests_queued"] == 0 and health.exported > 0


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _fields(data: bytes) -> list[tuple[int, Any]]:
    out = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 2:
            length, pos = _varint(data, pos)
            out.append((number, data[pos:pos + length]))
            pos += length
        elif wire == 1:
            out.append((number, struct.unpack_from("<d", data, pos)[0]))
            pos += 8
        elif wire == 0:
            value, pos = _varint(data, pos)
            out.append((number, value))
        else:
            raise ValueError(f"wire type {wire}")
    return out


def decode_write_request(body: bytes) -> list[tuple[list[tuple[str, str]], list[tuple[float, int]]]]:
    """[(labels in wire order, [(value, timestamp ms)])] per TimeSeries of a WriteRequest."""
    series = []
    for number, ts in _fields(body):
        assert number == 1, f"unexpected WriteRequest field {number}"
        labels, samples = [], []
        for field, value in _fields(ts):
            if field == 1:
                parts = dict(_fields(value))
                labels.append((parts.get(1, b"").decode(), parts.get(2, b"").decode()))
            elif field == 2:
                parts = dict(_fields(value))
                samples.append((parts.get(1, 0.0), parts.get(2, 0)))
        series.append((labels, samples))
    return series
