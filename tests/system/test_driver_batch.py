"""The driver's batch path reads sample metadata only: it never fetches a sample payload.

``Driver.step`` runs on fakes (no Ray cluster): every ``ray.get`` is counted and one on a sample's
ref fails the test, so the step has to take the batch, drop all-masked samples, compute the
advantages (binary and GRPO groups by prompt) and log the metrics from the queue's
:class:`~clawray.types.SampleMeta` alone, and hand the refs on to the learners untouched.
"""

import json
import math

import pytest
import ray

from clawray.config import load_config
from clawray.driver import Driver
from clawray.metrics_log import MetricsLog
from clawray.types import Sample, SampleMeta


class PayloadRef:
    """Stands for a sample's object ref; only a learner may resolve it."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"PayloadRef({self.name})"


class Done:
    """The value of a fake actor call (what ``.remote()`` returns)."""

    def __init__(self, value):
        self.value = value


class Actor:
    """A fake actor handle: ``handle.method.remote(*args)`` -> ``Done(fn(*args))``, calls recorded."""

    def __init__(self, **methods):
        self.calls = []
        for name, fn in methods.items():
            setattr(self, name, self._method(name, fn))

    def _method(self, name, fn):
        actor = self

        class Method:
            @staticmethod
            def remote(*args, **kwargs):
                actor.calls.append((name, args))
                return Done(fn(*args, **kwargs))

        return Method


def counting_get(log):
    def get(refs, timeout=None):
        many = isinstance(refs, list)
        out = []
        for ref in refs if many else [refs]:
            if isinstance(ref, PayloadRef):
                raise AssertionError(f"the driver fetched the payload of {ref}")
            assert isinstance(ref, Done), ref
            log.append(ref)
            out.append(ref.value)
        return out if many else out[0]

    return get


def _sample(name, prompt, reward, trainable=True):
    return Sample(
        tokens=prompt + [50, 51, 52],
        prompt_len=len(prompt),
        loss_mask=[int(trainable)] * 3,
        rollout_logprobs=[-1.0] * 3,
        reward=reward,
        policy_version=0,
        session_id=name,
        turn_index=1,
    )


def _driver(tmp_path, monkeypatch, estimator, samples, train_step, sync=None):
    """A Driver on fakes: the queue hands out ``samples`` as one batch, the learners are
    ``train_step``, the weight sync ``sync(version)`` (default: succeeds)."""
    batch = {
        "refs": [PayloadRef(s.session_id) for s in samples],
        "meta": [SampleMeta.of(s) for s in samples],
        "versions": [0] * len(samples),
        "staleness": [1] * len(samples),
        "seqs": list(range(1, len(samples) + 1)),
    }
    cfg = load_config(
        ["conf/rl.yaml", "conf/cpu.yaml"],
        [
            "model.path=unused",
            f"run_dir={tmp_path}",
            "trainer.batch_size=2",
            "trainer.max_batch_size=4",
            f"trainer.advantage={estimator}",
            "env.resample_n=2",  # grpo needs groups (a config check)
            "checkpoint.every_steps=0",
            "wandb.mode=disabled",
        ],
    )
    d = Driver(cfg)
    d.actors.queue = Actor(
        get_batch=lambda *a: batch,
        stats=lambda: {"size": 0, "put": 4, "taken": 4, "dropped": {}},
        consumed=lambda seqs, step, ok: None,
    )
    d.actors.tracker = Actor(stats=lambda: {"open_sessions": 0})
    d.actors.engines, d.actors.judges, d.actors.teachers = [], [], []
    d.actors.learners = type("Learners", (), {"train_step": staticmethod(train_step)})()
    d.actors.weight_sync = type(
        "Sync",
        (),
        {
            "behind": False,
            "failures": 0,
            "engine_versions": lambda self: {},
            "sync": lambda self, v: (sync or _sync_result)(v),
        },
    )()
    d.metrics = MetricsLog(str(tmp_path / "metrics"), "disabled")
    gets = []
    monkeypatch.setattr(ray, "get", counting_get(gets))
    return d, gets


@pytest.mark.parametrize("estimator, expected", [("binary", [1.0, -1.0, 1.0]), ("grpo", [1.0, -1.0, 0.0])])
def test_step_decides_on_metadata_and_never_fetches_a_sample(monkeypatch, tmp_path, capsys, estimator, expected):
    # A, B (all-masked) and C share a prompt, D has its own
    samples = [
        _sample("A", [1, 2, 3], 1.0),
        _sample("B", [1, 2, 3], -1.0, trainable=False),
        _sample("C", [1, 2, 3], -1.0),
        _sample("D", [1, 2, 4], 1.0),
    ]
    trained = []

    def train_step(refs, version, advantages, entropy_coef, probe=None, probe_wait_s=0.0, versions=None, lengths=None):
        assert versions == [0] * len(refs)  # as the queue holds the samples
        tokens = {s.session_id: len(s.tokens) for s in samples}
        assert lengths == [tokens[r.name] for r in refs]  # the ranks' split, from the metadata
        trained.append((refs, version, advantages))
        # C's mini-batch was non-finite: skipped, its sample not trained (the others were)
        return {"skipped": 0.0, "loss": 0.5, "inv/entropy": 3.0, "train_s": 0.1, "nonfinite_mini_batches": 1.0,
                "untrained_samples": [1]}  # fmt: skip

    d, gets = _driver(tmp_path, monkeypatch, estimator, samples, train_step)
    m = d.step()

    refs, version, advantages = trained[0]
    assert [r.name for r in refs] == ["A", "C", "D"] and version == 1  # the very refs, B dropped (all-masked)
    assert advantages == pytest.approx(expected)
    assert m["samples"] == 3 and m["reward_mean"] == pytest.approx(1 / 3) and m["skipped"] == "no"
    assert m["inv/staleness_mean"] == 1.0 and m["inv/dropped_samples/all_masked"] == 1
    # trained: A and D of the 4 the queue decided (B all-masked, C in a non-finite mini-batch)
    assert m["inv/effective_sample_rate"] == pytest.approx(2 / 4) and not math.isnan(m["loss"])
    assert list(d.state.trained_samples) == [("A", 1), ("D", 1)] and d.version == 1
    assert d.state.samples_trained == 2 and "untrained_samples" not in m
    rows = [json.loads(line) for line in open(tmp_path / "metrics" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1] and rows[0]["samples"] == 3
    assert d.state.metrics_row["step"] == 1 and d.state.metrics_row["samples"] == 3  # what a checkpoint would carry
    assert ("consumed", ([1, 2, 3, 4], 1, True)) in d.actors.queue.calls  # the whole batch, B included
    assert len(gets) >= 3  # the batch, the queue's and the tracker's stats went through the counted get
    assert "engines resumed" not in capsys.readouterr().out  # the sync succeeded: no failure is told


def _sync_result(version):
    return {
        "ok": True,
        "version": version,
        "seconds": 0.01,
        "bytes": 8.0,
        "gather_s": 0.0,
        "send_s": 0.01,
        "receive_s": {},
        "load_s": {},
        "failed": [],
        "error": None,
        "rebuild_s": 0.0,
        "versions": {},
    }


def test_a_step_stopped_during_its_sync_logs_the_update_the_exit_checkpoint_holds(monkeypatch, tmp_path, capsys):
    """Ctrl-C during step 1's weight sync: the learners hold v1, which the exit checkpoint saves as step
    1, but no row of step 1 was logged and summary.json said nothing of it (a v1 model whose update
    was never logged). Now its row (``interrupted``) and the summary's ``interrupted_update`` say it,
    when (and only when) the exit checkpoint holds the update."""
    samples = [_sample("A", [1, 2, 3], 1.0), _sample("C", [1, 2, 3], -1.0)]

    def train_step(refs, version, advantages, entropy_coef, probe=None, probe_wait_s=0.0, versions=None, lengths=None):
        return {"skipped": 0.0, "loss": 0.25, "inv/entropy": 3.0, "train_s": 0.1}

    def interrupted(version):
        raise KeyboardInterrupt

    d, _ = _driver(tmp_path, monkeypatch, "binary", samples, train_step, sync=interrupted)
    with pytest.raises(KeyboardInterrupt):
        d.step()
    assert d.state.in_flight["train"]["loss"] == 0.25 and d.state.steps_done == 0 and d.version == 0
    summary = d.summary(1.0)  # run() writes it when interrupted
    assert summary["steps"] == 0 and summary["policy_version"] == 0  # what the engines serve
    d._log_interrupted()  # no exit checkpoint (a learner died, or save_at_exit=false): nothing claimed
    assert (tmp_path / "metrics" / "metrics.jsonl").read_text() == ""
    d.checkpoints.last = {"path": "ckpt-000001", "version": 1, "steps_done": 1}  # the exit checkpoint
    d._log_interrupted()
    rows = [json.loads(line) for line in open(tmp_path / "metrics" / "metrics.jsonl")]
    assert [(r["step"], r["policy_version"], r["interrupted"], r["loss"]) for r in rows] == [(1, 1, 1.0, 0.25)]
    assert "step 1/20: stopped after its update (policy v1, 2 samples, never served)" in capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["interrupted_update"] == {"step": 1, "version": 1}
