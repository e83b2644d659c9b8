"""What a finished job tells the user: where the model is, the commands that use it, and no second
checkpoint of an unchanged policy at exit."""

from clawray.config import load_config
from clawray.driver import closing_lines, exit_checkpoint_needed


def test_exit_checkpoint_only_for_a_new_policy():
    last = {"marker": (3, 3, True, 40, 30, []), "version": 3, "path": "/r/checkpoints/ckpt-000001"}
    assert exit_checkpoint_needed(None, (0, 0, True, 0, 0, []))
    assert not exit_checkpoint_needed(last, (3, 3, True, 40, 30, []))
    assert not exit_checkpoint_needed(last, (3, 3, True, 52, 30, [("stale", 2)]))  # only traffic since
    assert exit_checkpoint_needed(last, (4, 4, True, 52, 34, []))  # a newer policy
    assert exit_checkpoint_needed(last, (3, 3, False, 52, 34, []))  # a batch in flight


def test_closing_lines_name_the_model_and_commands():
    cfg = load_config(["conf/rl.yaml", "conf/cpu.yaml"], ["run_dir=runs/x"])
    ckpt = {"path": "runs/x/checkpoints/ckpt-000001", "version": 3, "bytes": 2.5 * 2**30}
    lines = closing_lines(cfg, ckpt)
    assert lines[0] == (
        "trained model (policy v3): runs/x/checkpoints/ckpt-000001/model (checkpoint 2560 MiB; "
        "checkpoint.save_optimizer=false keeps only the model)"
    )
    assert lines[1].endswith("conf/serve.yaml model.path=runs/x/checkpoints/ckpt-000001/model")
    assert lines[2].startswith(f"evaluate it: clawray eval runs/x/checkpoints/ckpt-000001/model --env {cfg.env.name}")
    assert lines[3].startswith("report:      clawray report runs/x")
    assert closing_lines(cfg, None) == [lines[3]]
