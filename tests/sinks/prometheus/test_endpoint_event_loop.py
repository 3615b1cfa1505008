"""The endpoint's event-driven front: idle, trickling and half-closed connections cost a descriptor,
never a scrape, also from the scraper's own address; the descriptor limit itself."""

from __future__ import annotations

import http.client
import resource
import select
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time

import pytest
import trustme

from gpumon.sinks.prometheus.connections import WAIT_TLS, raise_nofile_limit
from tests.conftest import REPO, http_get, wait_for
from tests.support import endpoint
from tests.support.endpoint import Flood, client, raw, write_tls

REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


sinks = endpoint.sinks  # the fixture, shared with the other endpoint tests


def timed_scrapes(url: str, n: int = 10, **kwargs) -> list[float]:
    """``n`` scrapes, each on a new connection: the seconds each took; a failure is 99."""
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        try:
            ok = http_get(url, timeout=1, **kwargs)[0] == 200
        except OSError:
            ok = False
        out.append(time.monotonic() - t0 if ok else 99.0)
    return out


def read_reply(conn: socket.socket) -> bytes:
    """One whole response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"closed before a reply: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def closed_within(conn: socket.socket, seconds: float) -> bool:
    """The server closed ``conn`` (EOF or reset) within ``seconds``."""
    conn.settimeout(seconds)
    try:
        while conn.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


@pytest.mark.parametrize("count", [500, 2000])
def test_idle_connections_from_the_scrapers_own_address_leave_every_scrape_answered_within_a_second(sinks, count):
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2 * count + 200:  # client and server ends both live in this process
        pytest.skip(f"RLIMIT_NOFILE {soft} is too low for {count} connections and their peers")
    s = sinks(first_byte_timeout=30.0)
    with Flood(s.port, count, ["127.0.0.1"]):
        wait_for(lambda: len(s._server.slots) >= count, timeout=15)
        assert max(timed_scrapes(f"http://127.0.0.1:{s.port}/metrics")) < 1.0
        assert max(timed_scrapes(f"http://127.0.0.1:{s.port}/healthz")) < 1.0
    assert s.health().detail.startswith("0 connections displaced")  # nobody needed a slot


def test_slowloris_from_the_scrapers_address_is_cut_at_the_head_deadline_and_scrapes_go_on(sinks):
    s = sinks(request_timeout=1.0)
    loris = [socket.create_connection(("127.0.0.1", s.port), timeout=5) for _ in range(50)]
    start = time.monotonic()
    try:
        for conn in loris:
            conn.sendall(b"G")
        cut: set[int] = set()
        latencies = []
        while len(cut) < len(loris) and time.monotonic() - start < 5:
            for i, conn in enumerate(loris):  # a byte each, about every 0.2 s: each read is timely
                if i not in cut:
                    try:
                        conn.send(b"E")
                    except OSError:
                        cut.add(i)
            latencies += timed_scrapes(f"http://127.0.0.1:{s.port}/metrics", n=2)
            time.sleep(0.2)  # the slow client's pace is what this test is about
        assert len(cut) == len(loris)  # every one closed by the head deadline (1 s), none let run on
        assert time.monotonic() - start < 3.0
        assert max(latencies) < 1.0
        assert s.health().failed >= len(loris)  # counted
    finally:
        for conn in loris:
            conn.close()


def test_a_tls_client_that_completes_the_handshake_and_sends_nothing_is_cut_at_the_first_byte_deadline(
        sinks, tmp_path, ca):
    s = sinks(web_config_file=write_tls(tmp_path, ca), first_byte_timeout=0.5, request_timeout=10.0)
    ctx = client(ca)
    with socket.create_connection(("127.0.0.1", s.port), timeout=5) as conn, \
            ctx.wrap_socket(conn, server_hostname="127.0.0.1") as tls:
        t0 = time.monotonic()
        assert max(timed_scrapes(f"https://127.0.0.1:{s.port}/metrics", n=3, context=ctx)) < 1.0
        assert closed_within(tls, 3.0)
        assert time.monotonic() - t0 < 2.0


def still_open(conn: socket.socket) -> bool:
    """Open with nothing to read (a closed one reads EOF or a reset)."""
    conn.setblocking(False)
    try:
        conn.recv(1)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def test_idle_connections_are_kept_below_the_high_water_mark_and_reaped_oldest_first_above_it(sinks):
    s = sinks(max_connections=8, max_connections_per_source=8, first_byte_timeout=0.2, request_timeout=5.0)
    front = s._server
    assert front.limits.high_water_mark == 6
    old = []
    try:
        for _ in range(5):  # below the mark: kept past the first-byte deadline, until the idle limit
            old.append(socket.create_connection(("127.0.0.1", s.port), timeout=5))
            wait_for(lambda n=len(old): len(front.slots) == n)
        wait_for(lambda: all(c.deadline > c.since + 60 for c in list(front.slots.conns)), timeout=5)
        assert all(still_open(c) for c in old)
        # three more: 8 > 6, so the oldest silent ones past their first-byte deadline go, down to the mark
        new = [socket.create_connection(("127.0.0.1", s.port), timeout=5) for _ in range(3)]
        old += new
        for conn in old[:2]:
            assert closed_within(conn, 5.0)
        assert all(still_open(c) for c in old[2:5])
        assert s.health().failed == 0  # reaping idle connections is not a failure
        assert http_get(f"http://127.0.0.1:{s.port}/metrics", timeout=2)[0] == 200
    finally:
        for conn in old:
            conn.close()


def test_a_head_split_into_one_byte_packets_is_answered(sinks):
    s = sinks()
    padding = b"".join(b"X-%d: %s\r\n" % (i, b"a" * 150) for i in range(90))  # ~14 KB, under the 16 KiB cap
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + padding + b"\r\n"
    with socket.create_connection(("127.0.0.1", s.port), timeout=5) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i, byte in enumerate(request[:200], 1):  # the first 200 bytes seen one at a time by the server
            conn.sendall(bytes([byte]))
            wait_for(lambda n=i: any(c.received == n for c in list(s._server.slots.conns)), interval=0.001)
        for i in range(200, len(request), 7):  # the rest in 7-byte packets
            conn.sendall(request[i:i + 7])
        assert read_reply(conn).startswith(b"HTTP/1.1 200")


def test_a_tls_head_split_into_one_byte_records_is_answered(sinks, tmp_path, ca):
    s = sinks(web_config_file=write_tls(tmp_path, ca))
    padding = b"".join(b"X-%d: %s\r\n" % (i, b"a" * 50) for i in range(20))
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + padding + b"\r\n"
    raw = socket.create_connection(("127.0.0.1", s.port), timeout=5)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with client(ca).wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        for byte in request:  # each byte its own TLS record, in its own packet
            tls.sendall(bytes([byte]))
        assert read_reply(tls).startswith(b"HTTP/1.1 200")


def test_a_keep_alive_client_that_never_sends_its_second_request_is_closed_at_request_timeout(sinks):
    s = sinks(request_timeout=1.0)
    with socket.create_connection(("127.0.0.1", s.port), timeout=5) as conn:
        conn.sendall(REQUEST)
        assert read_reply(conn).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert max(timed_scrapes(f"http://127.0.0.1:{s.port}/metrics", n=3)) < 1.0
        assert closed_within(conn, 5.0)
        assert 0.5 < time.monotonic() - t0 < 2.5
    wait_for(lambda: len(s._server.slots) == 0)


def test_half_closed_sockets(sinks):
    s = sinks(first_byte_timeout=10.0, request_timeout=10.0)
    # a whole request, then the write side shut: answered, then closed
    with socket.create_connection(("127.0.0.1", s.port), timeout=5) as conn:
        conn.sendall(REQUEST)
        conn.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"\n")
    # shut before a byte, or halfway through a head: closed at once, not at a deadline
    for sent in (b"", b"GET /metrics HTTP/1.1\r\nHo"):
        with socket.create_connection(("127.0.0.1", s.port), timeout=5) as conn:
            conn.sendall(sent)
            conn.shutdown(socket.SHUT_WR)
            t0 = time.monotonic()
            assert conn.recv(65536) == b""
            assert time.monotonic() - t0 < 1.0
    wait_for(lambda: len(s._server.slots) == 0)


def test_pipelined_requests_are_answered_in_order(sinks):
    s = sinks()
    with socket.create_connection(("127.0.0.1", s.port), timeout=5) as conn:
        conn.sendall(REQUEST + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" + b"GET /nope HTTP/1.1\r\n\r\n")
        data = b""
        while not data.endswith(b"not found\n"):
            chunk = conn.recv(65536)
            assert chunk, data[-200:]
            data += chunk
        replies = data.split(b"HTTP/1.1 ")[1:]
        assert [r[:3] for r in replies] == [b"200", b"200", b"404"]
        assert b"gpumon_test_value" in replies[0] and replies[1].endswith(b"ok\n")


def test_stop_with_thousands_of_connections_open_is_prompt(sinks):
    s = sinks(first_byte_timeout=30.0)
    with Flood(s.port, 1000, ["127.0.0.3"]):
        wait_for(lambda: len(s._server.slots) >= 1000, timeout=15)
        t0 = time.monotonic()
        s.stop(timeout=5.0)
        assert time.monotonic() - t0 < 2.0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", s.port), timeout=1).recv(1)


HOLDER = r"""
import resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
port, count = int(sys.argv[1]), int(sys.argv[2])
held = [socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(f"127.0.0.{3 + i % 4}", 0))
        for i in range(count)]
print("held", len(held), flush=True)
sys.stdin.readline()
"""


def test_stop_with_ten_thousand_connections_open_stays_within_the_stop_deadline(sinks):
    """The daemon gives its sinks 5 s to stop; 10,000 open connections (held by another process:
    both ends would not fit this one's descriptors) are closed well within it."""
    count = 10_000
    if raise_nofile_limit() < count + 500:
        pytest.skip(f"RLIMIT_NOFILE {resource.getrlimit(resource.RLIMIT_NOFILE)} is too low for {count} connections")
    s = sinks(first_byte_timeout=30.0)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(s.port), str(count)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().split() == ["held", str(count)]
        front = s._server
        wait_for(lambda: len(front.slots) == count, timeout=15)
        t0 = time.monotonic()
        s.stop(timeout=5.0)
        assert time.monotonic() - t0 < 2.0
        assert not front.thread.is_alive() and len(front.slots) == 0
    finally:
        holder.kill()
        holder.communicate(timeout=10)


def test_thousands_of_tls_connections_hanging_up_at_once_do_not_hold_up_a_scrape(sinks, tmp_path, ca):
    """Every one of them is a TLS step (a hang-up seen before the ClientHello): they are taken a
    few milliseconds' worth a turn, the rest queued off the selector, not polled again each turn."""
    count = 5_000
    if raise_nofile_limit() < count + 500:
        pytest.skip(f"RLIMIT_NOFILE {resource.getrlimit(resource.RLIMIT_NOFILE)} is too low for {count} connections")
    s = sinks(web_config_file=write_tls(tmp_path, ca, client_auth=True), first_byte_timeout=30.0)
    front, ctx = s._server, client(ca, with_cert=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(s.port), str(count)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().split() == ["held", str(count)]
        wait_for(lambda: len(front.slots) == count, timeout=15)
    finally:
        holder.kill()  # every connection closes at once
        holder.communicate(timeout=10)
    assert max(timed_scrapes(f"https://127.0.0.1:{s.port}/metrics", n=5, context=ctx)) < 1.0
    wait_for(lambda: len(front.slots) == 0, timeout=10)


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one():
    code = ("import resource; from gpumon.sinks.prometheus.connections import WAIT_TLS, raise_nofile_limit; "
            "print(raise_nofile_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512))

    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=20,
                         preexec_fn=lower, check=True).stdout.split()
    assert out == ["512", "512"]
    assert raise_nofile_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


CHILD = r"""
import os, sys, logging
logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(message)s")
from gpumon.sinks.base import SinkContext
from gpumon.sinks.prometheus import PrometheusSink
from tests.support.endpoint import section, snapshot
s = PrometheusSink(SinkContext("h", "/tmp", "1"), section(first_byte_timeout=30.0, request_timeout=30.0))
s.start()
s.publish(snapshot())
print(s.port, s._server.limits.max_connections, flush=True)
held = []
for line in sys.stdin:
    if line.startswith("exhaust"):  # take every descriptor left
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        print("exhausted", len(held), flush=True)
    elif line.startswith("count"):
        print(len(s._server.slots), flush=True)
    elif line.startswith("health"):
        print(s.health().detail, flush=True)
    elif line.startswith("stop"):
        break
s.stop()
"""


def test_at_the_descriptor_limit_newcomers_are_refused_and_established_scrapes_go_on():
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (160, 160))

    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, preexec_fn=lower)
    assert child.stdin is not None and child.stdout is not None
    opened: list[socket.socket] = []
    try:
        port, cap = (int(w) for w in child.stdout.readline().split())
        assert 16 <= cap < 160  # the descriptors left once the daemon's own and a reserve are counted
        scraper = socket.create_connection(("127.0.0.1", port), timeout=5)  # kept alive, as Prometheus does
        scraper.sendall(REQUEST)
        assert read_reply(scraper).startswith(b"HTTP/1.1 200")
        # one source fills every slot; past the cap it holds more than its share: refused, not displacing
        for _ in range(cap + 20):
            opened.append(socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.2", 0)))
        refused = [c for c in opened[-20:] if closed_within(c, 2.0)]
        assert len(refused) >= 19  # one may have been accepted into a slot the scraper's first left
        scraper.sendall(REQUEST)
        assert read_reply(scraper).startswith(b"HTTP/1.1 200")
        # the process itself out of descriptors: accept fails, the newcomer is closed, not left queued
        for c in opened:
            c.close()
        opened.clear()

        def only_the_scraper_left() -> bool:
            child.stdin.write("count\n")
            child.stdin.flush()
            return child.stdout.readline().strip() == "1"

        wait_for(only_the_scraper_left)  # their descriptors are free again, then taken below
        child.stdin.write("exhaust\n")
        child.stdin.flush()
        assert child.stdout.readline().startswith("exhausted")
        for _ in range(10):
            c = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.4", 0))
            opened.append(c)
            assert closed_within(c, 2.0)
        for _ in range(3):  # the established scrape is unaffected
            scraper.sendall(REQUEST)
            assert read_reply(scraper).startswith(b"HTTP/1.1 200")
        child.stdin.write("health\n")
        child.stdin.flush()
        detail = child.stdout.readline()
        refused_count = int(detail.split(", ")[2].split()[0])
        assert refused_count >= 29, detail
        scraper.close()
        child.stdin.write("stop\n")
        child.stdin.flush()
        _, err = child.communicate(timeout=20)
        # counted every time, logged once per episode: the cap, then the descriptors
        assert 1 <= err.count("connection refused") <= 2, err
    finally:
        for c in opened:
            c.close()
        if child.poll() is None:
            child.kill()
            child.communicate()


def test_the_bound_address_is_readable_after_start(sinks):
    s = sinks()
    assert s.bound_address == ("127.0.0.1", s.port) and s.port != 0
    assert raw(s, b"GET /healthz HTTP/1.0\r\n\r\n").endswith(b"ok\n")


def test_a_tls_scrape_answers_after_a_reload_turns_tls_off_for_new_connections(sinks, tmp_path, ca):
    """TLS is decided when a connection speaks, with the config in effect then."""
    s = sinks(web_config_file=write_tls(tmp_path, ca), web_config_check_interval=3600)
    ctx = client(ca)
    assert http_get(f"https://127.0.0.1:{s.port}/healthz", context=ctx)[0] == 200
    (tmp_path / "web.yml").write_text("")
    assert s.refresh()
    assert http_get(f"http://127.0.0.1:{s.port}/healthz")[0] == 200


def test_thread_count_does_not_grow_with_idle_connections(sinks):
    s = sinks(first_byte_timeout=30.0)
    before = threading.active_count()
    with Flood(s.port, 300, ["127.0.0.5"]):
        wait_for(lambda: len(s._server.slots) >= 300, timeout=15)
        assert threading.active_count() <= before + 1  # the flood's own thread only


def test_a_surprise_on_one_connection_is_counted_and_the_endpoint_keeps_serving(sinks, monkeypatch, caplog):
    s = sinks()
    front = s._server
    real, calls = front._admit, []

    def admit_once_broken(sock, address) -> None:
        calls.append(address)
        if len(calls) == 1:
            sock.close()
            raise RuntimeError("a socket state nobody expected")
        real(sock, address)

    monkeypatch.setattr(front, "_admit", admit_once_broken)
    with pytest.raises(OSError):
        http_get(f"http://127.0.0.1:{s.port}/healthz", timeout=2)
    assert max(timed_scrapes(f"http://127.0.0.1:{s.port}/metrics", n=3)) < 1.0
    assert s.health().up and s.health().failed >= 1
    assert "failed on a connection" in caplog.text


def test_a_new_pages_gzip_and_openmetrics_bodies_are_built_off_the_loop_once(sinks):
    s = sinks()
    url = f"http://127.0.0.1:{s.port}/metrics"
    before = s._server.offloaded
    for _ in range(3):
        assert http_get(url, {"Accept-Encoding": "gzip"})[2].startswith(b"\x1f\x8b")
        assert http_get(url, {"Accept": "application/openmetrics-text; version=1.0.0"})[2].endswith(b"# EOF\n")
    assert s._server.offloaded == before + 2  # the first of each on a worker, the rest from the loop
    assert http_get(url)[0] == 200 and s._server.offloaded == before + 2  # text 0.0.4 is built at publish


@pytest.mark.parametrize("tls", [False, True])
def test_kept_alive_scrapes_are_not_held_back_by_nagle_and_delayed_acks(sinks, tmp_path, ca, tls):
    """An answer goes out as a head and a body (and TLS records): with Nagle's algorithm on, the
    second small write waits for the client's delayed ACK (40 ms on Linux) on every kept-alive
    scrape, which is how Prometheus scrapes. Accepted sockets set TCP_NODELAY, as Go's do."""
    if tls:
        s = sinks(web_config_file=write_tls(tmp_path, ca, client_auth=True))
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            "127.0.0.1", s.port, timeout=5, context=client(ca, with_cert=True))
    else:
        s = sinks()
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=5)
    took = []
    try:
        for _ in range(11):
            t0 = time.monotonic()
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            assert response.status == 200 and b"gpumon_test_value" in response.read()
            took.append(time.monotonic() - t0)
    finally:
        conn.close()
    assert statistics.median(took[1:]) < 0.03, took  # a stall is >= 40 ms each time; an answer ~1 ms


def test_a_ready_request_is_answered_before_pending_tls_handshakes(sinks, tmp_path, ca):
    """Handshakes with client certificates cost milliseconds of CPU each: a request that is ready
    goes first, and the handshakes after it a few per turn, all of them completed."""
    s = sinks(web_config_file=write_tls(tmp_path, ca, client_auth=True))
    front, ctx = s._server, client(ca, with_cert=True)
    scraper = http.client.HTTPSConnection("127.0.0.1", s.port, timeout=5, context=ctx)
    raws = [socket.create_connection(("127.0.0.1", s.port), timeout=10) for _ in range(12)]
    stalled, release = threading.Event(), threading.Event()
    steps: list[str] = []
    real_start_tls, real_respond, real_source_of = front._start_tls, front.app.respond, front.source_of

    def start_tls(conn):
        steps.append("handshake")
        real_start_tls(conn)

    def respond(conn, head):
        steps.append("request")
        return real_respond(conn, head)

    try:
        scraper.request("GET", "/metrics")
        assert scraper.getresponse().read()  # its handshake done, kept alive
        wait_for(lambda: len(front.slots) == 13)
        served = next(c for c in list(front.slots.conns) if c.tls)
        front._start_tls, front.app.respond = start_tls, respond
        # hold the loop inside the accept of one more connection while the others all get ready
        def source_of(address: str) -> str:
            stalled.set()
            release.wait(10)
            return real_source_of(address)

        front.source_of = source_of
        raws.append(socket.create_connection(("127.0.0.1", s.port), timeout=5))
        assert stalled.wait(5)  # the loop is held before anything else is ready
        ends = [ctx.wrap_socket(raw, server_hostname="127.0.0.1", do_handshake_on_connect=False)
                for raw in raws[:12]]
        done: list[bool] = []

        def handshake(end: ssl.SSLSocket) -> None:
            end.do_handshake()
            done.append(True)

        threads = [threading.Thread(target=handshake, args=(end,)) for end in ends]
        for thread in threads:
            thread.start()
        waiting = [c for c in list(front.slots.conns) if c.state == WAIT_TLS]
        assert len(waiting) == 12
        wait_for(lambda: len(select.select([c.sock for c in waiting], [], [], 0)[0]) == 12)  # hellos in
        scraper.request("GET", "/metrics")  # ready last
        wait_for(lambda: select.select([served.sock], [], [], 0)[0])
        release.set()
        assert scraper.getresponse().status == 200
        for thread in threads:
            thread.join(10)
        assert len(done) == 12  # every handshake finished, only later
        assert steps[0] == "request", steps
    finally:
        release.set()
        front.source_of = real_source_of
        scraper.close()
        for raw in raws:
            raw.close()
