"""SimUserPool.hold / release, the serial loop's gate (``trainer.overlap: false``): while held, no
request of the pool is in flight and none starts; after release the users go on. A fake OpenAI
client stands in for the endpoint (each request takes 50 ms), so no server or Ray is needed."""

import threading
import time
from types import SimpleNamespace


from clawray.config import EnvConfig
from clawray.envs.sim_user import SimUserPool


class SlowClient:
    """``client.chat.completions.create``: sleeps 50 ms, answers "7", counts calls in progress."""

    def __init__(self):
        self.lock = threading.Lock()
        self.active = 0
        self.max_active = 0
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **kwargs):
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        time.sleep(0.05)
        with self.lock:
            self.active -= 1
        msg = SimpleNamespace(content="7", tool_calls=None)
        return SimpleNamespace(choices=[SimpleNamespace(message=msg)])


def _pool(concurrency=3):
    pool = SimUserPool("http://127.0.0.1:9/v1", EnvConfig(name="brief", concurrency=concurrency))
    pool.client = SlowClient()
    return pool


def test_hold_waits_for_requests_in_flight_and_blocks_new_ones_until_release():
    pool = _pool(3)
    pool.start()
    try:
        time.sleep(0.3)  # 3 users, 50 ms per request: all three are mid-session
        assert pool.client.max_active == 3
        assert pool.hold(timeout_s=10) == 0
        held_at = time.time()
        assert pool.client.active == 0
        time.sleep(0.3)  # six request times: a user that ignored the hold would have sent one
        released_at = time.time()
        assert pool.client.active == 0
        before = pool.get_stats()["requests"]
        pool.release()
        time.sleep(0.3)
        assert pool.get_stats()["requests"] > before  # they go on after the release
    finally:
        pool.stop()
    log = pool.request_log()
    assert len(log) == pool.get_stats()["requests"]
    # every logged request ended before the hold returned or started after the release
    overlapping = [(a, b) for a, b in log if a < released_at and b > held_at]
    assert overlapping == []
    assert any(a >= released_at for a, _ in log) and any(b <= held_at for _, b in log)


def test_stop_ends_users_waiting_at_a_hold():
    pool = _pool(2)
    pool.start()
    time.sleep(0.2)
    assert pool.hold(timeout_s=10) == 0
    before = pool.get_stats()["requests"]
    pool.stop(timeout_s=5)
    assert not any(t.is_alive() for t in pool._threads)
    assert pool.get_stats()["requests"] == before  # no request left after the stop
    assert pool.get_stats().get("errors", 0) == 0
