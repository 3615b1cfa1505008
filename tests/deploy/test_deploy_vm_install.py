"""deploy/vm/install.sh in a throwaway prefix: installs from a locally built wheel, writes a unit that
verifies, re-runs idempotently (keeping the operator's config), and uninstalls. Then as root in a
minimal Debian bookworm where systemd is not PID 1 (tests/support/debian_root.py: a container's namespaces on
a debootstrap root): it says so, enables the unit for the next boot, installs procps for the unit's
/bin/kill, and uninstalls there too.

The wheel is built here; its dependencies are fetched once into a wheelhouse (the package index
through pip's own configuration), and the installer then runs with --no-index --find-links on it:
its venv depends on nothing of the interpreter running the tests, which may itself be a venv, a
pyenv build or the system Python. The installer's pip sees no pip configuration of this machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.vm_install import REPO, SCRIPT, run_install

UNIT = REPO / "systemd" / "gpumon.service"

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture(scope="module")
def wheel(gpumon_wheel) -> Path:
    return gpumon_wheel  # built once per run (tests/support/artefacts.py), shared with the other install tests


@pytest.fixture(scope="module")
def wheelhouse(gpumon_wheelhouse) -> Path:
    return gpumon_wheelhouse  # every extra's dependencies too: the installer takes what it needs


@pytest.fixture(scope="module")
def offline_args(wheel, wheelhouse) -> list[str]:
    return ["--wheel", str(wheel), "--python", sys.executable, "--pip-arg=--no-index",
            f"--pip-arg=--find-links={wheelhouse}", "--no-os-deps"]


@pytest.fixture(scope="module")
def installed(offline_args, tmp_path_factory) -> Path:
    """One prefix installed for the file (a venv costs seconds of pip). The tests only read it, but for the
    re-run, which by its nature leaves it as it found it (the operator's config edit aside)."""
    prefix = tmp_path_factory.mktemp("root")
    out = run_install("--prefix", str(prefix), *offline_args)
    assert out.returncode == 0, out.stdout + out.stderr
    return prefix


def test_the_wheel_ships_the_package_and_nothing_of_the_checkout(wheel):
    """The wheel holds gpumon/ and its dist-info only: the tests, their stand-ins and the tools for
    real GPU hosts (tools/nvml_record.py) stay in the checkout."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert "gpumon/cli.py" in names
    assert {name.split("/")[0] for name in names} == {"gpumon", wheel.name.split("-py")[0] + ".dist-info"}
    assert not [name for name in names if name.endswith("nvml_record.py")]


def test_prefix_install_lays_out_venv_config_and_unit(installed):
    assert os.access(installed / "opt/gpumon/bin/gpumon", os.X_OK)
    assert (installed / "etc/gpumon/gpumon.toml").is_file()
    assert (installed / "etc/gpumon/gpumon.toml.default").is_file()
    assert (installed / "etc/systemd/system/gpumon.service").is_file()
    env_file = installed / "etc/gpumon/gpumon.env"
    assert env_file.stat().st_mode & 0o777 == 0o600, "the secrets file must be 0600"


def test_the_venv_runs_gpumon_from_the_wheel_not_the_checkout(installed):
    python = installed / "opt/gpumon/bin/python"
    out = subprocess.run(
        [str(python), "-c", "import gpumon; print(gpumon.__file__)"],
        capture_output=True, text=True, timeout=60, check=True, cwd=installed,
    )
    assert out.stdout.strip().startswith(str(installed / "opt/gpumon")), out.stdout


def test_written_unit_points_into_the_prefix_and_verifies(installed):
    unit = installed / "etc/systemd/system/gpumon.service"
    text = unit.read_text()
    assert f"ExecStart={installed}/opt/gpumon/bin/gpumon run --config {installed}/etc/gpumon/gpumon.toml" in text
    assert f"EnvironmentFile=-{installed}/etc/gpumon/gpumon.env" in text
    out = subprocess.run(
        [shutil.which("systemd-analyze") or "systemd-analyze", "verify", "--no-pager", str(unit)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "gpumon.service" not in out.stderr, out.stderr


def test_default_config_is_valid_for_the_daemon(installed):
    from gpumon.config import DAEMON, SectionSchema, load
    from gpumon.sinks.prometheus import OPTIONS as PROMETHEUS

    schemas: list[SectionSchema] = [DAEMON, PROMETHEUS]
    cfg = load(schemas, str(installed / "etc/gpumon/gpumon.toml"), environ={})
    assert cfg.daemon.sysfs_root == "/sys"
    assert cfg.daemon.state_dir == "/var/lib/gpumon"
    assert cfg["prometheus"].listen == "0.0.0.0:9470"


def test_rerun_is_idempotent_and_keeps_the_operators_config(installed, offline_args):
    config = installed / "etc/gpumon/gpumon.toml"
    config.write_text(config.read_text().replace("interval = 10.0", "interval = 5.0"))
    unit = installed / "etc/systemd/system/gpumon.service"
    drop_in = installed / "etc/systemd/system/gpumon.service.d/kmsg.conf"
    before = unit.read_text(), drop_in.read_text()

    again = run_install("--prefix", str(installed), *offline_args)
    assert again.returncode == 0, again.stderr
    assert "interval = 5.0" in config.read_text()
    assert "kept the config" in again.stdout
    assert "wrote " + str(unit) not in again.stdout, "an unchanged unit is not rewritten"
    assert (unit.read_text(), drop_in.read_text()) == before
    assert (installed / "opt/gpumon/bin/gpumon").exists()


def test_no_kmsg_removes_the_drop_in_and_uninstall_keeps_config_then_purge(offline_args, tmp_path):
    drop_in = tmp_path / "etc/systemd/system/gpumon.service.d/kmsg.conf"
    assert run_install("--prefix", str(tmp_path), *offline_args).returncode == 0
    out = run_install("--prefix", str(tmp_path), "--no-kmsg", *offline_args)
    assert out.returncode == 0, out.stderr
    assert not drop_in.parent.exists()
    assert "removed " + str(drop_in) in out.stdout

    out = run_install("--prefix", str(tmp_path), "--uninstall")
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "opt/gpumon").exists()
    assert not (tmp_path / "etc/systemd/system/gpumon.service").exists()
    assert not (tmp_path / "etc/systemd/system/gpumon.service.d").exists()
    assert (tmp_path / "etc/gpumon/gpumon.toml").exists()
    out = run_install("--prefix", str(tmp_path), "--uninstall", "--purge")
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "etc/gpumon").exists()


def test_destdir_stages_with_final_paths_in_the_unit(offline_args, tmp_path):
    # A packager's staging root: files under DESTDIR, the unit still naming /opt/gpumon.
    out = run_install(*offline_args, env={"DESTDIR": str(tmp_path)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "opt/gpumon/bin/gpumon").exists()
    assert (tmp_path / "etc/systemd/system/gpumon.service").read_text() == UNIT.read_text()


def test_embedded_unit_is_the_shipped_unit():
    # install.sh carries its own copy so it can be fetched alone (cloud-init); keep them identical.
    text = SCRIPT.read_text()
    match = re.search(r"cat <<'UNIT'\n(.*?)^UNIT$", text, re.S | re.M)
    assert match, "unit heredoc not found in install.sh"
    assert match.group(1) == UNIT.read_text(), (
        "deploy/vm/install.sh's unit_text() differs from systemd/gpumon.service: paste the unit in again")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "unknown option: --bogus"),
        (["--extras", "gpu"], "--extras takes otel, azure, remote_write, attribution or all"),
        (["--wheel", "a.whl", "--version", "1.0"], "exclude each other"),
        (["--version", "0.1.0"], "--version needs --sha256"),
        (["--version", "0.1.0", "--sha256", "abc"], "--sha256 must be 64 hex digits"),
    ],
)
def test_bad_arguments_fail_with_a_reason(args, message, tmp_path):
    out = run_install("--prefix", str(tmp_path), *args)
    assert out.returncode != 0
    assert message in out.stderr


def test_missing_wheel_is_reported(tmp_path):
    out = run_install("--prefix", str(tmp_path), "--wheel", str(tmp_path / "nope.whl"),
                      "--python", sys.executable, "--no-os-deps")
    assert out.returncode != 0
    assert "no such wheel" in out.stderr


def test_script_passes_shellcheck():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "apt-get install shellcheck"
    out = subprocess.run([shellcheck, "-s", "sh", str(SCRIPT)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stdout


def test_cloud_init_snippet_runs_the_installer_on_the_operators_checked_wheel(tmp_path):
    import yaml

    doc_text = (REPO / "deploy/vm/cloud-init.yaml").read_text()
    assert doc_text.startswith("#cloud-config\n")
    doc = yaml.safe_load(doc_text)
    files = {f["path"]: f for f in doc["write_files"]}
    assert files["/etc/gpumon/gpumon.toml"]["permissions"] == "0644"
    commands = " ".join(" ".join(c) if isinstance(c, list) else c for c in doc["runcmd"])
    fetch = files[commands.strip()]
    assert fetch["permissions"] == "0700"
    script = fetch["content"]
    # Both files from the operator's storage account, both digests checked, the wheel route only.
    assert ".blob.core.windows.net/$CONTAINER/$RELEASE/$file" in script
    assert "| sha256sum -c -" in script
    assert 'install.sh" --wheel "$dir/$WHEEL" --sha256 "$WHEEL_SHA256"' in script
    for foreign in ("pypi", "githubusercontent", "--version", "pip install"):
        assert foreign not in script.lower(), foreign
    (tmp_path / "fetch.sh").write_text(script)
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "apt-get install shellcheck"
    out = subprocess.run([shellcheck, "-s", "sh", str(tmp_path / "fetch.sh")], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stdout
    # Left as shipped, it stops before any download.
    out = subprocess.run(["sh", str(tmp_path / "fetch.sh")], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 1 and "fill in the account and the digests first" in out.stderr


KMSG_DROP_IN = REPO / "systemd" / "gpumon.service.d" / "kmsg.conf"


def test_embedded_kmsg_drop_in_is_the_shipped_one():
    text = SCRIPT.read_text()
    match = re.search(r"cat <<'KMSG'\n(.*?)^KMSG$", text, re.S | re.M)
    assert match, "kmsg drop-in heredoc not found in install.sh"
    assert match.group(1) == KMSG_DROP_IN.read_text(), (
        "deploy/vm/install.sh's kmsg_drop_in_text() differs from systemd/gpumon.service.d/kmsg.conf: paste it in again")


def test_kmsg_drop_in_installed_by_default(installed):
    drop_in = installed / "etc/systemd/system/gpumon.service.d/kmsg.conf"
    assert drop_in.read_text() == KMSG_DROP_IN.read_text()


# ---- a minimal Debian where systemd is not PID 1 (a container, or a chroot building an image) -------

@pytest.fixture(scope="module")
def debian():
    from tests.support.debian_root import debian_root

    return debian_root()


@pytest.fixture(scope="module")
def bookworm_wheels(bookworm_wheelhouse) -> Path:
    return bookworm_wheelhouse  # gpumon's wheel and its dependencies for bookworm, once per run


def in_container(debian: Path, wheels: Path, work: Path, script: str) -> subprocess.CompletedProcess[str]:
    from tests.support.debian_root import run_in_root

    return run_in_root(debian, work, script, {"/src": SCRIPT.parent, "/wheels": wheels})


def installer(wheel: Path, *args: str) -> str:
    return (f"sh /src/install.sh --wheel /wheels/{wheel.name} --pip-arg=--no-index "
            f"--pip-arg=--find-links=/wheels {' '.join(args)}")


def facts(stdout: str, marker: str) -> dict[str, str]:
    """key=value lines the script printed after ``marker``."""
    section = stdout.split(f"=== {marker}\n", 1)[1].split("===", 1)[0]
    return dict(line.split("=", 1) for line in section.splitlines() if "=" in line)


STATE = ("echo enabled=$(test -L /etc/systemd/system/multi-user.target.wants/gpumon.service && echo y || echo n); "
         "echo venv=$(test -d /opt/gpumon && echo y || echo n); "
         "echo unit=$(test -f /etc/systemd/system/gpumon.service && echo y || echo n); "
         "echo kmsg=$(test -f /etc/systemd/system/gpumon.service.d/kmsg.conf && echo y || echo n); "
         "echo kill=$(test -x /bin/kill && echo y || echo n); "
         "echo config=$(test -f /etc/gpumon/gpumon.toml && echo y || echo n)")


def test_container_without_systemd_installs_enables_for_next_boot_then_uninstalls(debian, bookworm_wheels, wheel,
                                                                                    tmp_path):
    script = "; ".join([
        # The double is faithful: systemctl is here and cannot talk to a systemd, as in a container.
        "echo === systemctl", "systemctl daemon-reload 2>&1; echo rc=$?",
        "echo === install", installer(wheel) + " 2>&1; echo rc=$?", STATE,
        "echo === uninstall", "sh /src/install.sh --uninstall 2>&1; echo rc=$?", STATE, "echo ===",
    ])
    out = in_container(debian, bookworm_wheels, tmp_path, script)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "System has not been booted with systemd" in out.stdout.split("=== install")[0]

    installed = facts(out.stdout, "install")
    log = out.stdout.split("=== install", 1)[1].split("=== uninstall", 1)[0]
    assert installed["rc"] == "0", log
    assert "systemd is not running on this host (no /run/systemd/system" in log
    assert "gpumon.service is enabled and starts at the next boot with systemd; nothing was started" in log
    assert "(--no-start installs the same files and leaves the unit alone: not enabled, not started)" in log
    assert "Can't operate" not in log and "Failed to connect to bus" not in log
    # Enabled offline, the kernel-log drop-in by default, and /bin/kill from procps (apt-get, cached).
    assert installed | {"rc": "0"} == {"rc": "0", "enabled": "y", "venv": "y", "unit": "y", "kmsg": "y", "kill": "y",
                                       "config": "y"}, log
    assert "installing procps with apt-get" in log

    removed = facts(out.stdout, "uninstall")
    log = out.stdout.split("=== uninstall", 1)[1]
    assert removed["rc"] == "0", log
    assert "nothing to stop; removing the files" in log
    assert removed | {"rc": "0"} == {"rc": "0", "enabled": "n", "venv": "n", "unit": "n", "kmsg": "n", "kill": "y",
                                     "config": "y"}, log
    assert not (tmp_path / "upper/opt/gpumon").exists()


@pytest.fixture(scope="module")
def no_start_then_no_systemctl(debian, bookworm_wheels, wheel, tmp_path_factory) -> str:
    """One container, two runs (one venv): ``--no-start`` where systemctl is there, then, with systemctl
    removed, the installer run again as an image build that has no systemctl would run it."""
    script = "; ".join([
        "echo === no-start", installer(wheel, "--no-start", "--no-kmsg", "--no-os-deps") + " 2>&1; echo rc=$?",
        "echo === state", STATE,
        "rm /usr/bin/systemctl",
        "echo === no-systemctl", installer(wheel, "--no-os-deps") + " 2>&1; echo rc=$?",
        "echo === state-without", STATE, "echo ===",
    ])
    out = in_container(debian, bookworm_wheels, tmp_path_factory.mktemp("no-start"), script)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_no_start_in_a_container_leaves_the_unit_alone(no_start_then_no_systemctl):
    log = no_start_then_no_systemctl.split("=== state\n", 1)[0]
    state = facts(no_start_then_no_systemctl, "state")
    assert "rc=0" in log, log
    assert "not touching the service (--no-start): this run neither enabled, started nor restarted it" in log
    assert state == {"enabled": "n", "venv": "y", "unit": "y", "kmsg": "n", "kill": "n", "config": "y"}, log
    # --no-os-deps: procps is not installed, and the installer says what that breaks.
    assert ("warning: /bin/kill is missing (install procps): `systemctl reload gpumon` will fail until it is "
            "there; the service itself runs") in log


def test_container_without_systemctl_says_how_to_run_gpumon(no_start_then_no_systemctl):
    log = no_start_then_no_systemctl.split("=== no-systemctl\n", 1)[1].split("=== state-without", 1)[0]
    assert "rc=0" in log, log
    assert "and systemctl is not installed: /etc/systemd/system/gpumon.service is written but neither enabled nor " \
           "started" in log
    assert "to run gpumon here without systemd: /opt/gpumon/bin/gpumon run --config /etc/gpumon/gpumon.toml" in log
    assert facts(no_start_then_no_systemctl, "state-without")["enabled"] == "n"
