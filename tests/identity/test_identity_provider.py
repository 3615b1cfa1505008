"""The one host identity provider: IMDS compute metadata (through the shared, caching client) and the
KVP pool's physical host, looked at on one thread; the loop stamps each snapshot with the latest look,
and ``gpumon run`` builds a provider only where a sink or the health stage reads it."""

from __future__ import annotations

import threading

from gpumon import imds
from gpumon.cli import schemas
from gpumon.collectors.base import Context
from gpumon.config import Config, load
from gpumon.daemon.identity import identity_provider
from gpumon.daemon.loop import UNASKED, Loop
from gpumon.daemon.plan import Plan
from gpumon.identity import IdentityProvider
from gpumon.model import HostIdentity
from gpumon.simulate.azure import write_kvp_pool
from gpumon.simulate.imds import COMPUTE, COMPUTE_PATH, ImdsServer
from gpumon.sinks.base import Sink
from tests.conftest import closed_port, wait_for
from tests.fakes import otlp as receivers

http_receiver = receivers.http_receiver  # the OTLP receiver fixture


def pool_file(tmp_path, host: str = "PHX0123456789") -> str:
    path = str(tmp_path / "kvp_pool_3")
    write_kvp_pool(path, {"PhysicalHostName": host, "VirtualMachineName": "gpu-node-0_3"})
    return path


def config(url: str, pool: str = "", **env: str) -> Config:
    return load(schemas(), None, {"GPUMON_AZURE_IMDS_URL": url, "GPUMON_HOST_INFO_KVP_POOL": pool,
                                  "GPUMON_AZURE_COMPUTE_REFRESH": "600", **env}, {})


def test_a_look_reads_imds_and_the_kvp_pool(tmp_path) -> None:
    server = ImdsServer()
    try:
        provider = IdentityProvider.from_config(config(server.url, pool_file(tmp_path)))
        assert provider.current() == HostIdentity() and not provider.current().asked
        found = provider.look()
        assert found.asked and not found.off_azure and found.physical_host == "PHX0123456789"
        assert found.instance is not None and found.instance.vm_id == COMPUTE["vmId"]
        assert found.vm_size() == COMPUTE["vmSize"] and provider.current() is found
    finally:
        server.close()


def test_the_kvp_pool_is_read_anew_while_imds_answers_from_the_cache(tmp_path) -> None:
    """A live migration moves the VM to another physical host: the next look sees it, without
    asking IMDS again before ``[azure] compute_refresh``."""
    server = ImdsServer()
    try:
        pool = pool_file(tmp_path)
        provider = IdentityProvider.from_config(config(server.url, pool))
        provider.look()
        write_kvp_pool(pool, {"PhysicalHostName": "PHX9999999999"})
        assert provider.look().physical_host == "PHX9999999999"
        assert server.count(COMPUTE_PATH) == 1
    finally:
        server.close()


def test_off_azure_is_known_and_a_5xx_is_not(tmp_path) -> None:
    off = IdentityProvider.from_config(config(f"http://127.0.0.1:{closed_port()}"))
    found = off.look()
    assert found.asked and found.off_azure and found.instance is None and found.vm_size() == ""
    server = ImdsServer()
    try:
        server.fail(COMPUTE_PATH, 500)
        failing = IdentityProvider.from_config(config(server.url))
        assert failing.look().vm_size() is None  # unknown: not "off Azure", asked again
    finally:
        server.close()


def test_the_thread_asks_again_soon_after_a_failure_and_says_when_the_identity_changes() -> None:
    server = ImdsServer()
    changes: list[int] = []
    try:
        server.fail(COMPUTE_PATH, 500)
        provider = IdentityProvider(imds.configured({"imds_url": server.url, "compute_refresh": 10.0}), "",
                                    on_change=lambda: changes.append(1), ask_again=0.1)
        provider.start()
        wait_for(lambda: server.count(COMPUTE_PATH) >= 1)
        assert provider.current().vm_size() is None
        server.fail(COMPUTE_PATH, None)
        wait_for(lambda: provider.current().vm_size() == COMPUTE["vmSize"])
        provider.stop()
        assert len(changes) == 2  # the failed look, then the answer; an unchanged look says nothing
    finally:
        server.close()


def test_the_loop_stamps_every_snapshot_with_the_latest_look(tmp_path) -> None:
    server = ImdsServer()
    try:
        cfg = config(server.url, pool_file(tmp_path))
        provider = IdentityProvider.from_config(cfg)
        loop = Loop(cfg, Plan(), Context(hostname="h", config=cfg), [], identity=provider)
        loop.start()
        try:
            # the provider's answer wakes the loop: no waiting for the next REFRESH
            wait_for(lambda: loop.latest is not None and loop.latest.identity is not None
                     and loop.latest.identity.asked, timeout=Loop.REFRESH - 1)
            assert loop.latest is not None and loop.latest.identity == provider.current()
        finally:
            loop.stop(2)
        successor = IdentityProvider.from_config(cfg)
        Loop(cfg, Plan(), Context(hostname="h", config=cfg), [], identity=successor).carry_over(loop)
        assert successor.current() == provider.current()  # a reload does not forget the host meanwhile
    finally:
        server.close()


def test_a_loop_without_a_provider_stamps_an_identity_not_asked() -> None:
    """``gpumon once``: nothing is asked, so the health stage holds no inventory (as before)."""
    cfg = config(f"http://127.0.0.1:{closed_port()}")
    assert Loop(cfg, Plan(), Context(hostname="h", config=cfg), []).compose().identity is UNASKED


class _Reads(Sink):
    name = "reads"

    def __init__(self, overrides: dict | None) -> None:
        self._overrides = overrides

    def identity_overrides(self) -> dict | None:
        return self._overrides


def test_a_provider_runs_only_where_the_identity_is_read() -> None:
    cfg = config(f"http://127.0.0.1:{closed_port()}")
    assert identity_provider(cfg, ["infiniband", "linkflap"], []) is None  # the baseline holds the ports
    assert identity_provider(cfg, ["nvml"], [_Reads(None)]) is not None  # the health stage judges the GPUs
    assert identity_provider(config(cfg.sections["azure"]["imds_url"], GPUMON_HEALTH_VM_SIZE="Standard_X"),
                             ["nvml"], []) is None  # [health] vm_size says it: IMDS is not asked
    assert identity_provider(config("http://127.0.0.1:1", GPUMON_HEALTH_ENABLED="false"), ["nvml"], []) is None
    provider = identity_provider(cfg, [], [_Reads({"imds_url": "http://127.0.0.1:2", "imds_timeout": 2.5})])
    assert provider is not None and provider.client is imds.client("http://127.0.0.1:2")
    assert provider.client.timeout == 2.5  # a sink's deprecated key, honoured by the one provider


def test_two_sinks_naming_different_imds_are_told_which_one_is_asked(caplog) -> None:
    cfg = config(f"http://127.0.0.1:{closed_port()}")
    first, second = _Reads({"imds_url": "http://127.0.0.1:3"}), _Reads({"imds_url": "http://127.0.0.1:4"})
    second.name = "other"
    with caplog.at_level("WARNING", logger="gpumon.daemon"):
        provider = identity_provider(cfg, [], [first, second])
    assert provider is not None and provider.client is imds.client("http://127.0.0.1:4")
    assert "gpumon asks one IMDS, and takes 'http://127.0.0.1:4'" in caplog.text


def identity_threads() -> list[str]:
    """Threads that ask IMDS for the identity (the sinks' and the health stage's own were ``*-imds``; the
    simulated host's IMDS server, ``imds-stand-in``, answers)."""
    return [t.name for t in threading.enumerate()
            if t.is_alive() and (t.name.endswith("-imds") or t.name == "host-identity")]


def test_a_running_daemon_asks_for_its_identity_on_one_thread_across_a_reload(tmp_path, http_receiver) -> None:
    """``gpumon run --simulate`` with the OTel sink and the health stage (both read the identity): one
    ``host-identity`` thread and no other IMDS thread; the sink's resource and every snapshot carry the
    simulated VM; a reload leaves one thread, and the new loop knows the host from its first snapshot."""
    from gpumon.daemon.reload import Daemon

    env = {"GPUMON_DAEMON_STATE_DIR": str(tmp_path / "state"), "GPUMON_DAEMON_SIMULATE": "nd-h100-v5",
           "GPUMON_DAEMON_SINKS": "prometheus,otel", "GPUMON_PROMETHEUS_LISTEN": "127.0.0.1:0",
           "GPUMON_OTEL_ENDPOINT": http_receiver.endpoint, "GPUMON_OTEL_LOGS": "false"}
    before = identity_threads()
    daemon = Daemon(load(schemas(), None, env, {}))
    daemon.start()
    try:
        assert daemon.loop is not None and daemon.loop.identity is not None
        wait_for(lambda: daemon.loop is not None and daemon.loop.latest is not None
                 and daemon.loop.latest.identity is not None and daemon.loop.latest.identity.asked)
        assert identity_threads() == [*before, "host-identity"]
        assert daemon.loop.latest.identity.vm_size() == "Standard_ND96isr_H100_v5"
        http_receiver.wait(lambda r: any(
            a.key == "host.type" for m in r.metrics for rm in m.resource_metrics for a in rm.resource.attributes))
        first = daemon.loop
        daemon.reload(load(schemas(), None, {**env, "GPUMON_DAEMON_INTERVAL": "5"}, {}))
        assert daemon.loop is not first and daemon.loop.identity is not first.identity
        assert daemon.loop.identity.current() == first.identity.current()  # known before its first look
        wait_for(lambda: identity_threads() == [*before, "host-identity"])
    finally:
        daemon.stop()
    wait_for(lambda: identity_threads() == before)
