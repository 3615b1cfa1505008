"""Keep GPU 0 busy for a while, as a compute process would, to record what the driver reports about it.

Matrix products in a loop on GPU 0, ``--duty`` of the time (busy bursts of ``--burst`` seconds, then a
sleep), holding ``--mib`` MiB of GPU memory, for ``--seconds``; then the process exits, so the driver
sees it end. Two of them on one GPU time-share its SMs as two jobs would. Needs CuPy
(``cupy-cuda12x`` / ``cupy-cuda13x``) or, where CuPy is missing, PyTorch; only here.

Used by ``python tools/nvml_record.py --processes`` recordings (tests/fixtures/nvml/README.md).
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long to run before exiting")
    p.add_argument("--duty", type=float, default=1.0, help="fraction of the time the GPU is kept busy")
    p.add_argument("--burst", type=float, default=0.1, help="seconds of one busy burst")
    p.add_argument("--mib", type=int, default=1024, help="GPU memory to hold, MiB")
    p.add_argument("--n", type=int, default=4096, help="matrix size of the products")
    args = p.parse_args(argv)
    try:
        import cupy as xp  # the only dependency, and only here

        held = xp.ones(args.mib * 2**20, dtype=xp.uint8)
        a = xp.random.rand(args.n, args.n, dtype=xp.float32)
        sync = xp.cuda.Stream.null.synchronize
    except ImportError:
        import torch

        held = torch.ones(args.mib * 2**20, dtype=torch.uint8, device="cuda:0")
        a = torch.rand(args.n, args.n, device="cuda:0")
        sync = torch.cuda.synchronize
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.burst:
            a @ a
            sync()
        if args.duty < 1.0:
            time.sleep(args.burst * (1.0 - args.duty) / max(args.duty, 0.01))
    del held
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
