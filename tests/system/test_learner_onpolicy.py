"""On-policy ratios and the trust region of the FSDP2 learner (tiny model, Ray).

* lr = 0 matrix: samples whose rollout log-probs come from the learner's own weights give ratio 1,
  no clipping and zero mismatch KL, for {rollout, proximal} anchor x {full model with attention
  dropout 0.3 in its config, LoRA rank 8 with dropout 0.3} x {1, 2 optimizer
  steps per batch} x {1, 2 ranks}: no stochastic layer may act in the learner's forwards.
* proximal anchor: decoupled PPO's trust region acts from the second mini-batch on.
* a learner group that fails to start releases its placement group and names the cause.
"""

import dataclasses
import json
import shutil
import sys
import time

import pytest
import ray
import torch

from clawray.actors.learner import LearnerGroup, LearnerStartError
from clawray.algos.losses import sequence_logprobs
from clawray.ray_env import free_port
from clawray.types import Sample

LEARNER = dict(
    num_cpus=0.25,
    torch_threads=1,
    lr=0.0,
    weight_decay=0.0,
    betas=[0.9, 0.98],
    grad_clip=1.0,
    eps=0.2,
    eps_high=0.28,
    dist_timeout_s=60,
    max_tokens_per_micro_batch=1,
)
# the helpers below run inside the learner actors (__ray_call__), which cannot import this test module
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

LORA = {"rank": 8, "alpha": 16.0, "dropout": 0.3, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _samples(prompt_lens=(3, 5, 4, 6, 3), resp_lens=(4, 2, 7, 3, 5), seed=0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        tokens = torch.randint(10, 1000, (p + r,), generator=g).tolist()
        out.append(
            Sample(
                tokens=tokens,
                prompt_len=p,
                loss_mask=[1] * r,
                reward=(-1.0) ** k,
                rollout_logprobs=[0.0] * r,
                policy_version=0,
            )
        )
    return out


def _on_policy(model_dir: str, samples: list[Sample], state: dict | None = None) -> list[Sample]:
    """The samples with rollout log-probs of the model at ``model_dir`` (with the weights ``state``
    when given), one sample per forward in eval mode: what a rollout engine computes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state)
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens])
            lp = sequence_logprobs(model(input_ids=ids).logits[0, s.prompt_len - 1 : -1], ids[0, s.prompt_len :])
            out.append(dataclasses.replace(s, rollout_logprobs=lp.tolist()))
    return out


@pytest.fixture(scope="module")
def dropout_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model with ``attention_dropout: 0.3`` in its config (active only in train mode)."""
    path = tmp_path_factory.mktemp("dropout") / "tiny"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "config.json").read_text())
    config["attention_dropout"] = 0.3
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_the_reference_model_computes_in_the_policys_compute_dtype(ray_cluster, tiny_model):
    """kl_coef > 0 with ``learner.compute_dtype=bfloat16`` (the CUDA default): at lr 0 the KL to the
    frozen reference is 0, as in fp32. The reference used to compute in fp32 beside the bf16 policy,
    so the KL term pushed the policy before it had moved at all."""
    learner = {**LEARNER, "kl_coef": 0.05, "compute_dtype": "bfloat16", "num_workers": 1}
    group = LearnerGroup(tiny_model, learner, free_port())
    try:
        m = group.train_step([ray.put(s) for s in _on_policy(tiny_model, _samples())], 1)
        assert m["num_tokens"] == 21 and m["optimizer_steps"] == 1
        assert abs(m["kl"]) < 1e-12, m["kl"]  # fp32 reference: 1.9e-6 on the tiny model
    finally:
        group.shutdown()


def _random_lora_b(worker, seed: int) -> None:
    """Inside a LearnerWorker (every rank): the adapters' B matrices get N(0, 0.1^2) values, the same
    on every rank, as after some training. A fresh adapter has B = 0, where LoRA dropout (on the
    adapter's input) cannot change the output."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    options = StateDictOptions(full_state_dict=True)
    full = get_model_state_dict(worker.model, options=options)
    g = torch.Generator().manual_seed(seed)
    for name in sorted(full):
        if ".lora_B." in name:
            full[name] = 0.1 * torch.randn(full[name].shape, generator=g)
    set_model_state_dict(worker.model, full, options=options)


def _set(group: LearnerGroup, **options) -> None:
    """Change learner options read at each ``train_step`` (anchor, steps per batch) on every rank."""
    ray.get(
        [
            w.__ray_call__.remote(lambda self, kw: [setattr(self.cfg, k, v) for k, v in kw.items()], options)
            for w in group.workers
        ]
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_lr0_on_policy_matrix(ray_cluster, tiny_model, dropout_model, workers):
    """lr = 0 and samples made by the learner's weights: every cell of {rollout, proximal} x {full
    model (attention dropout 0.3), LoRA r8 (dropout 0.3, non-zero B)} x {1, 2 steps per batch} has
    ratio 1 within fp32 rounding, clip_frac 0 and mismatch KL < 1e-6; the full model also has KL to
    its frozen reference < 1e-6 (kl_coef 0.05). ``max_tokens_per_micro_batch=1``: one sample per
    pass, so with 2 ranks and 5 samples one rank runs padding passes (also in the proximal pre-pass)."""
    failures = []
    for label, model, extra in [("full", dropout_model, {"kl_coef": 0.05}), ("lora", tiny_model, {"lora": LORA})]:
        group = LearnerGroup(model, {**LEARNER, **extra, "num_workers": workers}, free_port())
        try:
            state = None
            if "lora" in extra:
                ray.get([w.__ray_call__.remote(_random_lora_b, 0) for w in group.workers])
                state = ray.get([w.state_dict.remote() for w in group.workers])[0]  # merged, base names
            refs = [ray.put(s) for s in _on_policy(model, _samples(), state)]
            version = 0
            for anchor in ("rollout", "proximal"):
                for steps in (1, 2):
                    _set(group, ratio_anchor=anchor, steps_per_batch=steps)
                    batch = [ray.put(dataclasses.replace(ray.get(r), policy_version=version)) for r in refs]
                    version += 1
                    m = group.train_step(batch, version)
                    cell = (label, anchor, steps, workers)
                    assert m["optimizer_steps"] == steps and m["num_tokens"] == 21, cell
                    ok = (
                        abs(m["inv/ratio_max"] - 1) < 1e-5
                        and abs(m["inv/ratio_mean"] - 1) < 1e-5
                        and m["inv/clip_frac"] == 0.0
                        and m["inv/logprob_mismatch_kl"] < 1e-6
                        and abs(m["kl"]) < 1e-6
                        and abs(m["inv/is_weight_mean"] - 1) < 1e-5
                    )
                    if not ok:
                        failures.append(
                            (
                                cell,
                                {
                                    k: round(m[k], 6)
                                    for k in (
                                        "inv/ratio_max",
                                        "inv/ratio_mean",
                                        "inv/clip_frac",
                                        "inv/logprob_mismatch_kl",
                                        "kl",
                                        "inv/is_weight_mean",
                                    )
                                },
                            )
                        )
        finally:
            group.shutdown()
    if failures:
        pytest.fail("cells off-policy at lr 0:\n" + "\n".join(f"{c}: {m}" for c, m in failures))


def test_kept_gathered_weights_never_outlive_a_weight_change(ray_cluster, tiny_model):
    """``reshard_after_forward: false``, 2 ranks: the mismatch probe's no-grad forward (after the
    backward, before the optimizer step) left every layer's gathered weights in place, and the next
    forward reused them: one update behind the shards. After a step with a probe, and after a restore,
    the learner's forward must use the current shards (a state dict gathers afresh: not a check)."""
    group = LearnerGroup(
        tiny_model, {**LEARNER, "lr": 1e-3, "num_workers": 2, "reshard_after_forward": False}, free_port()
    )
    try:
        samples = _samples()
        probe = [ray.put(samples[0])]  # policy version 0: these weights made it, so it is scored
        group.keep_promoted()
        m = group.train_step([ray.put(s) for s in samples], 1, probe=probe, probe_wait_s=5.0)
        assert m["optimizer_steps"] == 1 and m["inv/mismatch_probe_tokens"] == 4

        # rollout log-probs of the initial weights: a forward on stale gathered weights matches them
        initial = _on_policy(tiny_model, [dataclasses.replace(samples[2], policy_version=1)])
        assert group.probe_invariants(initial)["mismatch_kl"] > 1e-6  # stale: 0.0
        state = ray.get([w.state_dict.remote() for w in group.workers])[0]  # the shards, gathered
        now = _on_policy(tiny_model, [dataclasses.replace(samples[2], policy_version=1)], state)
        assert group.probe_invariants(now)["mismatch_kl"] < 1e-9  # and it leaves the layers gathered
        group.restore_promoted()
        assert group.probe_invariants([dataclasses.replace(initial[0], policy_version=0)])["mismatch_kl"] < 1e-9
    finally:
        group.shutdown()


def test_proximal_anchor_clips_in_the_second_mini_batch(ray_cluster, tiny_model, tmp_path):
    """lr 5e-2, 5 on-policy samples, 2 mini-batches (samples 0-1: 6 tokens, then 2-4: 15 tokens), 2
    ranks. Decoupled PPO: mini-batch 1 trains on the proximal weights themselves (ratio exactly 1,
    nothing clipped); mini-batch 2's anchor is the pre-update policy, so its ratios move and the clip
    acts. The samples are on-policy, so the proximal and rollout log-probs coincide: both anchors
    must give the same ratios, clip fraction and loss (the old proximal code gave ratio 1.0 and clip
    0 throughout), and the TIS weight exp(proximal - rollout) is 1."""
    refs = [ray.put(s) for s in _on_policy(tiny_model, _samples())]
    cfg = {**LEARNER, "lr": 5e-2, "num_workers": 2, "steps_per_batch": 2}
    group = LearnerGroup(tiny_model, cfg, free_port())
    metrics = {}
    try:
        ray.get([w.save_checkpoint.remote(str(tmp_path)) for w in group.workers])
        for anchor in ("proximal", "rollout"):
            _set(group, ratio_anchor=anchor)
            metrics[anchor] = group.train_step(refs, 1)
            ray.get([w.load_checkpoint.remote(str(tmp_path)) for w in group.workers])  # initial weights, AdamW
    finally:
        group.shutdown()
    prox, roll = metrics["proximal"], metrics["rollout"]
    assert prox["optimizer_steps"] == 2 and prox["num_tokens"] == 21
    assert prox["inv/ratio_max"] > 1.0 + 1e-3 and abs(prox["inv/ratio_mean"] - 1.0) > 1e-3
    assert 0 < prox["inv/clip_frac"] * 21 <= 15  # clipped tokens, all in mini-batch 2
    for key in ("inv/ratio_max", "inv/ratio_mean", "inv/clip_frac", "loss"):
        assert prox[key] == pytest.approx(roll[key], abs=1e-5), key
    assert prox["inv/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)


def _live_placement_groups() -> set[str]:
    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


def _settled_cpus() -> float:
    """Available CPUs once two reads 0.5 s apart agree (earlier tests' actors release asynchronously)."""
    last = ray.available_resources().get("CPU", 0.0)
    for _ in range(40):
        time.sleep(0.5)
        now = ray.available_resources().get("CPU", 0.0)
        if now == last:
            return now
        last = now
    return last


def test_failed_learner_start_releases_its_placement_group(ray_cluster, tiny_model):
    """A worker whose constructor raises (LoRA on a module the model lacks): the group raises an
    error naming the rank and the cause, its placement group is removed and its 2 x 0.5 CPUs return
    (the old code kept them reserved until the driver exited)."""
    live, before = _live_placement_groups(), _settled_cpus()
    cfg = {**LEARNER, "num_workers": 2, "num_cpus": 0.5, "lora": {**LORA, "target_modules": ["no_such"]}}
    with pytest.raises(
        LearnerStartError, match=r"learner rank [01] of 2 failed to start: \S*Error: Target modules .*no_such"
    ):
        LearnerGroup(tiny_model, cfg, free_port())
    assert _live_placement_groups() <= live  # ours is removed
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0.0) < before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0.0) >= before
