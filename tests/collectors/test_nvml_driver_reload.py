"""No library / no driver / version mismatch: the collector is unavailable with the reason, retries init
with backoff, and comes back (with the GPUs rediscovered) once the driver is loaded again."""

from __future__ import annotations

import pynvml
import pytest

from gpumon.cli import schemas
from gpumon.collectors.base import CollectorUnavailable, Context
from gpumon.collectors.nvml import NvmlCollector
from gpumon.collectors.nvml_session import NvmlSession
from gpumon.collectors.xid import XidCollector
from gpumon.config import load
from gpumon.daemon import Loop, plan_collectors
from gpumon.daemon.plan import close_plan as _close_plan
from gpumon.simulate.nvml import FakeNVML
from tests.conftest import wait_for


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def rig() -> tuple[FakeNVML, NvmlCollector, Clock, Context]:
    fake = FakeNVML("h100-sxm5-80gb", 2)
    clock = Clock()
    ctx = Context(hostname="test", nvml=fake)
    ctx.get_shared("nvml", lambda: NvmlSession(fake, clock=clock))
    c = NvmlCollector(ctx)
    return fake, c, clock, ctx


@pytest.mark.parametrize(("code", "text"), [
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"),
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"),
    (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "version mismatch"),
])
def test_init_failure_is_unavailable_then_recovers_after_backoff(code: int, text: str) -> None:
    fake, c, clock, _ = rig()
    fake.fail_init(code)
    availability = c.probe()
    assert not availability.available and text in availability.reason
    with pytest.raises(CollectorUnavailable, match=text):
        c.collect()
    assert fake.calls["nvmlInitWithFlags"] == 1   # only the probe tried: the backoff holds
    fake.fail_init(None)                   # the driver is back
    with pytest.raises(CollectorUnavailable):
        c.collect()                        # still inside the backoff window
    clock.t += 1.0
    out = c.collect()
    assert {s.label("gpu") for f in out.families if f.name == "gpumon_gpu_power_watts" for s in f.samples} \
        == {"0", "1"}
    assert c.probe().available
    c.close()


def test_backoff_grows_while_the_driver_stays_away() -> None:
    fake, c, clock, _ = rig()
    fake.fail_init(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    tries = []
    for _ in range(40):
        clock.t += 1.0
        before = fake.calls["nvmlInitWithFlags"]
        with pytest.raises(CollectorUnavailable):
            c.collect()
        tries.append(fake.calls["nvmlInitWithFlags"] - before)
    assert sum(tries) <= 7        # 1, 2, 4, 8, 16 s ... not every second
    c.close()


def test_reinitialisation_waits_double_from_1_s_to_300_s_without_jitter() -> None:
    """The session's backoff is gpumon.backoff's, in its jitter-free mode: the exact waits."""
    fake = FakeNVML("h100-sxm5-80gb", 2)
    clock = Clock()
    session = NvmlSession(fake, clock=clock)
    fake.fail_init(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    tries = []
    for _ in range(1200):
        before = fake.calls["nvmlInitWithFlags"]
        with pytest.raises(CollectorUnavailable):
            session.ensure()
        if fake.calls["nvmlInitWithFlags"] > before:
            tries.append(clock.t)
        clock.t += 1.0
    assert [b - a for a, b in zip(tries, tries[1:])] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0,
                                                         300.0, 300.0]


def test_driver_unloaded_mid_run_reinitialises_and_rediscovers() -> None:
    fake, c, clock, _ = rig()
    c.collect()
    generation = c.session.generation
    fake.fail("nvmlDeviceGetFieldValues", pynvml.NVML_ERROR_DRIVER_NOT_LOADED, times=1)
    fake.fail_init(pynvml.NVML_ERROR_DRIVER_NOT_LOADED, times=1)
    with pytest.raises(CollectorUnavailable, match="Driver Not Loaded"):
        c.collect()
    clock.t += 1.0
    with pytest.raises(CollectorUnavailable):
        c.collect()                               # init fails once more while the module reloads
    clock.t += 2.0
    out = c.collect()
    assert c.session.generation == generation + 1
    assert {s.label("gpu") for f in out.families if f.name == "gpumon_gpu_info" for s in f.samples} == {"0", "1"}
    c.close()


def test_session_is_shared_and_shut_down_by_the_last_user() -> None:
    fake, c, _, ctx = rig()
    x = XidCollector(ctx)
    assert x.session is c.session
    c.collect()
    x.collect()
    assert fake.calls["nvmlInitWithFlags"] == 1
    c.close()
    assert fake.calls["nvmlShutdown"] == 0
    x.close()
    assert fake.calls["nvmlShutdown"] == 1


def _auto_plan(fake: FakeNVML, tmp_path):
    # auto mode on a host whose only source is the (fake) NVML: no kernel log, no IMDS
    config = load(schemas(), None, {"GPUMON_DAEMON_INTERVAL": "0.1",
                                    "GPUMON_KMSG_PATH": str(tmp_path / "no-kmsg"),
                                    "GPUMON_HOST_INFO_KVP_POOL": str(tmp_path / "no-kvp")}, {})
    ctx = Context(hostname="test", sysfs_root=str(tmp_path / "no-sysfs"), state_dir=str(tmp_path), nvml=fake)
    return config, ctx, plan_collectors(config, ctx)


def test_daemon_started_before_the_driver_runs_nvml_down_and_brings_it_up(tmp_path) -> None:
    """A GPU host booting (or mid driver update) when gpumon starts: the library is there, the driver
    is not. The collectors run reported down, and come up once the driver loads, without a restart."""
    fake = FakeNVML("h100-sxm5-80gb", 2)
    fake.fail_init(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    config, ctx, plan = _auto_plan(fake, tmp_path)
    assert {p.name for p in plan.running} == {"nvml", "xid"}
    assert all(p.waiting and "Driver Not Loaded" in p.reason for p in plan.running)
    assert plan.problems() == []
    loop = Loop(config, plan, ctx, [])
    loop.start()
    try:
        def up(name: str) -> float | None:
            fam = loop.latest.family("gpumon_collector_up") if loop.latest else None
            return next((s.value for s in fam.samples if s.label("collector") == name), None) if fam else None

        wait_for(lambda: up("nvml") == 0.0)
        status = {c.name: c for c in loop.latest.collectors}
        assert not status["nvml"].available and "Driver Not Loaded" in status["nvml"].error
        assert loop.latest.family("gpumon_gpu_power_watts") is None
        fake.fail_init(None)                       # the driver module finished loading
        wait_for(lambda: up("nvml") == 1.0 and up("xid") == 1.0, timeout=10.0)
        power = loop.latest.family("gpumon_gpu_power_watts")
        assert {s.label("gpu") for s in power.samples} == {"0", "1"}
    finally:
        loop.stop(2.0)
        _close_plan(plan)


def test_a_host_without_the_nvml_library_does_not_run_the_gpu_collectors(tmp_path) -> None:
    fake = FakeNVML("h100-sxm5-80gb", 2)
    fake.fail_init(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    _, _, plan = _auto_plan(fake, tmp_path)
    assert plan.running == []
    assert {p.name: p.waiting for p in plan.collectors if p.name in ("infiniband", "linkflap", "nvml", "xid")} \
        == {"infiniband": False, "linkflap": False, "nvml": False, "xid": False}


def test_asking_for_nvml_explicitly_while_the_driver_is_away_is_still_a_problem(tmp_path) -> None:
    fake = FakeNVML("h100-sxm5-80gb", 2)
    fake.fail_init(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    config = load(schemas(), None, {"GPUMON_DAEMON_COLLECTORS": "nvml"}, {})
    plan = plan_collectors(config, Context(hostname="test", state_dir=str(tmp_path), nvml=fake))
    assert [p.split(":")[0] for p in plan.problems()] == ["collector 'nvml' is unavailable"]
    _close_plan(plan)


def test_check_says_a_not_ready_driver_is_waited_for(tmp_path, monkeypatch, capsys) -> None:
    from gpumon import cli, daemon

    fake = FakeNVML("h100-sxm5-80gb", 2)
    fake.fail_init(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    monkeypatch.setattr(daemon, "make_context", lambda config: Context(
        hostname="test", sysfs_root=str(tmp_path / "no-sysfs"), state_dir=str(tmp_path), nvml=fake, config=config))
    assert cli.main(["check", "--listen", "127.0.0.1:0"]) == 0
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line.startswith("collector")}
    assert lines["nvml"].split()[2] == "wait" and "Driver Not Loaded" in lines["nvml"]
    assert lines["infiniband"].split()[2] == "skip"


def test_invalidate_does_not_shut_nvml_down_under_the_xid_wait() -> None:
    """The XID thread is nearly always inside nvmlEventSetWait_v2: nvmlShutdown waits until that call
    returns, and the re-initialisation after the backoff then starts NVML over (inits stay matched)."""
    fake, c, clock, ctx = rig()
    x = XidCollector(ctx)
    c.collect()
    x.collect()
    wait_for(lambda: x._watching.is_set(), 5)
    hang = fake.hang("nvmlEventSetWait_v2")
    try:
        assert hang.entered.wait(5)
        c.session.invalidate("driver reloaded")
        assert fake.calls["nvmlShutdown"] == 0          # not under the call in flight
    finally:
        hang.release()
    wait_for(lambda: fake.calls["nvmlShutdown"] == 1, 5)   # once it returned
    assert fake._inits == 0
    clock.t += 1.0
    out = c.collect()
    assert {s.label("gpu") for f in out.families if f.name == "gpumon_gpu_lost" for s in f.samples} == {"0", "1"}
    assert fake._inits == 1
    wait_for(lambda: x.collect() and x._watching.is_set(), 5)
    fake.inject_xid(0, 13)
    wait_for(lambda: any(f.name == "gpumon_gpu_xid_errors_total" and f.samples for f in x.collect().families), 5)
    c.close()
    x.close()
    assert fake._inits == 0


def test_no_call_enters_nvml_while_nvml_shutdown_runs() -> None:
    """The shutdown is announced in the same critical section that finds nothing in flight: a thread
    that wants NVML meanwhile waits for nvmlShutdown to return instead of running inside it."""
    import threading
    import time

    fake = FakeNVML("h100-sxm5-80gb", 2)
    session = NvmlSession(fake)
    session.acquire()
    session.ensure()
    inside, overlap = threading.Event(), []
    real_shutdown, real_count = fake.nvmlShutdown, fake.nvmlDeviceGetCount

    def slow_shutdown() -> None:
        inside.set()
        time.sleep(0.5)                  # tearing a driver session down is not instant
        inside.clear()
        real_shutdown()

    def count() -> int:
        if inside.is_set():
            overlap.append("nvmlDeviceGetCount")
        return real_count()

    fake.nvmlShutdown, fake.nvmlDeviceGetCount = slow_shutdown, count
    shutter = threading.Thread(target=session.invalidate, args=("driver went away",))
    shutter.start()
    assert inside.wait(5)
    caller = threading.Thread(target=lambda: _swallow(lambda: session.call("nvmlDeviceGetCount")))
    caller.start()
    caller.join(5)
    shutter.join(5)
    assert overlap == [] and not caller.is_alive()


def _swallow(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - after the shutdown NVML may refuse; only the timing matters
        pass
