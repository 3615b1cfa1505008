"""kmsg at 1,000 kernel-log lines per second (target <= 1 % of one core) and AER over 16 PCI functions
(target <= 0.2 ms per run), both in process.

kmsg: records in the dev-kmsg format go through a SOCK_SEQPACKET pair (one record per read, as the
kernel hands them out; a mix of driver lines and other lines), and the collector drains them ten times a
second (conservative: one run a second costs less); only the collector's thread CPU (``time.thread_time``) is counted. AER: a tree laid out like
sysfs with 8 GPUs and 8 HCAs, each with the three aer_dev_* files, collected back to back: ``ms_per_run``
keeps each file open and preads it, as the collector does on a real sysfs; ``open_mode`` opens each
file per read, as it does on any other tree (these are regular files, which may be replaced).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from typing import Any

from bench.common import Options
from gpumon.collectors.aer import AerCollector
from gpumon.collectors.base import Context
from gpumon.collectors.kmsg import KmsgCollector
from gpumon.sources.kmsg import KmsgReader

LINES = (
    "NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python3, Graphics SM Warp Exception on (GPC 0, TPC 1)",
    "mlx5_core 0000:5c:00.0: mlx5_port_module_event:1131:(pid 0): Port module event: module 0, Cable plugged",
    "EXT4-fs (nvme0n1p1): mounted filesystem with ordered data mode. Quota mode: none.",
    "audit: type=1400 audit(1700000000.000:1): apparmor=\"STATUS\" operation=\"profile_load\"",
)
CORRECTABLE = "RxErr 0\nBadTLP 0\nBadDLLP 0\nRollover 0\nTimeout 0\nNonFatalErr 0\nCorrIntErr 0\nHeaderOF 0\nTOTAL_ERR_COR 0\n"
UNCORRECTABLE = ("Undefined 0\nDLP 0\nSDES 0\nTLP 0\nFCP 0\nCmpltTO 0\nCmpltAbrt 0\nUnxCmplt 0\nRxOF 0\nMalfTLP 0\n"
                 "ECRC 0\nUnsupReq 0\nACSViol 0\nUncorrIntErr 0\nBlockedTLP 0\nAtomicOpBlocked 0\n"
                 "TLPBlockedErr 0\nPoisonTLPBlocked 0\n")


def kmsg(seconds: float, rate: int = 1000) -> dict[str, Any]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    with tempfile.TemporaryDirectory() as tmp:
        c = KmsgCollector(Context(hostname="bench", state_dir=tmp, sysfs_root=tmp))
        c.reader = KmsgReader("/dev/kmsg", os.path.join(tmp, "kmsg.json"), "all",
                              open_fd=lambda path: os.dup(ours.fileno()), lseek=lambda fd, o, w: 0)
        seq, cpu, started = 0, 0.0, time.monotonic()
        for _ in range(int(seconds) * 10):   # a tenth of a second's records, then a run: the pair's
            usec = int((time.monotonic() - 5) * 1e6)  # buffer holds no more; ten runs cost more than one
            for _ in range(rate // 10):
                theirs.send(f"4,{seq},{usec},-;{LINES[seq % len(LINES)]}\n SUBSYSTEM=pci\n".encode())
                seq += 1
            t0 = time.thread_time()
            c.collect()
            cpu += time.thread_time() - t0
        c.close()
    wall = time.monotonic() - started
    return {"lines_per_second": rate, "seconds": int(seconds), "records": seq,
            "cpu_seconds": round(cpu, 4), "share_of_one_core": round(cpu / max(int(seconds), 1), 5),
            "cpu_us_per_record": round(cpu / max(seq, 1) * 1e6, 2), "wall_seconds": round(wall, 2)}


def aer(runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        devices = os.path.join(root, "bus", "pci", "devices")
        os.makedirs(devices)
        os.makedirs(os.path.join(root, "class", "infiniband"))
        for i in range(16):
            name = f"{i + 1:04x}:00:00.0"
            path = os.path.join(root, "devices", f"pci{i + 1:04x}:00", name)
            os.makedirs(path)
            gpu = i < 8
            for file, text in (("vendor", "0x10de" if gpu else "0x15b3"), ("class", "0x030200" if gpu else "0x020700"),
                               ("aer_dev_correctable", CORRECTABLE),
                               ("aer_dev_nonfatal", UNCORRECTABLE + "TOTAL_ERR_NONFATAL 0\n"),
                               ("aer_dev_fatal", UNCORRECTABLE + "TOTAL_ERR_FATAL 0\n")):
                with open(os.path.join(path, file), "w") as fh:
                    fh.write(text)
            os.symlink(os.path.relpath(path, devices), os.path.join(devices, name))
            if not gpu:
                ib = os.path.join(path, "infiniband", f"mlx5_{i - 8}")
                os.makedirs(ib)
                os.symlink("../..", os.path.join(ib, "device"))
                os.symlink(os.path.relpath(ib, os.path.join(root, "class", "infiniband")),
                           os.path.join(root, "class", "infiniband", f"mlx5_{i - 8}"))
        modes = {}
        for mode, cached in (("pread", True), ("open", False)):
            c = AerCollector(Context(hostname="bench", sysfs_root=root))
            c.cached = cached
            out = c.collect()
            series = sum(len(f.samples) for f in out.families)
            t0 = time.perf_counter()
            cpu0 = time.thread_time()
            for _ in range(runs):
                c.collect()
            wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
            c.close()
            modes[mode] = {"ms_per_run": round(wall / runs * 1e3, 4), "cpu_ms_per_run": round(cpu / runs * 1e3, 4)}
    return {"functions": 16, "series": series, "runs": runs, **modes["pread"], "open_mode": modes["open"]}


def run(opts: Options) -> dict[str, Any]:
    data = {"kmsg": kmsg(2 if opts.smoke else 10), "aer": aer(20 if opts.smoke else 2000)}
    print(f"   kmsg at 1,000 lines/s: {data['kmsg']['share_of_one_core'] * 100:.3f} % of one core "
          f"(target <= 1 %); AER, 16 functions: {data['aer']['ms_per_run']} ms per run (target <= 0.2 ms)")
    return data
