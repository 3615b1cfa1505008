"""deploy/debian/build.sh: gpumon's .deb, built and tried in a throwaway Debian 12 root.

The wheel is built here and its dependencies fetched for bookworm's python3 (tests/support/debian_root.py);
build.sh then runs inside the root (Debian 12: its python3 3.11, its dpkg-deb), twice: revision 1
and revision 2. In a fresh overlay of that root, where systemd is not PID 1 as in a container,
``apt-get install ./gpumon_*.deb`` installs revision 1 (its dependencies are already there or in
the root's apt cache: no network); then ``systemd-analyze verify`` on the installed unit,
``gpumon once --simulate nd-h100-v5``, an edit of the config, the upgrade to revision 2, and
``apt-get purge``. lintian (Debian package ``lintian``) checks the .deb on this host; every
override it reports is justified in deploy/debian/lintian-overrides.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Two builds and apt in a chroot, then lintian: about two minutes on a loaded machine.
pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

FACTS = ("echo user=$(getent passwd gpumon | cut -d: -f1,7); "
         "echo state=$(stat -c %U:%a /var/lib/private/gpumon 2>/dev/null); "
         "echo state_link=$(readlink /var/lib/gpumon); "
         "echo env=$(stat -c %a /etc/gpumon/gpumon.env 2>/dev/null); "
         "echo enabled=$(test -L /etc/systemd/system/multi-user.target.wants/gpumon.service && echo y || echo n); "
         "echo unit=$(test -f /lib/systemd/system/gpumon.service && echo y || echo n); "
         "echo kmsg=$(test -f /lib/systemd/system/gpumon.service.d/kmsg.conf && echo y || echo n); "
         "echo venv=$(test -d /opt/gpumon && echo y || echo n); "
         "echo path=$(readlink /usr/bin/gpumon); "
         "echo etc=$(test -e /etc/gpumon && echo y || echo n); "
         "echo version=$(dpkg-query -W -f '${Version} ${db:Status-Abbrev}' gpumon 2>/dev/null)")


def facts(stdout: str, marker: str) -> dict[str, str]:
    """key=value lines the script printed after ``=== marker``."""
    section = stdout.split(f"=== {marker}\n", 1)[1].split("===", 1)[0]
    return dict(line.split("=", 1) for line in section.splitlines() if "=" in line)


def section(stdout: str, marker: str) -> str:
    return stdout.split(f"=== {marker}\n", 1)[1].split("\n===", 1)[0]


@pytest.fixture(scope="module")
def debs(tmp_path_factory, bookworm_wheelhouse) -> dict[str, Path]:
    """Revisions 1 and 2 of the package, built by build.sh inside the Debian 12 root from gpumon's wheel
    and its dependencies for bookworm (made once per run, shared with the VM installer's test)."""
    from tests.support.debian_root import debian_root, run_in_root

    wheels = bookworm_wheelhouse
    work = tmp_path_factory.mktemp("build")
    script = " && ".join(f"sh /src/deploy/debian/build.sh --wheelhouse /wheels --revision {rev} --out /tmp/out"
                         for rev in (1, 2))
    out = run_in_root(debian_root(), work, script, {"/src": REPO, "/wheels": wheels}, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    built = {p.name.split("_")[1].split("-")[1]: p for p in (work / "upper/tmp/out").glob("gpumon_*.deb")}
    assert sorted(built) == ["1", "2"], out.stdout
    return built


@pytest.fixture(scope="module")
def lifecycle(debs, tmp_path_factory) -> str:
    """Install, verify, run, edit the config, upgrade, purge: the script's output, by section."""
    from tests.support.debian_root import debian_root, run_in_root

    apt = "DEBIAN_FRONTEND=noninteractive apt-get -y -q --no-install-recommends -o Dpkg::Use-Pty=0"
    script = "; ".join([
        "cd /debs",
        "echo === install", f"{apt} install ./{debs['1'].name} 2>&1; echo rc=$?", FACTS,
        "echo pyc=$(find /opt/gpumon/lib -name 'cli.cpython-*.pyc' -path '*/gpumon/*' | grep -c pyc)",
        "echo === verify", "systemd-analyze verify /lib/systemd/system/gpumon.service 2>&1; echo rc=$?",
        "echo === once", "gpumon once --simulate nd-h100-v5 --format prometheus --state-dir /var/lib/gpumon 2>&1;"
        " echo rc=$?",
        "echo === edit", "sed -i 's/^interval = 10.0$/interval = 15.0/' /etc/gpumon/gpumon.toml",
        "echo AZURE_CLIENT_ID=edited >> /etc/gpumon/gpumon.env",
        # a key renamed since the config was written: [otel] certificate is now ca_file
        "printf '[otel]\\ncertificate = \"/etc/ssl/certs/ca-certificates.crt\"\\n' >> /etc/gpumon/gpumon.toml",
        "echo === upgrade", f"{apt} install ./{debs['2'].name} 2>&1; echo rc=$?", FACTS,
        "grep -c '^interval = 15.0$' /etc/gpumon/gpumon.toml | sed 's/^/edited_config=/'",
        "grep -c '^AZURE_CLIENT_ID=edited$' /etc/gpumon/gpumon.env | sed 's/^/edited_env=/'",
        "grep -c '^certificate = ' /etc/gpumon/gpumon.toml | sed 's/^/renamed_kept=/'",
        "echo leftovers=$(ls /etc/gpumon | grep -c dpkg)",
        "echo simulated_state=$(ls /var/lib/gpumon/simulate 2>/dev/null | tr '\\n' ,)",
        "echo === remove", f"{apt} remove gpumon 2>&1; echo rc=$?", FACTS,
        "echo === purge", f"{apt} purge gpumon 2>&1; echo rc=$?", FACTS,
        "echo private=$(test -e /var/lib/private/gpumon && echo y || echo n)",
        "echo ===",
    ])
    out = run_in_root(debian_root(), tmp_path_factory.mktemp("lifecycle"), script, {"/debs": debs["1"].parent},
                      timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_install_in_a_container_creates_user_state_and_enables_the_unit(lifecycle):
    installed = facts(lifecycle, "install")
    log = section(lifecycle, "install")
    assert installed["rc"] == "0", log
    assert installed == {
        "rc": "0", "user": "gpumon:/usr/sbin/nologin", "state": "gpumon:700", "state_link": "private/gpumon",
        "env": "600", "enabled": "y", "unit": "y", "kmsg": "y", "venv": "y", "path": "/opt/gpumon/bin/gpumon",
        "etc": "y", "version": "0.1.0-1 ii", "pyc": "1",
    }, log
    # No systemd to talk to: the unit is enabled for the next boot and the postinst says so.
    assert "systemd is not running here (no /run/systemd/system)" in log
    assert "Failed to connect to bus" not in log and "Can't operate" not in log


def test_installed_unit_verifies(lifecycle):
    verify = section(lifecycle, "verify")
    assert verify.splitlines()[-1] == "rc=0", verify
    assert "gpumon.service" not in verify, verify  # systemd-analyze names the unit in every complaint


def test_packaged_gpumon_runs_a_simulated_host(lifecycle):
    once = section(lifecycle, "once")
    assert once.splitlines()[-1] == "rc=0", once
    assert "gpumon_gpu_utilization_ratio{" in once
    assert "gpumon_ib_hw_stat_total{" in once


def test_upgrade_keeps_the_edited_config_and_secrets(lifecycle):
    upgraded = facts(lifecycle, "upgrade")
    log = section(lifecycle, "upgrade")
    assert upgraded["rc"] == "0", log
    assert upgraded["version"] == "0.1.0-2 ii", log
    assert (upgraded["edited_config"], upgraded["edited_env"], upgraded["leftovers"]) == ("1", "1", "0"), log
    assert (upgraded["enabled"], upgraded["state_link"], upgraded["path"]) == ("y", "private/gpumon",
                                                                              "/opt/gpumon/bin/gpumon"), log
    # The state the run before the upgrade wrote is still there.
    assert "nd-h100-v5" in upgraded["simulated_state"], log


def test_upgrade_names_the_new_name_of_a_renamed_key_and_keeps_the_file(lifecycle):
    upgraded = facts(lifecycle, "upgrade")
    log = section(lifecycle, "upgrade")
    assert upgraded["rc"] == "0", log
    assert "gpumon: [otel] certificate is deprecated (honoured for now): use [otel] ca_file" in log, log
    assert "gpumon: config    /etc/gpumon/gpumon.toml: ok" in log, log
    assert upgraded["renamed_kept"] == "1", log


def test_remove_keeps_config_and_state(lifecycle):
    removed = facts(lifecycle, "remove")
    log = section(lifecycle, "remove")
    assert removed["rc"] == "0", log
    # The enablement link stays until purge, as for every Debian service (deb-systemd-helper keeps
    # the state so that a reinstall restores it); with the unit gone it enables nothing.
    assert removed == {
        "rc": "0", "user": "gpumon:/usr/sbin/nologin", "state": "gpumon:700", "state_link": "private/gpumon",
        "env": "600", "enabled": "y", "unit": "n", "kmsg": "n", "venv": "n", "path": "", "etc": "y",
        "version": "0.1.0-2 rc",
    }, log


def test_purge_removes_state_config_and_unit(lifecycle):
    purged = facts(lifecycle, "purge")
    log = section(lifecycle, "purge")
    assert purged["rc"] == "0", log
    assert purged == {
        "rc": "0", "user": "gpumon:/usr/sbin/nologin", "state": "", "state_link": "", "env": "", "enabled": "n",
        "unit": "n", "kmsg": "n", "venv": "n", "path": "", "etc": "n", "version": "", "private": "n",
    }, log


def test_lintian_is_clean_with_justified_overrides(debs):
    lintian = shutil.which("lintian")
    assert lintian, "lintian is missing: apt-get install lintian"
    out = subprocess.run([lintian, "--no-tag-display-limit", "--fail-on", "error,warning", str(debs["2"])],
                         capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not [line for line in out.stdout.splitlines() if line[:2] in ("E:", "W:", "I:")], out.stdout
    # Every override in the file carries a comment saying why.
    overrides = (REPO / "deploy/debian/lintian-overrides").read_text().splitlines()
    for i, line in enumerate(overrides):
        if line.startswith("gpumon:"):
            assert i > 0 and overrides[i - 1].startswith(("#", "gpumon:")), line


def test_package_ships_the_units_of_systemd_dir_and_the_script_routes_config(debs, tmp_path):
    subprocess.run(["dpkg-deb", "-x", str(debs["1"]), str(tmp_path)], check=True, timeout=60)
    assert (tmp_path / "lib/systemd/system/gpumon.service").read_text() == \
        (REPO / "systemd/gpumon.service").read_text()
    assert (tmp_path / "lib/systemd/system/gpumon.service.d/kmsg.conf").read_text() == \
        (REPO / "systemd/gpumon.service.d/kmsg.conf").read_text()
    config = (tmp_path / "etc/gpumon/gpumon.toml").read_text()
    assert config.startswith("# gpumon configuration (TOML).") and 'state_dir = "/var/lib/gpumon"' in config
    fields = subprocess.run(["dpkg-deb", "-f", str(debs["1"]), "Package", "Depends"], capture_output=True,
                            text=True, check=True, timeout=60).stdout
    assert "Package: gpumon\n" in fields and "python3 (<< 3.12)" in fields and "procps" in fields
    ctrl = tmp_path / "ctrl"
    subprocess.run(["dpkg-deb", "-e", str(debs["1"]), str(ctrl)], check=True, timeout=60)
    assert (ctrl / "conffiles").read_text() == "/etc/gpumon/gpumon.toml\n"
    # The venv names its installed path only, never where it was built.
    script = (tmp_path / "opt/gpumon/bin/gpumon").read_text()
    assert script.startswith("#!/opt/gpumon/bin/python")


def test_build_refuses_bad_arguments(tmp_path):
    out = subprocess.run(["sh", str(REPO / "deploy/debian/build.sh"), "--revision", "a b"], capture_output=True,
                         text=True, timeout=30, check=False)
    assert out.returncode == 1 and "not a Debian revision: a b" in out.stderr
    out = subprocess.run(["sh", str(REPO / "deploy/debian/build.sh"), "--extras", "gpu"], capture_output=True,
                         text=True, timeout=30, check=False)
    assert out.returncode == 1 and "--extras takes otel, azure" in out.stderr


def test_scripts_pass_shellcheck():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: apt-get install shellcheck"
    scripts = [REPO / "deploy/debian" / name for name in ("build.sh", "postinst", "prerm", "postrm")]
    out = subprocess.run([shellcheck, "-s", "sh", *map(str, scripts)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stdout
