"""Basic auth on the endpoint: the failure budget by source and user, verified credentials kept
across a restart, the scheme's case, and `/healthz` left open for Kubernetes probes."""

from __future__ import annotations

import base64
import os
import stat
import sys

import bcrypt
import pytest

from gpumon.sinks.base import SinkContext
from gpumon.sinks.prometheus import PrometheusSink
from gpumon.sinks.prometheus.webconfig import Auth, FailureLimiter, VerifiedStore, load_web_config
from tests.conftest import REPO, http_get
from tests.support.endpoint import section, snapshot

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GOOD = "Basic " + base64.b64encode(b"prometheus:s3cret").decode()
WRONG = "Basic " + base64.b64encode(b"prometheus:guess").decode()
STRANGER = "Basic " + base64.b64encode(b"root:guess").decode()


@pytest.fixture
def web(tmp_path):
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    (tmp_path / "state").mkdir(mode=0o700)
    return path


@pytest.fixture
def start(web, tmp_path):
    made: list[PrometheusSink] = []

    def make(**values) -> PrometheusSink:
        s = PrometheusSink(SinkContext("h", str(tmp_path / "state"), "1"),
                           section(web_config_file=str(web), auth_failures_per_minute=6, **values))  # burst 1
        s.start()
        s.publish(snapshot())
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def test_verified_credentials_survive_a_restart_while_an_attacker_spends_the_budget(start, tmp_path):
    first = start()
    url = f"http://127.0.0.1:{first.port}/metrics"
    assert http_get(url, {"Authorization": GOOD})[0] == 200  # one bcrypt check, remembered
    first.stop()
    second = start()
    url = f"http://127.0.0.1:{second.port}/metrics"
    # an attacker on the scraper's own address spends the user's budget right after the restart
    assert [http_get(url, {"Authorization": WRONG})[0] for _ in range(3)] == [401, 429, 429]
    for _ in range(5):  # the scraper is known from before the restart: never checked, never limited
        assert http_get(url, {"Authorization": GOOD})[0] == 200
    state = tmp_path / "state"
    for name in (VerifiedStore.KEY, VerifiedStore.DIGESTS):
        mode = os.stat(state / name).st_mode
        assert stat.S_IMODE(mode) == 0o600
        assert b"s3cret" not in (state / name).read_bytes()


def test_a_changed_password_forgets_what_was_verified(web, tmp_path):
    state = tmp_path / "state"
    config = load_web_config(str(web))
    config.remember(VerifiedStore(str(state)))
    assert config.verify(GOOD) is Auth.OK
    web.write_text(f"basic_auth_users:\n  prometheus: '{bcrypt.hashpw(b'other', bcrypt.gensalt(rounds=4)).decode()}'\n")
    renewed = load_web_config(str(web))
    renewed.remember(VerifiedStore(str(state)))
    assert renewed.screen(GOOD) is Auth.PENDING  # not taken from the kept digests
    assert renewed.verify(GOOD) is Auth.DENIED


def test_a_key_file_others_can_read_is_not_used(web, tmp_path):
    state = tmp_path / "state"
    (state / VerifiedStore.KEY).write_bytes(b"k" * 32)
    os.chmod(state / VerifiedStore.KEY, 0o644)
    assert VerifiedStore(str(state)).key() is None  # logged; the process keeps an in-memory key
    config = load_web_config(str(web))
    config.remember(VerifiedStore(str(state)))
    assert config.verify(GOOD) is Auth.OK and not (state / VerifiedStore.DIGESTS).exists()


def test_the_budget_is_per_source_and_user_so_made_up_names_cannot_spend_a_users(web, tmp_path):
    config = load_web_config(str(web))
    limiter = FailureLimiter(6)  # burst 1
    assert [config.verify(STRANGER, "10.0.0.1", limiter) for _ in range(2)] == [Auth.DENIED, Auth.THROTTLED]
    other = "Basic " + base64.b64encode(b"admin:guess").decode()
    assert config.verify(other, "10.0.0.1", limiter) is Auth.THROTTLED  # unknown names share one budget
    assert config.verify(GOOD, "10.0.0.1", limiter) is Auth.OK  # the real user's budget is untouched
    assert len(limiter._buckets) == 2


@pytest.mark.parametrize("scheme", ["basic", "BASIC", "Basic", "bAsIc"])
def test_the_auth_scheme_is_case_insensitive(start, scheme):
    s = start()
    token = GOOD.split(" ", 1)[1]
    assert http_get(f"http://127.0.0.1:{s.port}/metrics", {"Authorization": f"{scheme} {token}"})[0] == 200


def test_healthz_needs_credentials_unless_open_healthz(start):
    closed, opened = start(), start(open_healthz=True)
    assert http_get(f"http://127.0.0.1:{closed.port}/healthz")[0] == 401
    status, _, body = http_get(f"http://127.0.0.1:{opened.port}/healthz")
    assert status == 200 and body == b"ok\n"
    for path in ("/metrics", "/health", "/"):  # only the liveness answer is open
        assert http_get(f"http://127.0.0.1:{opened.port}{path}")[0] == 401


def test_the_daemonset_keeps_its_probes_working_when_basic_auth_is_turned_on():
    with open(os.path.join(REPO, "deploy", "kubernetes", "base", "gpumon.toml"), "rb") as fh:
        assert tomllib.load(fh)["prometheus"]["open_healthz"] is True


def test_a_429_is_answered_without_a_worker_thread(start):
    s = start()
    url = f"http://127.0.0.1:{s.port}/metrics"
    assert http_get(url, {"Authorization": WRONG})[0] == 401  # the one check the burst allows
    assert s._server.offloaded == 1  # that check ran on a worker
    for _ in range(20):
        assert http_get(url, {"Authorization": WRONG})[0] == 429
    assert s._server.offloaded == 1  # the 429s were answered in the loop
