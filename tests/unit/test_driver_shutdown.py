"""Driver.shutdown ends what setup opened, once: the metrics log (its wandb run is finished and its
files made private) also when Ray never came up."""

from clawray.driver import Driver
from conftest import tiny_run_config


class _Log:
    def __init__(self):
        self.finished = 0

    def finish(self):
        self.finished += 1


def test_shutdown_finishes_the_metrics_log_once(tmp_path, tiny_model):
    """The input: the metrics log was renamed from ``tracking`` and shutdown still looked for the old
    attribute, so no run's wandb run was ever finished nor its files made 0700."""
    d = Driver(tiny_run_config(tiny_model, tmp_path / "run"))
    assert d.metrics is None
    d.shutdown()  # nothing opened yet: nothing to finish, no error
    d = Driver(tiny_run_config(tiny_model, tmp_path / "run"))
    d.metrics = log = _Log()
    d.shutdown()
    d.shutdown()  # idempotent
    assert log.finished == 1


def test_resume_of_a_mistyped_run_dir_fails_before_anything_is_made(tmp_path, tiny_model, monkeypatch):
    """``resume=true`` with a run folder that holds no checkpoint and no journal used to fail only
    after the model was built and Ray started, leaving the new folder behind with a lock file."""
    import pytest

    from clawray import build

    def no_build(cfg):
        raise AssertionError("the model was built before the resume was checked")

    monkeypatch.setattr(build, "ensure_model", no_build)
    run_dir = tmp_path / "runs" / "typo"
    d = Driver(tiny_run_config(tiny_model, run_dir, overrides=["resume=true"]))
    with pytest.raises(FileNotFoundError, match="resume=true but there is no checkpoint in .* and no journal in"):
        d.setup()
    assert not run_dir.exists()
