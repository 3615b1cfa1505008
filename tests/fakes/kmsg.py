"""The kernel's side of /dev/kmsg (linux Documentation/ABI/testing/dev-kmsg): records written exactly
as the kernel formats them into a SOCK_SEQPACKET pair (one record per write and per read, as the kernel
hands them out), and a :class:`gpumon.sources.kmsg.KmsgReader` reading the other end, whose read()
fails with EPIPE where the test sent :data:`OVERRUN` (the ring buffer overwrote records)."""

from __future__ import annotations

import errno
import os
import socket

from gpumon.sources.kmsg import KmsgReader

OVERRUN = b"\x00overrun"
"""What the test's kernel side sends to make the next read() fail with EPIPE."""


class KernelLog:
    """The writing side: records go in exactly as the kernel formats them."""

    def __init__(self, tmp_path, boot: str = "8d1b7a5e-4f3c-4a57-9d0e-2f7c1b2a3e4d") -> None:
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ours.setblocking(False)
        self.boot_path = tmp_path / "boot_id"
        self.boot_path.write_text(boot + "\n")
        self.seeks: list[int] = []

    def record(self, seq: int, message: str, prio: int = 6, usec: int = 1_000_000, flags: str = "-",
               fields: dict[str, str] | None = None, extra: str = "") -> None:
        text = f"{prio},{seq},{usec},{flags}{extra};{message}\n"
        text += "".join(f" {k}={v}\n" for k, v in (fields or {}).items())
        self.theirs.send(text.encode())

    def raw(self, data: bytes) -> None:
        self.theirs.send(data)

    def reader(self, state_file=None, first_start: str = "end") -> KmsgReader:
        def read(fd: int, size: int) -> bytes:
            data = os.read(fd, size)
            if data == OVERRUN:
                raise OSError(errno.EPIPE, "Broken pipe")
            return data

        def lseek(fd: int, offset: int, whence: int) -> int:
            self.seeks.append(whence)
            return 0

        return KmsgReader("/dev/kmsg", str(state_file) if state_file else None, first_start,
                          boot_id_path=str(self.boot_path), open_fd=lambda path: os.dup(self.ours.fileno()),
                          read=read, lseek=lseek)
