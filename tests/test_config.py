import pytest

from clawray.config import ConfigError, load_config


def test_presets_merge_and_override():
    cfg = load_config(["conf/rl.yaml", "conf/cpu.yaml"], ["trainer.num_steps=7", "judge.m=5"])
    assert cfg.trainer.num_steps == 7
    assert cfg.judge.m == 5
    assert cfg.judge.backend == "feedback"  # cpu.yaml overrides rl.yaml
    assert cfg.rollout.backend == "vllm"
    assert cfg.learner.eps == 0.2 and cfg.learner.eps_high == 0.28
    assert cfg.learner.lr == 2.0e-6


def test_serve_preset_trains_until_interrupted():
    cfg = load_config(["conf/rl.yaml", "conf/cpu.yaml", "conf/serve.yaml"])
    assert (cfg.env.enabled, cfg.trainer.num_steps, cfg.trainer.batch_timeout_s) == (False, -1, 0)
    with pytest.raises(ConfigError, match="num_steps"):
        load_config([], ["trainer.num_steps=-2"])


def test_rl_preset_alone_uses_engine_judge():
    assert load_config(["conf/rl.yaml"]).judge.backend == "engine"


@pytest.mark.parametrize("override, fragment", [
    ("trainer.bogus=1", "trainer.bogus"),
    ("nosuch=1", "nosuch"),
    ("trainer.num_steps=abc", "trainer.num_steps"),
    ("rollout.backend=sglang", "rollout.backend"),
    ("judge.m=0", "judge.m"),
    ("no_equals_sign", "key=value"),
    ("opd.hint_template='{hint} {other}'", "opd.hint_template"),  # would fail on every hinted turn
    ("opd.hint_template='[{0}] {hint}'", "opd.hint_template"),
    ("opd.hint_template=no placeholder", "opd.hint_template"),
    ("opd.teacher_timeout_s=0", "opd.teacher_timeout_s"),
])
def test_bad_overrides_name_the_key(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_config([], [override])


def test_unknown_key_in_file_names_file_and_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("learner:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*learner\.lrr"):
        load_config([str(p)])


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config(["conf/nope.yaml"])


def test_config_is_read_only():
    cfg = load_config()
    with pytest.raises(Exception):
        cfg.trainer.num_steps = 3
