"""The on-policy-gap probe (invariant 3): the engine/learner log-prob mismatch at every policy version.

``inv/logprob_mismatch_kl`` compares the log-probs a rollout engine sampled tokens with against the
learner's log-probs of the same tokens under the *same* weights, so only engine numerics (kernels,
precision, a prefix cache) separate them. Fresh samples measure it only while the learner trains on
replies of its current version, which the asynchronous loop never does after its first step (every
sample is at least one version stale). So after each weight sync, when engines and learners hold
the same version, engine 0 samples one short reply (``monitor.mismatch_probe_tokens``) to the
prompt of a sample the learners just trained on (the batch's shortest, at most its last
``monitor.mismatch_probe_prompt_tokens`` tokens, at its temperature), and the next train step scores
it before its first optimizer step (``LearnerWorker.train_step(probe=...)``: one no-grad forward, no
gradient). The learners wait for the reply only after their first mini-batch's backward, so the
generation overlaps the step's own work (``timing/probe_wait_s``, at most
``monitor.mismatch_probe_wait_s``).

Owns: the probe's request and the version it must be scored at. Must not: train on the reply,
choose an engine (the driver passes engine 0) or fetch a training sample (a task builds the request
where the sample is).
"""

from __future__ import annotations

from typing import Any

import ray

from clawray.engines.base import GenerateRequest
from clawray.types import Sample


@ray.remote(num_cpus=0)
def _probe_reply(
    sample: Sample, engine: Any, max_tokens: int, prompt_tokens: int, stop_ids: list[int], seed: int
) -> Sample | None:
    """Engine ``engine``'s reply to ``sample``'s prompt (at most its last ``prompt_tokens`` tokens,
    at its temperature) as a probe :class:`~clawray.types.Sample`, or None for an empty reply. A
    task, so that the driver never fetches a training sample (only this ~prompt_tokens probe)."""
    prompt = list(sample.tokens[: sample.prompt_len])[-prompt_tokens:]
    request = GenerateRequest(
        prompt_ids=prompt, max_tokens=max_tokens, temperature=sample.temperature, stop_token_ids=stop_ids, seed=seed
    )
    out = ray.get(engine.generate.remote(request))
    if not out["response_ids"]:
        return None
    n = len(out["response_ids"])
    return Sample(
        tokens=prompt + list(out["response_ids"]),
        prompt_len=len(prompt),
        loss_mask=[1] * n,
        rollout_logprobs=list(out["logprobs"]),
        reward=None,
        policy_version=out["policy_version"],
        temperature=sample.temperature,
        token_versions=list(out["token_versions"]),
        info={"mismatch_probe": True},
    )


class MismatchProbe:
    """Launches a probe reply after a sync and hands it to the next train step.

    Args:
        monitor: the ``monitor`` config section (``mismatch_probe_tokens``: 0 = off,
            ``mismatch_probe_prompt_tokens``, ``mismatch_probe_wait_s``, ``seed``).

    Attributes:
        launched, used, dropped: probes sent to the engine; scored by a train step; dropped (not
            ready in time, failed, empty, or sampled partly by another version).
    """

    def __init__(self, monitor: Any):
        self.tokens = int(monitor.mismatch_probe_tokens)
        self.prompt_tokens = int(monitor.mismatch_probe_prompt_tokens)
        self.wait_s = float(monitor.mismatch_probe_wait_s)
        self.seed = int(monitor.seed)
        self.stop_ids: list[int] | None = None  # the policy's end-of-turn ids, read at the first launch
        self.launched = self.used = self.dropped = 0
        self._pending: Any = None  # ObjectRef of _probe_reply's Sample | None
        self._version = -1  # the version the pending probe was launched at

    def launch(self, engine: Any, refs: list, metas: list, version: int, model_path: str) -> None:
        """Ask ``engine`` (now serving ``version``, as the learners hold) for a probe reply to the
        shortest of the batch's samples (``refs[i]``, sized by ``metas[i].num_tokens``). A probe
        not yet taken is dropped (cancelled). No-op when off or without a sample."""
        if self.tokens <= 0 or not refs:
            return
        self._drop()
        i = min(range(len(metas)), key=lambda k: metas[k].num_tokens)
        seed = (self.seed * 1_000_003 + version) % 2**31
        stop_ids = self._stop_ids(model_path)
        self._pending = _probe_reply.remote(refs[i], engine, self.tokens, self.prompt_tokens, stop_ids, seed)
        self._version = version
        self.launched += 1

    def take(self, learner_version: int) -> list | None:
        """``[ObjectRef]`` of the pending probe (a :class:`~clawray.types.Sample` or None) for the
        next train step's ``probe`` when it was launched at ``learner_version``, else None (dropped).
        The learners wait for it, at most ``wait_s``, and check its tokens' versions."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if self._version != learner_version:
            ray.cancel(pending)
            self.dropped += 1
            return None
        return [pending]

    def record(self, train: dict) -> None:
        """Count a probe handed to a train step as used when the step scored it
        (``inv/mismatch_probe_tokens`` > 0), else as dropped."""
        if train.get("inv/mismatch_probe_tokens", 0) > 0:
            self.used += 1
        else:
            self.dropped += 1

    def metrics(self) -> dict[str, float]:
        """``inv/mismatch_probes_dropped``: probes launched but not scored, over the run."""
        return {"inv/mismatch_probes_dropped": float(self.dropped)}

    def _drop(self) -> None:
        if self._pending is not None:
            ray.cancel(self._pending)
            self._pending = None
            self.dropped += 1

    def _stop_ids(self, model_path: str) -> list[int]:
        if self.stop_ids is None:  # the ids that end a reply, as the server stops on them
            from transformers import AutoTokenizer

            from clawray.chat import end_of_turn_ids

            self.stop_ids = end_of_turn_ids(model_path, AutoTokenizer.from_pretrained(model_path))
        return self.stop_ids
