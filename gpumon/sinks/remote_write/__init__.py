"""Prometheus remote write 1.0: the wire format (:mod:`.encoding`), one bounded POST
(:mod:`.transport`) and the sink with its spool and uploader (:mod:`.sink`)."""

from gpumon.sinks.remote_write.sink import RemoteWriteSink

__all__ = ["RemoteWriteSink"]
