from clawray.driver import Driver
import test_serial_loop as t

def test_without_hold(ray_cluster, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(Driver, "_hold_traffic", lambda self: 0.0)
    t.test_serial_loop_never_generates_while_it_trains_or_syncs(ray_cluster, tiny_model, tmp_path)
