"""Make the NVIDIA driver report one XID on GPU 0, to check the XID path on a real host.

One CUDA kernel writes through an unmapped device address (0x8). The GPU's MMU faults, the driver
logs ``NVRM: Xid (PCI:...): 31, pid=..., name=..., ... MMU Fault: ...`` to the kernel log, posts an
``nvmlEventTypeXidCriticalError`` event with data 31, and tears down only this process's CUDA context:
the GPU, other processes and their contexts are not affected, and no reset is needed (XID 31's
documented resolution is "user application fault"). Needs CuPy (``cupy-cuda12x`` / ``cupy-cuda13x``).

Only for a GPU you own and that runs nothing else you care about: XID 31 counts as an error on every
dashboard and alert that watches XIDs, gpumon's own included.
"""

from __future__ import annotations

import sys


def main() -> int:
    import cupy as cp  # the only dependency, and only here

    kernel = cp.RawKernel(r'''
extern "C" __global__ void write_unmapped(int *unused) {
    *(volatile int *)0x8 = 1;
}
''', "write_unmapped")
    kernel((1,), (1,), (cp.zeros(1, dtype=cp.int32),))
    try:
        cp.cuda.runtime.deviceSynchronize()
    except cp.cuda.runtime.CUDARuntimeError as exc:
        print(f"kernel faulted as intended: {exc}")
        return 0
    print("the kernel did not fault: no XID was provoked", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
