"""Artefacts that several test files need, made once per test run and shared: gpumon's wheel from
this checkout, the wheels of its dependencies for this interpreter, and those for Debian 12's python3.

A session fixture alone would make them once per pytest-xdist worker (each worker is a process with
its own session), so :func:`made_once` keeps each artefact in a directory shared by the whole run and
makes it under an exclusive lock: the first test to need it makes it, the others wait for it and read
it. Tests only read these directories; a test that changes an artefact copies it first.

Building gpumon from the checkout writes into the checkout (setuptools' ``build/`` and ``*.egg-info``),
so two builds at once in one checkout could break each other: every step that builds or installs the
checkout in place holds :func:`checkout_build_lock` (the wheel below, scripts/sbom.sh's own wheel, the
editable install of the plugin test).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's temporary directory, the same for every xdist worker (each worker's own basetemp is a
    ``popen-gwN`` directory inside it); without xdist, the session's basetemp."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def run_lock(run: Path, name: str, shared: bool = False) -> Iterator[None]:
    """An advisory lock named ``name``, held across every worker of the run whose directory is ``run``
    (flock(2) on a file there); ``shared``: a reader's lock, held by many at once but never beside an
    exclusive one. Released when the holder exits, however it exits."""
    with open(run / f"{name}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def checkout_build_lock(tmp_path_factory: pytest.TempPathFactory) -> contextlib.AbstractContextManager[None]:
    """Held while pip builds or installs this checkout in place (it writes build/ and *.egg-info here)."""
    return run_lock(run_dir(tmp_path_factory), "checkout-build")


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """The directory ``name`` of this run, made by ``make(directory)`` the first time it is asked for.

    A ``make`` that fails leaves nothing behind: the next test that asks makes it again (and fails with
    its own error), so a failed build is reported by every test that needs it, as without sharing."""
    directory = run_dir(tmp_path_factory) / f"artefact-{name}"
    made = directory.with_name(directory.name + ".made")  # beside it: the directory holds the artefact only
    with run_lock(run_dir(tmp_path_factory), f"artefact-{name}"):
        if not made.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            try:
                make(directory)
            except BaseException:
                shutil.rmtree(directory, ignore_errors=True)
                raise
            made.touch()
    return directory


def gpumon_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpumon's own wheel, built from this checkout once per run."""
    from tests.support.artefacts import build_wheel

    def make(out: Path) -> None:
        with checkout_build_lock(tmp_path_factory):
            build_wheel(out)

    (found,) = made_once(tmp_path_factory, "wheel", make).glob("gpumon_exporter-*.whl")
    return found


def local_wheelhouse(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """Binary wheels of everything gpumon needs with every extra (``[all]``), for this interpreter,
    without gpumon's own wheel: what ``--no-index --find-links`` installs from, whatever the extras."""
    from tests.support.artefacts import download_dependencies

    def make(out: Path) -> None:
        download_dependencies(wheel, out, extras="all")

    return made_once(tmp_path_factory, "wheelhouse-all", make)


def bookworm_wheelhouse(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """gpumon's wheel and the wheels of its dependencies for Debian 12's python3 (tests/support/debian_root.py),
    in one directory: the offline wheelhouse of build.sh and of the installer inside a Debian root."""
    from tests.support.debian_root import wheelhouse

    def make(out: Path) -> None:
        wheelhouse(str(wheel), out)
        shutil.copy(wheel, out / wheel.name)

    return made_once(tmp_path_factory, "wheelhouse-bookworm", make)


def build_wheel(out: Path) -> Path:
    """gpumon's own wheel, built from this checkout.

    setuptools builds in the checkout's ``build/`` and packs whatever its ``build/lib`` holds, a module
    since moved or deleted included: that scratch directory (ignored by git) goes first, so the wheel
    holds the checkout as it is now."""
    shutil.rmtree(REPO / "build", ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(REPO)],
        check=True, timeout=240, capture_output=True,
    )
    (found,) = out.glob("gpumon_exporter-*.whl")
    return found


def download_dependencies(wheel: Path, out: Path, extras: str = "") -> Path:
    """Binary wheels of everything ``wheel[extras]`` needs, for this interpreter, without the wheel."""
    requirement = f"{wheel}[{extras}]" if extras else str(wheel)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "-d", str(out), requirement],
        check=True, timeout=280, capture_output=True,
    )
    (out / wheel.name).unlink(missing_ok=True)
    return out
