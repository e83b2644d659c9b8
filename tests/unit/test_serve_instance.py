"""ServeLease: a run stops all of Ray Serve only when it started it; in a Serve it found running it
deletes only its own app (a shared cluster's other apps keep serving); a deploy on another address
than the running Serve's is refused at once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ray import serve

import clawray.serve.instance as instance


@pytest.fixture
def calls(monkeypatch):
    """Record what the lease stops: ``shutdown`` (all of Serve) or ``delete:APP``."""
    seen: list[str] = []
    monkeypatch.setattr(instance, "shutdown_serve", lambda: seen.append("shutdown"))
    monkeypatch.setattr(serve, "delete", lambda name: seen.append(f"delete:{name}"))
    return seen


@pytest.mark.parametrize(("running", "stopped"), [(False, ["shutdown"]), (True, ["delete:clawray"])])
def test_a_lease_stops_all_of_serve_only_when_it_started_it(monkeypatch, calls, running, stopped):
    monkeypatch.setattr(instance, "serve_running", lambda: running)
    lease = instance.ServeLease(instance.APP_NAME)
    assert lease.deploy(lambda: "http://127.0.0.1:1/v1") == "http://127.0.0.1:1/v1"
    assert lease.owned is (not running)
    lease.release()
    lease.release()  # once only
    assert calls == stopped


def test_a_deploy_that_fails_part_way_is_still_released_and_no_deploy_releases_nothing(monkeypatch, calls):
    monkeypatch.setattr(instance, "serve_running", lambda: False)
    instance.ServeLease("app").release()  # never deployed: a run refused at start-up stops nothing
    assert calls == []
    lease = instance.ServeLease("app")

    def failing_deploy():
        raise RuntimeError("the replica did not start")

    with pytest.raises(RuntimeError, match="did not start"):
        lease.deploy(failing_deploy)
    lease.release()
    assert calls == ["shutdown"]


def test_another_address_than_the_running_serves_is_refused(monkeypatch):
    monkeypatch.setattr(instance, "serve_http_address", lambda: ("127.0.0.1", 8000))
    instance.check_serve_address("127.0.0.1", 8000)  # the running one: fine
    with pytest.raises(instance.ServerStartError) as err:
        instance.check_serve_address("0.0.0.0", 8000)
    assert str(err.value) == (
        "Ray Serve already runs in this Ray cluster with its HTTP proxy on 127.0.0.1:8000 (it keeps the address "
        "it first started on), not on serve.host=0.0.0.0 serve.port=8000: set serve.host=127.0.0.1 "
        "serve.port=8000, or use a cluster without Serve"
    )
    monkeypatch.setattr(instance, "serve_http_address", lambda: None)
    instance.check_serve_address("0.0.0.0", 9)  # no Serve yet: this run starts it where it asks


def test_a_port_another_program_listens_on_is_refused_in_one_line_before_serve_starts(monkeypatch):
    """Serve's proxy failing to bind a busy port was a 55-line Ray traceback."""
    import socket

    monkeypatch.setattr(instance, "serve_http_address", lambda: None)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        assert not instance.port_free("127.0.0.1", port)
        with pytest.raises(instance.ServerStartError) as err:
            instance.check_serve_address("127.0.0.1", port)
        assert str(err.value) == (
            f"serve.port={port} is in use on 127.0.0.1 by another program: set serve.port to a free port"
        )
    assert instance.port_free("127.0.0.1", port)  # closed: free again


def test_the_running_address_is_read_from_the_controller(monkeypatch):
    class Controller:
        class get_http_config:  # noqa: N801 - the actor method's name
            @staticmethod
            def remote():
                return SimpleNamespace(host="127.0.0.1", port=41234)

    monkeypatch.setattr(instance, "_controller", lambda: Controller)
    monkeypatch.setattr("ray.get", lambda ref, timeout=None: ref)
    assert instance.serve_http_address() == ("127.0.0.1", 41234)
    monkeypatch.setattr(instance, "_controller", lambda: None)
    assert instance.serve_http_address() is None and instance.serve_running() is False
