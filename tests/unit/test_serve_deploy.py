"""Waiting for the deployed PolicyServer (clawray.serve.deploy.wait_policy_server): it returns once
the application runs (every replica up) and /health answers 200, names a failed deployment with
Serve's own message at once, and says that Serve runs on another port when the application is
RUNNING but nothing answers for 30 s."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

import clawray.serve.deploy as app
from clawray.serve.instance import ServerStartError

URL = "http://127.0.0.1:9/v1"


class _Clock:
    """time.monotonic that moves on by each time.sleep."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def _world(monkeypatch, answers: list, statuses: list) -> _Clock:
    """/health answers ``answers`` in turn (an int: that status; None: refused); Serve's status of
    the application ``statuses`` in turn (the last one repeats)."""
    clock, seen = _Clock(), []

    def get(url, timeout):
        seen.append(url)
        code = answers.pop(0) if answers else None
        if code is None:
            raise httpx.ConnectError("refused")
        return SimpleNamespace(status_code=code)

    def status():
        st = statuses.pop(0) if len(statuses) > 1 else statuses[0]
        return SimpleNamespace(applications={} if st is None else {app.APP_NAME: st})

    monkeypatch.setattr(httpx, "get", get)
    monkeypatch.setattr(app.serve, "status", status)
    monkeypatch.setattr(app.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(app.time, "sleep", clock.sleep)
    clock.seen = seen
    return clock


def _app(status: str, message: str = "") -> SimpleNamespace:
    return SimpleNamespace(status=f"ApplicationStatus.{status}", message=message)


def test_returns_once_running_and_health_answers(monkeypatch):
    """/health may answer while one of two replicas is up (DEPLOYING): sessions would then move when
    the second one comes (the multi-node test saw a session on both replicas); only RUNNING counts."""
    statuses = [None, _app("DEPLOYING"), _app("DEPLOYING"), _app("RUNNING"), _app("RUNNING")]
    clock = _world(monkeypatch, [None, 200], statuses)
    app.wait_policy_server(URL)
    assert clock.seen == ["http://127.0.0.1:9/health"] * 2 and clock.now == 2.0  # asked only once RUNNING


def test_a_failed_deployment_is_named_at_once(monkeypatch):
    clock = _world(
        monkeypatch, [], [_app("DEPLOYING"), _app("DEPLOY_FAILED", "PolicyServer.__init__ raised: no tokenizer")]
    )
    with pytest.raises(ServerStartError, match="failed to deploy: PolicyServer.__init__ raised: no tokenizer"):
        app.wait_policy_server(URL)
    assert clock.now == 0.5  # the second look, not a timeout


def test_running_without_an_answer_names_the_port_after_30_s(monkeypatch):
    clock = _world(monkeypatch, [], [_app("DEPLOYING")] * 10 + [_app("RUNNING")])
    with pytest.raises(ServerStartError, match="Serve keeps the port it first started on"):
        app.wait_policy_server(URL)
    assert clock.now == pytest.approx(5.0 + 30.5)  # 10 polls deploying, then 30 s running


def test_a_deployment_that_never_runs_times_out(monkeypatch):
    clock = _world(monkeypatch, [], [_app("DEPLOYING")])
    with pytest.raises(
        ServerStartError, match=r"not running 20 s after its deployment \(ApplicationStatus.DEPLOYING\)"
    ):
        app.wait_policy_server(URL, timeout_s=20)
    assert clock.now == pytest.approx(20.5)


def test_an_endpoint_beyond_loopback_without_an_api_key_is_warned_about():
    """``serve.host=0.0.0.0`` without ``serve.api_key`` served anyone who reached it, and their turns
    trained the policy, without a word. Start-up now says so (loopback, or a key: silent)."""
    from clawray.serve.deploy import exposure_warning

    for host in ("0.0.0.0", "10.0.0.5", "::"):
        assert "without serve.api_key" in exposure_warning(host, "")
    assert [exposure_warning(h, "") for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2")] == [None] * 4
    assert exposure_warning("0.0.0.0", "sk-local") is None
