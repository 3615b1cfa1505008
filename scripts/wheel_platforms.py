#!/usr/bin/env python3
"""Print pip's ``--platform`` options for the wheels a Linux target of another architecture takes.

    wheel_platforms.py [ARCH] [--glibc MAJOR.MINOR]

ARCH is a Docker/OCI architecture (``amd64``, ``arm64``) or a machine name (``x86_64``, ``aarch64``);
empty or absent means this machine's. The glibc is this machine's unless given: the Dockerfile's build
stage runs the same base image as the target, only on the build machine's platform, so its glibc is
the target's. The tags are every manylinux tag that glibc accepts (PEP 600, with the older aliases of
PEP 513, 571 and 599), newest first, as pip lists them for a native install.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

MACHINES = {"amd64": "x86_64", "x86_64": "x86_64", "arm64": "aarch64", "aarch64": "aarch64"}
# The oldest glibc each architecture's manylinux wheels were built against (PEP 599: aarch64 from
# manylinux2014, glibc 2.17; x86_64 from manylinux1, glibc 2.5).
OLDEST = {"x86_64": 5, "aarch64": 17}
ALIASES = {(2, 5): "manylinux1", (2, 12): "manylinux2010", (2, 17): "manylinux2014"}


def glibc_here() -> tuple[int, int]:
    name, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
    if name != "glibc":
        raise SystemExit("wheel_platforms.py: this machine's C library is not glibc; give --glibc")
    return parse_glibc(version)


def platform_tags(arch: str, glibc: tuple[int, int]) -> list[str]:
    machine = MACHINES.get(arch or platform.machine())
    if machine is None:
        raise SystemExit(f"wheel_platforms.py: unsupported architecture {arch!r} (one of {', '.join(MACHINES)})")
    major, newest = glibc
    tags = []
    for minor in range(newest, OLDEST[machine] - 1, -1):
        tags.append(f"manylinux_{major}_{minor}_{machine}")
        alias = ALIASES.get((major, minor))
        if alias:
            tags.append(f"{alias}_{machine}")
    return tags


def parse_glibc(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arch", nargs="?", default="")
    parser.add_argument("--glibc", help="MAJOR.MINOR of the target's glibc (default: this machine's)")
    args = parser.parse_args(argv)
    glibc = parse_glibc(args.glibc) if args.glibc else glibc_here()
    print(" ".join(f"--platform {tag}" for tag in platform_tags(args.arch, glibc)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
