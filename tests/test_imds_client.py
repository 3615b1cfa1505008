"""The one IMDS client: cached compute metadata, cached absence, faults counted by reason and logged
once, 429 pausing without waiting, proxies bypassed. Against a loopback IMDS stand-in."""

from __future__ import annotations

import logging
import time

import pytest

from gpumon import imds
from gpumon.config import ConfigError, load
from tests.conftest import closed_port
from tests.fakes.imds import COMPUTE, COMPUTE_PATH, EVENTS_PATH, ImdsServer, scheduled_event


@pytest.fixture
def server():
    srv = ImdsServer()
    yield srv
    srv.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_compute_is_fetched_once_with_the_metadata_header_and_parsed(server):
    client = imds.ImdsClient(server.url, timeout=2.0)
    first = client.instance()
    assert client.instance() is first
    assert server.count(COMPUTE_PATH) == 1
    (_, _, headers), = server.requests
    assert headers.get("Metadata") == "true"
    assert (first.vm_size, first.location, first.zone, first.vmss_name) == (
        "Standard_ND96isr_H100_v5", "eastus2", "2", "gpu-node")
    assert first.placement_group_id == COMPUTE["placementGroupId"]
    assert first.platform_fault_domain == "1"
    assert (first.subscription_id, first.resource_group) == (COMPUTE["subscriptionId"], "rg-train")


def test_compute_is_asked_again_after_refresh_and_a_failed_refresh_keeps_the_old_answer(server):
    clock = Clock()
    client = imds.ImdsClient(server.url, timeout=2.0, refresh=600.0, clock=clock)
    first = client.instance()
    clock.now += 599
    assert client.instance() is first and server.count(COMPUTE_PATH) == 1
    clock.now += 2
    server.compute = {**COMPUTE, "vmSize": "Standard_ND96amsr_A100_v4"}
    assert client.instance().vm_size == "Standard_ND96amsr_A100_v4"
    assert server.count(COMPUTE_PATH) == 2
    clock.now += 601
    server.fail(COMPUTE_PATH, 500)
    assert client.instance().vm_size == "Standard_ND96amsr_A100_v4"


def test_no_imds_listening_is_not_azure_quickly_and_is_remembered():
    client = imds.ImdsClient(f"http://127.0.0.1:{closed_port()}", timeout=0.5)
    started = time.monotonic()
    on, why = client.on_azure()
    assert not on and "not on Azure" in why
    assert client.on_azure()[0] is False
    assert time.monotonic() - started < 1.0


def test_a_slow_imds_times_out_once_and_the_absence_is_cached(server):
    server.hold(COMPUTE_PATH)
    client = imds.ImdsClient(server.url, timeout=0.3)
    started = time.monotonic()
    assert client.on_azure()[0] is False
    with pytest.raises(imds.ImdsError) as err:
        client.instance()
    assert err.value.reason == "timeout"
    assert time.monotonic() - started < 1.5  # one timeout, not two
    assert server.count(COMPUTE_PATH) == 1


@pytest.mark.parametrize("status", [404, 500])
def test_http_errors_are_raised_by_reason_yet_mean_imds_is_there(server, status):
    server.fail(COMPUTE_PATH, status)
    client = imds.ImdsClient(server.url, timeout=2.0)
    with pytest.raises(imds.ImdsError) as err:
        client.instance()
    assert (err.value.reason, err.value.status) == ("http_error", status)
    assert client.on_azure() == (True, "")
    server.fail(COMPUTE_PATH, None)
    assert client.instance().vm_id == COMPUTE["vmId"]  # an HTTP error is not cached as absence


def test_malformed_json_is_its_own_reason(server):
    server.fail(EVENTS_PATH, "malformed")
    with pytest.raises(imds.ImdsError) as err:
        imds.ImdsClient(server.url, timeout=2.0).scheduled_events()
    assert err.value.reason == "malformed"


def test_429_pauses_asking_without_waiting(server):
    clock = Clock()
    client = imds.ImdsClient(server.url, timeout=2.0, clock=clock)
    server.fail(EVENTS_PATH, 429)
    with pytest.raises(imds.ImdsError) as err:
        client.scheduled_events()
    assert err.value.reason == "throttled"
    started = time.monotonic()
    with pytest.raises(imds.ImdsError) as err:
        client.scheduled_events()
    assert err.value.reason == "throttled" and time.monotonic() - started < 0.1
    assert server.count(EVENTS_PATH) == 1
    server.fail(EVENTS_PATH, None)
    clock.now += imds.THROTTLE_PAUSE
    assert client.scheduled_events().events == ()


def test_each_fault_is_logged_once_until_imds_answers_again(server, caplog):
    client = imds.ImdsClient(server.url, timeout=2.0)
    server.fail(EVENTS_PATH, 500)
    with caplog.at_level(logging.WARNING, logger="gpumon.imds"):
        for _ in range(3):
            with pytest.raises(imds.ImdsError):
                client.scheduled_events()
        assert len(caplog.records) == 1 and "HTTP 500" in caplog.records[0].getMessage()
        server.fail(EVENTS_PATH, None)
        client.scheduled_events()
        server.fail(EVENTS_PATH, 500)
        with pytest.raises(imds.ImdsError):
            client.scheduled_events()
    assert len(caplog.records) == 2


def test_requests_bypass_any_configured_proxy(server, monkeypatch):
    dead_proxy = f"http://127.0.0.1:{closed_port()}"
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, dead_proxy)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert imds.ImdsClient(server.url, timeout=2.0).instance().vm_id == COMPUTE["vmId"]


def test_scheduled_events_parse_as_documented(server):
    server.set_events(
        scheduled_event("A", "Freeze", not_before="Mon, 19 Sep 2016 18:29:47 GMT", duration=9),
        scheduled_event("B", "Reboot", status="Started", not_before="", source="User"))
    doc = imds.ImdsClient(server.url, timeout=2.0).scheduled_events()
    assert doc.incarnation == server.incarnation
    freeze, reboot = doc.events
    assert freeze.not_before == 1474309787.0 and freeze.duration == 9
    assert freeze.resources == ("gpu-node-0_3",) and freeze.resource_type == "VirtualMachine"
    assert (reboot.status, reboot.source, reboot.not_before, reboot.duration) == ("Started", "User", None, -1)


@pytest.mark.parametrize("doc", [[], {"Events": {}}, {"DocumentIncarnation": "x", "Events": []},
                                 {"DocumentIncarnation": 1, "Events": [{"EventType": "Reboot"}]}])
def test_documents_of_the_wrong_shape_are_malformed(doc):
    with pytest.raises(imds.ImdsError) as err:
        imds.parse_scheduled_events(doc)
    assert err.value.reason == "malformed"


def test_the_shared_client_is_one_per_imds_and_takes_the_latest_settings(server):
    full = f"{server.url}/metadata/instance/compute?api-version=2021-02-01"
    shared = imds.client(server.url, timeout=0.7)
    assert imds.client(full) is shared and shared.timeout == 0.7
    assert imds.configured({"imds_url": server.url, "imds_timeout": 1.5, "compute_refresh": 60.0}) is shared
    assert (shared.timeout, shared.refresh) == (1.5, 60.0)
    assert imds.client(full).instance().vm_id == COMPUTE["vmId"]
    assert shared.timeout == 1.5  # asked again without settings, the client keeps its configuration
    with pytest.raises(imds.ImdsError) as err:  # no IMDS there: an error callers count, not a hang
        imds.client(f"http://127.0.0.1:{closed_port()}/metadata", timeout=0.2).instance()
    assert err.value.reason in ("unreachable", "timeout")


def test_the_azure_section_validates_its_url(tmp_path):
    path = tmp_path / "gpumon.toml"
    path.write_text('[azure]\nimds_url = "169.254.169.254"\n')
    with pytest.raises(ConfigError) as err:
        load([imds.OPTIONS], str(path), {}, {})
    assert err.value.key == "[azure] imds_url"
    assert load([imds.OPTIONS], None, {"GPUMON_AZURE_IMDS_TIMEOUT": "0.25"}, {})["azure"]["imds_timeout"] == 0.25


def test_a_refresh_in_flight_holds_no_lock_and_the_previous_answer_is_served_meanwhile(server):
    import threading

    from tests.conftest import wait_for

    clock = Clock()
    client = imds.ImdsClient(server.url, timeout=10.0, refresh=600.0, clock=clock)
    first = client.instance()
    clock.now += 601
    server.hold(COMPUTE_PATH)
    refreshed: list[imds.AzureInstance] = []
    refresher = threading.Thread(target=lambda: refreshed.append(client.instance()), daemon=True)
    refresher.start()
    try:
        wait_for(lambda: server.count(COMPUTE_PATH) == 2)
        assert not client._lock.locked()  # the HTTP request runs without the cache's lock
        started = time.monotonic()
        assert client.instance() is first  # not blocked behind the refresh, and not a second request
        assert time.monotonic() - started < 0.5
        assert server.count(COMPUTE_PATH) == 2
    finally:
        server.release()
        refresher.join(5)
    assert refreshed and refreshed[0] is not first and client.instance() is refreshed[0]


def test_callers_during_the_first_fetch_wait_for_its_answer_not_for_a_second_request(server):
    import threading

    from tests.conftest import wait_for

    client = imds.ImdsClient(server.url, timeout=10.0)
    server.hold(COMPUTE_PATH)
    got: list[object] = []
    callers = [threading.Thread(target=lambda: got.append(client.instance()), daemon=True) for _ in range(4)]
    callers[0].start()
    wait_for(lambda: server.count(COMPUTE_PATH) == 1)
    for caller in callers[1:]:
        caller.start()
    try:
        wait_for(lambda: len(getattr(client, "_fetched", threading.Condition())._waiters) == 3, timeout=3)
        assert not client._lock.locked()  # the first holds no lock over its request
    finally:
        server.release()
    for caller in callers:
        caller.join(5)
    assert len(got) == 4 and all(g is got[0] for g in got)
    assert server.count(COMPUTE_PATH) == 1


def test_callers_during_a_failing_first_fetch_get_its_error(server):
    import threading

    from tests.conftest import wait_for

    client = imds.ImdsClient(server.url, timeout=10.0)
    server.fail(COMPUTE_PATH, 500)
    server.hold(COMPUTE_PATH)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            client.instance()
        except imds.ImdsError as exc:
            errors.append(exc)

    callers = [threading.Thread(target=call, daemon=True) for _ in range(3)]
    callers[0].start()
    wait_for(lambda: server.count(COMPUTE_PATH) == 1)
    for caller in callers[1:]:
        caller.start()
    wait_for(lambda: len(getattr(client, "_fetched", threading.Condition())._waiters) == 2)  # both waiting
    server.release()
    for caller in callers:
        caller.join(5)
    assert len(errors) == 3 and all(e.reason == "http_error" for e in errors)
    assert server.count(COMPUTE_PATH) == 1


def test_a_429_retry_after_given_as_an_http_date_is_honoured():
    import email.utils

    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= imds._retry_after(when) <= 30
    assert imds._retry_after(None) == imds.THROTTLE_PAUSE and imds._retry_after("soon") == imds.THROTTLE_PAUSE
    assert imds._retry_after("600") == 60.0


def test_a_trickling_imds_is_cut_at_the_deadline_of_the_whole_request(server):
    # a byte every 0.1 s: every read gets something, so a per-read timeout never fires
    server.trickle(COMPUTE_PATH)
    client = imds.ImdsClient(server.url, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(imds.ImdsError) as err:
        client.instance()
    assert err.value.reason == "timeout" and time.monotonic() - started < 1.5


@pytest.mark.parametrize("field", ["DocumentIncarnation", "DurationInSeconds"])
@pytest.mark.parametrize("number", [b"Infinity", b"-Infinity", b"NaN", b"1e400", b"9" * 400, b'"' + b"9" * 400 + b'"',
                                    b"true", b"-5"])
def test_numbers_no_imds_sends_are_malformed_and_logged_once(server, caplog, field, number):
    event = b'{"EventId": "E1", "EventType": "Reboot", "EventStatus": "Scheduled", "DurationInSeconds": %s}'
    doc = (b'{"DocumentIncarnation": %s, "Events": []}' % number if field == "DocumentIncarnation"
           else b'{"DocumentIncarnation": 3, "Events": [%s]}' % (event % number))
    server.fail(EVENTS_PATH, doc)
    client = imds.ImdsClient(server.url, timeout=2.0)
    with caplog.at_level(logging.WARNING, logger="gpumon.imds"):
        for _ in range(3):
            with pytest.raises(imds.ImdsError) as err:
                client.scheduled_events()
            assert err.value.reason == "malformed"
    assert len(caplog.records) == 1 and len(caplog.records[0].getMessage()) < 300
    server.fail(EVENTS_PATH, None)
    assert client.scheduled_events().events == ()


def test_a_trickling_imds_at_start_keeps_the_port_closed_no_longer_than_its_timeout(gpumon_run, server, tmp_path):
    # every collector whose probe asks IMDS (host_info, azure_events) and the health stage's VM size
    server.trickle(COMPUTE_PATH)
    server.trickle(EVENTS_PATH)
    started = time.monotonic()
    gpumon = gpumon_run("--collectors", "auto", "--sinks", "prometheus", "--sysfs-root", str(tmp_path),
                        env={"GPUMON_AZURE_IMDS_URL": server.url, "GPUMON_AZURE_IMDS_TIMEOUT": "0.5"}, ready=False)
    gpumon.wait_ready(timeout=10)
    assert time.monotonic() - started < 8          # was 62 s: each trickled byte kept the request alive
    code, output = gpumon.stop()
    assert code == 0, output
    assert "IMDS timeout" in output                # and the log says why


def test_the_endpoint_is_open_while_the_probes_still_wait_on_imds(gpumon_run, server, tmp_path):
    from tests.conftest import http_get, wait_for

    server.trickle(COMPUTE_PATH)      # the probes that ask IMDS wait its whole imds_timeout of 8 s
    gpumon = gpumon_run("--collectors", "auto", "--sinks", "prometheus", "--sysfs-root", str(tmp_path),
                        env={"GPUMON_AZURE_IMDS_URL": server.url, "GPUMON_AZURE_IMDS_TIMEOUT": "8"}, ready=False)

    def answers() -> bool:
        try:
            return http_get(gpumon.url + "/healthz", timeout=1)[0] == 200
        except OSError:
            return False

    wait_for(answers, timeout=15)
    opened = time.monotonic()
    assert http_get(gpumon.url + "/metrics", timeout=2)[0] == 503   # open, saying "no snapshot yet" ...
    gpumon.wait_ready(timeout=15)
    assert time.monotonic() - opened > 4    # ... for as long as the probes waited on IMDS (8 s), not after
