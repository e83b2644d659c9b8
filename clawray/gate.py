"""The promotion gate (``deploy.gate``): no user is served a policy version that a probe found worse.

Owns: the promoted version and its probe scores, the probe of a candidate (the environment's
``deploy.probe_split`` split, eval by default, and its check, fixed prompts and seeds, so two
versions' results pair item by item), the decision (:func:`clawray.promotion.decide`: an exact
paired sign test with a margin and a floor, or under ``deploy.rule: noninferior`` a paired
non-inferiority bound), the order of a candidate's sync, probe (and canary) and promotion or
rollback (:meth:`PromotionGate.sync_candidate`), the rejection count and ``run_dir/versions.jsonl``.
Must not: pack or move a weight (the sync controller does, :meth:`~clawray.weight_sync.WeightSyncController.sync`
``hold=True``), train, or decide when a step syncs (:mod:`clawray.driver`).

How a candidate is judged (:meth:`PromotionGate.sync_candidate`, called by the driver's step): the learners' new weights
are loaded into every engine while the engines are paused for users (their requests wait, parked
generations included); the probe's generations run on those paused engines
(:meth:`~clawray.actors.rollout.RolloutEngine.generate` ``probe=True``; with a canary,
``deploy.canary_fraction``, only the canary engine loads and probes it while the others serve, then it
serves the canary sessions until its live verdict: :meth:`PromotionGate._sync_canary`,
:mod:`clawray.canary`); promoted: the engines resume
on the candidate and the learners keep it as their rollback point; rejected: the learners return to
the promoted version's weights and AdamW state (kept in host memory), the learning rate backs off by
``deploy.lr_backoff``, the promoted weights are synced back and the engines resume on them (a candidate rejected only as
unproven, ``deploy.rule: noninferior``, is rolled back without the back-off). Either
way no user token is sampled by a candidate before its decision, and none ever by a rejected one.
The promoted version's scores are those it got as a candidate (same prompts and seeds), so each
decision probes one version. A candidate is judged against the promoted version and also against the
best promoted one so far (highest probe mean): drops too small for one probe to tell would otherwise
add up over successive promotions (a ratchet); against the best, they are caught once they add up.
The invariant guards at the candidate's version: the learners (holding the candidate too) score the
first ``deploy.guard_replies`` probe replies for the policy entropy and the engine/learner mismatch
(:meth:`~clawray.actors.learner.LearnerWorker.probe_invariants`;
:func:`~clawray.promotion.guard_failure`). What users wait for: the probe and the guards' forward
plus, on a rejection, a second sync (``deploy/users_held_s`` per decision). ``deploy.max_rejections``
in a row stop the run (:class:`GateStopped`, naming the last probe's figures). Each record keeps its
per-item scores, so a resume (:meth:`PromotionGate.resume`) pairs with the checkpoint's promoted
version and keeps the best one without probing again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

from clawray.file_modes import open_private
from clawray.records import DamagedFileError, append_whole, read_jsonl
from clawray.promotion import Decision, decide, guard_failure
from clawray.reply_compare import ReplyComparisons
from clawray.types import Sample


class GateStopped(RuntimeError):
    """``deploy.max_rejections`` candidates in a row were rejected: the run stops (the message has
    the last decision's figures)."""


@dataclasses.dataclass
class GateOutcome:
    """What :meth:`PromotionGate.sync_candidate` did.

    Attributes:
        seconds: the whole of it (sync, probe, rollback), wall.
        error: the sync's error (the candidate's, or the promoted version's sync back), else None.
        metrics: the sync's step metrics plus ``deploy/*`` and ``engine_version/*``.
        rolled_back: the learners returned to the promoted version (rejected or withdrawn).
    """

    seconds: float
    error: str | None
    metrics: dict[str, float]
    rolled_back: bool


class PromotionGate:
    """The gate's state and decisions (see the module docstring).

    Args:
        deploy: the ``deploy`` config section (:class:`~clawray.config.DeployConfig`).
        env_cfg: the ``env`` section (the environment whose ``deploy.probe_split`` split is the probe;
            ``max_tokens``).
        run_dir: the run folder (``versions.jsonl``).
        untagged_tool_calls: ``serve.untagged_tool_calls`` (replies are parsed as served).
        judge_backend: ``judge.backend``; a probe file with compare items needs one that compares
            (``engine`` or ``openai``), else a ConfigError here.

    Attributes:
        promoted: the promoted policy version (the one users are served), or None before
            :meth:`baseline`.
        promoted_scores: its per-item probe scores.
        best, best_scores: the promoted version with the highest probe mean so far, and its scores.
        rejections: candidates rejected in a row.
        records: every decision's record (also appended to ``versions.jsonl``).
    """

    def __init__(
        self, deploy: Any, env_cfg: Any, run_dir: str, untagged_tool_calls: bool = False, judge_backend: str = ""
    ):
        self.cfg, self.env_cfg, self.run_dir = deploy, env_cfg, run_dir
        self.untagged_tool_calls = untagged_tool_calls
        self.enabled = bool(deploy.gate)
        self.promoted: int | None = None
        self.promoted_scores: list[float] = []
        self.best: int | None = None  # the promoted version with the highest probe mean so far
        self.best_scores: list[float] = []
        self.rejections = 0
        self.dropped_samples = 0  # samples trained into rolled-back versions (deploy.on_reject)
        self.pending: list[Any] = []  # SampleMetas trained since the promoted version (not yet judged)
        self.pending_seqs: list[int] = []  # their journal sequence numbers
        self.records: list[dict[str, Any]] = []
        self.reference_guards: dict[str, float] | None = None  # the baseline's entropy (guard_failure)
        self.last_replies: list[tuple[Any, Any]] = []  # the last probe's (request, reply) pairs
        self._evaluator: Any = None
        self._last: Decision | None = None
        self._last_guards: dict[str, float] | None = None
        self.comparisons = ReplyComparisons([], [])  # the probe file's compare items (set in _build)
        self.last_texts: list[str | None] = []  # the last probe's reply text per item
        if self.enabled and deploy.probe_file:  # a malformed file stops the run before it starts
            from clawray.config import ConfigError

            try:
                env = self.probe_env()
            except (OSError, ValueError) as e:
                raise ConfigError(f"deploy.probe_file: {e}") from None
            if judge_backend == "feedback" and any(item.compare for item in env.items):
                raise ConfigError(
                    f"deploy.probe_file={deploy.probe_file} has compare items, which a judge compares: "
                    "judge.backend=feedback cannot (use engine or openai, or give those lines a rule)"
                )

    # ---------------------------------------------------------------- probe
    def probe_env(self) -> Any:
        """The probe's items and check: ``deploy.probe_file``'s conversations
        (:class:`~clawray.envs.probe_file.ProbeFileEnv`), else the environment (its
        ``deploy.probe_split`` split is probed).

        Raises:
            FileNotFoundError, ValueError: a missing or malformed probe file (``path:line: why``).
        """
        if self.cfg.probe_file:
            from clawray.envs.probe_file import ProbeFileEnv

            return ProbeFileEnv(self.cfg.probe_file)
        from clawray.envs import env_from_config

        return env_from_config(self.env_cfg)

    def probe_identity(self) -> dict[str, Any]:
        """What decides the probe's items and scores: its source (the environment's name, level and
        data file, or the probe file, each file by its SHA-256), the split, prompts, samples, seed,
        temperature, reply length and measure. Scores of two versions pair item by item only under
        equal identities (recorded with the baseline; a resume under another one probes anew)."""
        import hashlib

        def digest(path: str) -> str | None:
            try:
                with open(path, "rb") as f:
                    return hashlib.sha256(f.read()).hexdigest()
            except OSError:
                return None

        d, env = self.cfg, self.env_cfg
        if d.probe_file:
            source = {"probe_file": digest(d.probe_file)}
        elif env is not None:
            source = {"env": env.name, "level": env.level, "data": digest(env.data_path) if env.data_path else None}
        else:  # a gate built without an environment (tests): the probe settings alone
            source = {}
        return {
            **source,
            "split": d.probe_split,
            "prompts": d.probe_prompts,
            "n": d.probe_n,
            "seed": d.probe_seed,
            "temperature": d.probe_temperature,
            "max_tokens": env.max_tokens if env is not None else None,
            "measure": d.measure,
        }

    def _build(self, model_path: str) -> Any:
        if self._evaluator is None:
            from transformers import AutoTokenizer

            from clawray.evaluation import Evaluator

            d = self.cfg
            self._evaluator = Evaluator(
                self.probe_env(),
                AutoTokenizer.from_pretrained(model_path),
                n=d.probe_n,
                num_prompts=d.probe_prompts,
                temperature=d.probe_temperature,
                seed=d.probe_seed,
                max_tokens=self.env_cfg.max_tokens,
                split=d.probe_split,
                untagged_tool_calls=self.untagged_tool_calls,
            )
            tasks = [t for t in self._evaluator.tasks for _ in range(d.probe_n)]  # one per probe item
            compare = [i for i, t in enumerate(tasks) if getattr(t, "compare", False)]
            kept = self.comparisons.replies  # a resume restored the references before the first probe
            self.comparisons = ReplyComparisons(compare, [tasks[i].messages for i in compare])
            self.comparisons.replies = kept
        return self._evaluator

    def probe(self, model_path: str, generate: Callable[[list], list]) -> tuple[list[float], float]:
        """Score the version that ``generate`` serves on the probe items: ``(scores, seconds)``, one
        score in [0, 1] per item (prompt-major, ``probe_n`` per prompt), the check's ``deploy.measure``.

        Raises:
            ConfigError: the check does not report ``deploy.measure`` (the first probe, the promoted
                version's at the start, stops the run with it: ``clawray run`` exits 2).
        """
        from clawray.config import ConfigError

        pairs: list[tuple[Any, Any]] = []

        def recorded(requests: list) -> list:
            outs = generate(requests)
            pairs.extend(zip(requests, outs))
            return outs

        result = self._build(model_path).run(recorded)
        self.last_replies = pairs
        self.last_texts = [reply.get("reply") for reply in result["replies"]]
        measure = self.cfg.measure
        scores = []
        for reply in result["replies"]:
            s = reply["scores"]
            key = measure or next(iter(s))
            if key not in s:
                raise ConfigError(f"deploy.measure={measure!r}: the environment's check reports {sorted(s)}")
            scores.append(float(s[key]))
        return scores, result["seconds"]

    def guard_samples(self) -> list[Sample]:
        """The last probe's first ``deploy.guard_replies`` non-empty replies as samples for the
        learners' :meth:`~clawray.actors.learner.LearnerWorker.probe_invariants` (none when the
        guards are off)."""
        d = self.cfg
        if d.guard_replies <= 0 or (d.entropy_ratio_min <= 0 and d.mismatch_max <= 0):
            return []
        out = []
        for request, reply in self.last_replies:
            ids = list(reply["response_ids"])
            if not ids:
                continue
            prompt = list(request.prompt_ids)
            out.append(
                Sample(
                    tokens=prompt + ids,
                    prompt_len=len(prompt),
                    loss_mask=[1] * len(ids),
                    rollout_logprobs=list(reply["logprobs"]),
                    reward=None,
                    policy_version=reply["policy_version"],
                    temperature=request.temperature,
                    token_versions=list(reply.get("token_versions") or []) or None,
                    info={"gate_probe": True},
                )
            )
            if len(out) == d.guard_replies:
                break
        return out

    def compare_replies(self, version: int, judges: list) -> dict[int, list[float]]:
        """The judge's preferences of candidate ``version``'s last probe replies on the compare items
        over the promoted and the best promoted version's (:class:`~clawray.reply_compare.ReplyComparisons`),
        the calls spread over ``judges`` (JudgeWorker actors); empty without compare items.

        Raises:
            RuntimeError: compare items but no judge; a judge call's error (the candidate is withdrawn).
        """
        if not self.comparisons:
            return {}
        if not judges:
            raise RuntimeError("the probe's compare items need a judge, and this run has none")
        import ray

        def compare(requests: list) -> list[int]:
            refs = [judges[i % len(judges)].compare.remote(*r) for i, r in enumerate(requests)]
            return [result.score for result in ray.get(refs)]

        texts = self.comparisons.texts(self.last_texts)
        return self.comparisons.preferences(version, texts, [self.promoted, self.best], compare)

    def measure_guards(self, learners: Any) -> dict[str, float] | None:
        """The learners' entropy and mismatch on the last probe's replies (the version both hold);
        None when the guards are off."""
        samples = self.guard_samples()
        return learners.probe_invariants(samples) if samples else None

    # ---------------------------------------------------------------- state
    def baseline(
        self,
        version: int,
        model_path: str,
        generate: Callable[[list], list],
        guards: Callable[[], dict[str, float] | None] | None = None,
    ) -> float:
        """Probe the version the engines serve now and promote it (the run's start, or a resume);
        returns its mean score. ``guards()`` measures its invariants on the probe's replies (the
        reference of the entropy guard)."""
        scores, seconds = self.probe(model_path, generate)
        self.reference_guards = guards() if guards is not None else None
        self.best = None
        self._promote(version, scores)
        mean = sum(scores) / len(scores)
        self._record(
            {
                "version": version,
                "decision": "baseline",
                "mean": mean,
                "items": len(self.promoted_scores),
                "probe": self.probe_identity(),
                "probe_s": seconds,
                "scores": scores,
                **(self.reference_guards or {}),
                **({"compare_replies": self.comparisons.texts(self.last_texts)} if self.comparisons else {}),
            }
        )
        print(
            f"[clawray] gate: v{version} promoted as the baseline: probe mean {mean:.3f} over "
            f"{len(self.promoted_scores)} items ({seconds:.1f}s)",
            flush=True,
        )
        return mean

    def _promote(self, version: int, scores: list[float]) -> None:
        """``version`` (probe ``scores``) becomes the promoted version, and the best one when its mean
        is the highest so far."""
        self.promoted, self.promoted_scores, self.rejections = version, list(scores), 0
        if self.best is None or sum(scores) > sum(self.best_scores):
            self.best, self.best_scores = version, list(scores)
        if self.comparisons:
            self.comparisons.keep(version, self.comparisons.texts(self.last_texts), {self.best})

    def due(self, version: int) -> bool:
        """Whether learner version ``version`` is probed (``deploy.every_versions`` after the promoted
        one); the versions in between are never served."""
        return self.promoted is None or version - self.promoted >= self.cfg.every_versions

    def served(self, version: int) -> int:
        """The version users are served while the learners hold ``version``: the promoted one with
        the gate on (once there is one), else ``version``."""
        return self.promoted if self.enabled and self.promoted is not None else version

    def settled(self, version: int) -> bool:
        """Whether the learners' ``version`` is the promoted one (always true with the gate off): only
        then may a checkpoint be taken, so a resume never serves an unprobed version."""
        return not self.enabled or version == self.promoted

    def judge(
        self,
        version: int,
        scores: list[float],
        probe_s: float,
        samples: int = 0,
        guards: dict | None = None,
        prefs: dict[int, list[float]] | None = None,
    ) -> Decision:
        """Decide on candidate ``version`` from its probe ``scores`` (paired with the promoted
        version's) and its invariant ``guards`` (:func:`~clawray.promotion.guard_failure` against the
        baseline's); record it; on promotion it becomes the promoted version. ``samples`` trained into
        it are counted as dropped when it is rejected (:meth:`check_stop` then says whether to stop).
        ``prefs``: the judge's preferences on the compare items over each reference version
        (:meth:`compare_replies`), which replace the candidate's 0.5 there when paired with it."""
        decision = self.assess(scores, guards, prefs)
        return self.conclude(version, decision, scores, probe_s, samples, guards, prefs)

    def assess(
        self, scores: list[float], guards: dict | None = None, prefs: dict[int, list[float]] | None = None
    ) -> Decision:
        """:meth:`judge`'s decision on probe ``scores`` and ``guards``, not recorded and acted on."""
        d = self.cfg
        rule = dict(margin=d.margin, alpha=d.alpha, floor=d.floor, rule=d.rule)
        prefs = prefs or {}

        def against(ref: int | None, ref_scores: list[float]) -> Decision:
            mine = self.comparisons.paired(scores, prefs[ref]) if ref in prefs else scores
            return decide(mine, ref_scores, **rule)

        decision = against(self.promoted, self.promoted_scores)
        if self.best is not None and self.best != self.promoted:
            # small drops that no single probe can tell would otherwise add up, one promotion at a time
            vs_best = against(self.best, self.best_scores)
            # the best's verdict counts when it fails and the promoted one's does not, or names harm
            if not vs_best.promote and (decision.promote or (vs_best.backoff and not decision.backoff)):
                vs_best.reason = f"against the best promoted v{self.best}: {vs_best.reason}"
                decision = vs_best
        failure = guard_failure(guards, self.reference_guards, d.entropy_ratio_min, d.mismatch_max)
        if decision.promote and failure is not None:
            reason = f"rejected: {failure} ({decision.reason})"
            decision = dataclasses.replace(decision, promote=False, backoff=True, reason=reason)
        return decision

    def conclude(
        self,
        version: int,
        decision: Decision,
        scores: list[float],
        probe_s: float,
        samples: int = 0,
        guards: dict | None = None,
        prefs: dict[int, list[float]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Decision:
        """Record ``decision`` on candidate ``version`` (:meth:`judge`'s arguments; ``extra``: more
        fields of its record, the canary's) and act on it: promoted, it becomes the promoted version;
        rejected, the rejection is counted. Returns ``decision``."""
        prefs = prefs or {}
        record = {
            "version": version,
            "promoted_before": self.promoted,
            "decision": "promoted" if decision.promote else "rejected",
            "reason": decision.reason,
            "candidate_mean": decision.candidate_mean,
            "promoted_mean": decision.promoted_mean,
            "delta": decision.delta,
            "delta_ci": list(decision.delta_ci),
            "worse": decision.worse,
            "better": decision.better,
            "p_worse": decision.p_worse,
            "lower": decision.lower,
            "items": decision.n,
            "probe_s": probe_s,
            "scores": scores,
            **(guards or {}),
            **(extra or {}),
        }
        if self.comparisons:  # the replies a later candidate is compared with, and the judge's verdicts
            record["compare_replies"] = self.comparisons.texts(self.last_texts)
            record["compare_prefs"] = {str(v): p for v, p in prefs.items()}
        if decision.promote:
            self._promote(version, scores)
        else:
            self.rejections += 1
            self.dropped_samples += samples
            record["rejections_in_a_row"] = self.rejections
            record["backoff"] = decision.backoff
        self._record(record)
        print(f"[clawray] gate: v{version} {decision.reason}", flush=True)
        self._last, self._last_guards = decision, guards
        return decision

    def check_stop(self) -> None:
        """Raise when ``deploy.max_rejections`` candidates in a row were rejected (the driver calls it
        once the step is rolled back and logged).

        Raises:
            GateStopped: naming the last decision's figures.
        """
        if self.enabled and self.rejections >= self.cfg.max_rejections:
            raise GateStopped(
                f"the promotion gate rejected {self.rejections} candidates in a row (deploy.max_rejections="
                f"{self.cfg.max_rejections}); users are still served v{self.promoted}. Last: {self._last.reason}"
            )

    def withdraw(self, version: int, reason: str) -> None:
        """Record candidate ``version`` as withdrawn: its weights did not reach the engines, or its
        probe or canary failed, so it was not judged (it is rolled back without a learning-rate back-off)."""
        self._record({"version": version, "decision": "withdrawn", "reason": reason})
        print(f"[clawray] gate: v{version} withdrawn ({reason}); users keep v{self.promoted}", flush=True)

    def metrics(self, decision: Decision | None, users_held_s: float, probe_s: float = 0.0) -> dict[str, float]:
        """``deploy/*`` for the step's row: the serving (promoted) version, rejections in a row, samples
        dropped, and with a decision 1/0 promoted and rejected, both means, the p-value, the probe's
        seconds and the seconds users were held."""
        out = {
            "deploy/serving_version": float(self.promoted if self.promoted is not None else -1),
            "deploy/rejections": float(self.rejections),
            "deploy/dropped_samples": float(self.dropped_samples),
        }
        if decision is not None:
            out.update(
                {
                    "deploy/promoted": float(decision.promote),
                    "deploy/rejected": float(not decision.promote),
                    "deploy/probe_s": probe_s,
                    "deploy/candidate_mean": decision.candidate_mean,
                    "deploy/promoted_mean": decision.promoted_mean,
                    "deploy/p_worse": decision.p_worse,
                    "deploy/users_held_s": users_held_s,
                }
            )
            for key in ("entropy", "mismatch_kl"):  # the invariant guards at the candidate's version
                if self._last_guards and key in self._last_guards:
                    out[f"deploy/{key}"] = float(self._last_guards[key])
        return out

    # ---------------------------------------------------------------- the run's actors
    def start(self, actors: Any, version: int, model_path: str, resumed: bool = False) -> None:
        """The engines' current version (the initial or resumed policy) becomes the promoted one: the
        learners keep it as their rollback point and the probe scores it, unless ``resumed`` and
        ``versions.jsonl`` holds its scores (:meth:`resume`). Nothing with the gate off."""
        if self.enabled:
            actors.learners.keep_promoted()
            if resumed and self.resume(version):
                return
            generate = lambda reqs: probe_generate(actors.engines, reqs)  # noqa: E731
            self.baseline(version, model_path, generate, lambda: self.measure_guards(actors.learners))

    def trained(self, metas: list, seqs: list[int] | None = None) -> None:
        """The learners trained these samples (:class:`~clawray.types.SampleMeta`; ``seqs``: their
        journal sequence numbers) into the next version: they are dropped (or quarantined) with it if
        it is rolled back."""
        self.pending.extend(metas)
        self.pending_seqs.extend(seqs or [])

    def _drop_pending(self, actors: Any, version: int, decision: str) -> None:
        """The samples trained since the promoted version are gone with the rolled-back ``version``:
        count them (``deploy/dropped_samples``), discard them from the sample journal (a later rewind
        or resume revived them, the journal had them only as consumed) and, with ``deploy.on_reject:
        quarantine``, write one line per sample to ``run_dir/quarantine.jsonl`` (where it came from and
        its reward) for a person to read before training on such turns again."""
        pending, self.pending = self.pending, []
        seqs, self.pending_seqs = self.pending_seqs, []
        self.dropped_samples += len(pending)
        if seqs and getattr(actors, "queue", None) is not None:
            import ray

            try:
                ray.get(actors.queue.discard.remote(seqs), timeout=60)
            except Exception as e:  # noqa: BLE001 - the gate's decision stands; a resume may revive them
                print(f"[clawray] gate: the rolled-back samples were not discarded from the journal ({e})", flush=True)
        if self.cfg.on_reject != "quarantine" or not pending:
            return
        fields = ("session_id", "turn_index", "policy_version", "reward", "kind", "outcome")
        lines = [
            json.dumps({"version": version, "decision": decision, **{k: getattr(m, k, None) for k in fields}})
            for m in pending
        ]
        try:
            with open_private(os.path.join(self.run_dir, "quarantine.jsonl"), "a") as f:
                f.write("\n".join(lines) + "\n")
        except OSError as e:  # a full disk loses the quarantine lines, never the run
            print(f"[clawray] quarantine.jsonl not updated ({e.strerror or type(e).__name__})", flush=True)

    def sync_candidate(self, actors: Any, version: int, model_path: str) -> GateOutcome:
        """Sync candidate ``version`` into the engines held paused for users, probe it, then resume
        the engines on it (promoted: the learners keep it as their rollback point) or roll the learners
        back to the promoted version and sync that back (rejected: learning rate x
        ``deploy.lr_backoff``; withdrawn, without a back-off, when the candidate's sync or probe
        failed). The samples trained since the promoted version (:meth:`trained`) are dropped with a
        rolled-back candidate (:meth:`_drop_pending`). ``deploy/users_held_s``: pause to resume.
        Raises nothing for a member's failure (the sync controller's rule)."""
        from clawray.canary import canary_engine
        from clawray.recovery import restarted_engines
        from clawray.weight_sync import WeightSyncController

        sync = actors.weight_sync
        t0 = time.perf_counter()
        restarted = restarted_engines(actors)
        k = canary_engine(self.cfg, actors.engines)
        if k is not None and not restarted:  # [deploy.canary_fraction] (after a restart: resync, no canary)
            return self._sync_canary(actors, version, model_path, k)
        hold = sync.resync if restarted else sync.sync
        result = hold(version, hold=True)
        metrics = WeightSyncController.metrics(result, sync.failures)
        decision, error, held_s, probe_s = None, None, 0.0, 0.0
        if result["held"]:
            t_probe = time.perf_counter()
            try:
                scores, probe_s = self.probe(model_path, lambda reqs: probe_generate(actors.engines, reqs))
                guards = self.measure_guards(actors.learners)  # the learners hold the candidate too
                prefs = self.compare_replies(version, actors.judges)
                decision = self.judge(version, scores, probe_s, 0, guards, prefs)
            except Exception as e:  # noqa: BLE001 - an unprobed candidate is never served
                self.withdraw(version, f"the probe failed: {type(e).__name__}: {e}")
            if decision is not None and decision.promote:
                errors = sync.release()
                actors.learners.keep_promoted()
                error = f"resuming the engines after the probe: {errors}" if errors else None
            else:
                backoff = decision is not None and decision.backoff  # not for a withdrawn or unproven one
                error = self._roll_back(actors, self.cfg.lr_backoff if backoff else 1.0)
            held_s = result["pause_s"] + time.perf_counter() - t_probe
        else:
            self.withdraw(version, f"the sync failed: {result['error']}")
            error = self._roll_back(actors, 1.0) or result["error"]
        return self._outcome(actors, version, decision, error, metrics, (t0, held_s, probe_s))

    def _outcome(
        self, actors: Any, version: int, decision: Decision | None, error: str | None, metrics: dict, times: tuple
    ) -> GateOutcome:
        """The end of a candidate's sync: the samples trained into a rolled-back one are dropped
        (:meth:`_drop_pending`), the step's ``deploy/*`` and ``engine_version/*`` metrics. ``times``:
        ``(start, users held s, probe s)``."""
        t0, held_s, probe_s = times
        rolled_back = decision is None or not decision.promote
        if rolled_back:
            self._drop_pending(actors, version, "withdrawn" if decision is None else "rejected")
        self.pending, self.pending_seqs = [], []
        metrics.update(self.metrics(decision, held_s, probe_s))
        versions = actors.weight_sync.engine_versions()
        metrics.update({f"engine_version/{n}": (-1 if v is None else v) for n, v in versions.items()})
        return GateOutcome(time.perf_counter() - t0, error, metrics, rolled_back)

    def _sync_canary(self, actors: Any, version: int, model_path: str, k: int) -> GateOutcome:
        """:meth:`sync_candidate` with a canary (:mod:`clawray.canary`). Engine ``k`` is reserved (it
        admits no user request; those it runs finish on the promoted weights), the candidate is loaded
        there alone and probed there, while the other engines go on serving every user. A candidate the
        probe passes serves the canary fraction of the sessions on ``k`` until the window's verdict
        (:class:`~clawray.canary.CanaryWindow`; the learners wait); promoted, every engine loads it;
        rejected or withdrawn, the learners return to the promoted version and ``k`` alone loads it
        back. ``k`` serves everyone again at the end. ``deploy/users_held_s``: the promoting sync's
        pause (the probe and the window hold nobody)."""
        from clawray.canary import CanaryWindow
        from clawray.weight_sync import WeightSyncController

        sync, engine, t0 = actors.weight_sync, actors.engines[k], time.perf_counter()
        _set_arm(engine, "reserved")
        result = sync.sync(version, hold=True, only=[k])
        metrics = WeightSyncController.metrics(result, sync.failures)
        decision, verdict, probe_s, held_s = None, None, 0.0, 0.0
        if result["held"]:
            try:
                scores, probe_s = self.probe(model_path, lambda reqs: probe_generate([engine], reqs))
                guards = self.measure_guards(actors.learners)  # the learners hold the candidate too
                prefs = self.compare_replies(version, actors.judges)
                decision = self.assess(scores, guards, prefs)
                if decision.promote:
                    window = CanaryWindow(lambda: _reward_tallies(actors.queue), version, self.promoted, self.cfg)
                    window.open()
                    _set_arm(engine, "canary", self.cfg.canary_fraction)
                    sync.release(only=[k])
                    print(f"[clawray] gate: v{version} passed its probe; canary on {sync.names[k]}", flush=True)
                    verdict = window.wait()
                    decision = verdict.apply(decision)
            except Exception as e:  # noqa: BLE001 - a candidate not judged whole is never served to all
                decision, verdict = None, None
                self.withdraw(version, f"the probe or its canary failed: {type(e).__name__}: {e}")
            if decision is not None:
                extra = {"canary": verdict.record()} if verdict is not None else {}
                self.conclude(version, decision, scores, probe_s, 0, guards, prefs, extra)
        else:
            self.withdraw(version, f"the sync failed: {result['error']}")
        if decision is not None and decision.promote:  # every engine loads it
            full = sync.sync(version)
            error, held_s = full["error"], full["pause_s"]
            actors.learners.keep_promoted()
        else:
            backoff = decision is not None and decision.backoff  # not for a withdrawn or unproven one
            actors.learners.restore_promoted(self.cfg.lr_backoff if backoff else 1.0)
            back = sync.sync(self.promoted, hold=True, only=[k])
            error = self._resume_on_promoted(actors, back, [k]) or (None if result["held"] else result["error"])
        _set_arm(engine, None)
        if verdict is not None:
            metrics.update(verdict.metrics())
        return self._outcome(actors, version, decision, error, metrics, (t0, held_s, probe_s))

    def _roll_back(self, actors: Any, lr_factor: float) -> str | None:
        """Return the learners to the promoted version (weights, AdamW state, schedule; learning rate
        x ``lr_factor``) and sync it to the engines, which resume on it; the sync's error or None."""
        actors.learners.restore_promoted(lr_factor)
        back = actors.weight_sync.sync(self.promoted, hold=True)
        return self._resume_on_promoted(actors, back)

    def _resume_on_promoted(self, actors: Any, back: dict, only: list[int] | None = None) -> str | None:
        """After the sync ``back`` of the promoted version (held, to ``only`` or every engine): resume
        the engines that serve the promoted version; one that does not (it may hold the withdrawn
        candidate) stays paused, its users served by the others, until the next sync loads it. Returns
        the sync's or the resume's error, or None."""
        sync = actors.weight_sync
        if back["held"]:
            errors = sync.release(only)
            return f"resuming the engines on v{self.promoted}: {errors}" if errors else None
        versions = sync.engine_versions()
        indexes = range(len(sync.names)) if only is None else only
        serving = [i for i in indexes if versions.get(sync.names[i]) == self.promoted]
        kept = [sync.names[i] for i in indexes if i not in serving]
        sync.release(serving)
        print(
            f"[clawray] gate: syncing v{self.promoted} back failed ({back['error']}); "
            f"{', '.join(kept) or 'no engine'} stay(s) paused until the next sync loads it",
            flush=True,
        )
        return back["error"]

    def after_learner_rebuild(self, actors: Any, version: int) -> None:
        """A rebuilt learner group restored the last checkpoint (a promoted version): that is the new
        rollback point and promoted version, with its own probe scores (the records' lineage up to it);
        a ``resumed`` record cuts the versions after it from ``versions.jsonl``'s lineage."""
        if self.enabled:
            actors.learners.keep_promoted()
            self.pending, self.pending_seqs = [], []  # the rebuilt learners hold none (the journal replays them)
            if not self._replay(self.records, version):
                self.promoted = version  # no record of it: the last promoted scores stay the reference
            # the versions after it are gone: a later resume must not read their scores as this lineage's
            self._record({"version": version, "decision": "resumed", "best": self.best, "why": "learner rebuild"})

    def resume(self, version: int) -> bool:
        """A resumed run serves checkpoint ``version`` (always a promoted one): restore its probe
        scores, the best promoted version and the baseline's guards from ``run_dir/versions.jsonl``
        (so the resume neither re-probes nor forgets the best reference). Records of versions after
        ``version`` belong to the lineage the resume discards. True when the version's record was
        found (a ``resumed`` record is appended), False else (the caller probes a new baseline)."""
        path = os.path.join(self.run_dir, "versions.jsonl")
        try:  # a record torn by a kill mid-append is left out (said); a damaged file: a new baseline
            records = read_jsonl(path, "gate records", print)
        except (OSError, DamagedFileError):
            return False
        if not self._replay(records, version):
            return False
        self.records = records
        self._record({"version": version, "decision": "resumed", "best": self.best})
        print(
            f"[clawray] gate: resumed at the promoted v{version} (probe mean "
            f"{sum(self.promoted_scores) / len(self.promoted_scores):.3f}; best so far v{self.best})",
            flush=True,
        )
        return True

    def _replay(self, records: list[dict[str, Any]], version: int) -> bool:
        """Set the promoted version to ``version`` with the scores it was promoted with, and the best
        and reference guards of its lineage, by replaying ``records`` in order (a ``resumed`` record
        at v cuts the versions after v). False, changing nothing, when no record promoted ``version``."""
        lineage: list[dict[str, Any]] = []
        for r in records:
            if r.get("decision") == "resumed":
                lineage = [x for x in lineage if x["version"] <= r["version"]]
            elif r.get("decision") in ("baseline", "promoted") and r.get("scores"):
                if r["decision"] == "baseline":
                    lineage = [x for x in lineage if x["version"] < r["version"]]
                lineage.append(r)
        lineage = [x for x in lineage if x["version"] <= version]
        if not lineage or lineage[-1]["version"] != version:
            return False
        base = next((x for x in reversed(lineage) if x["decision"] == "baseline"), None)
        if base is not None and base.get("probe", self.probe_identity()) != self.probe_identity():
            changed = sorted(k for k, v in self.probe_identity().items() if base["probe"].get(k) != v)
            print(
                f"[clawray] gate: the probe changed since v{base['version']}'s baseline ({', '.join(changed)}): "
                f"its scores do not pair with the new probe's, so v{version} is probed as a new baseline",
                flush=True,
            )
            return False
        if base is not None:
            lineage = lineage[lineage.index(base) :]
            self.reference_guards = {k: base[k] for k in ("entropy", "mismatch_kl", "tokens") if k in base} or None
        best = max(lineage, key=lambda x: sum(x["scores"]))
        self.best, self.best_scores = best["version"], [float(x) for x in best["scores"]]
        self.promoted, self.promoted_scores = version, [float(x) for x in lineage[-1]["scores"]]
        self.rejections = 0
        self.comparisons.replies = {
            r["version"]: r["compare_replies"] for r in (best, lineage[-1]) if "compare_replies" in r
        }
        return True

    def settle(self, actors: Any, version: int) -> int | None:
        """Before the exit checkpoint: the learners' version when it is settled, else (an unprobed
        version, ``deploy.every_versions`` > 1) return them to the promoted one and give its version;
        None when that failed (said; then no exit checkpoint: the last one stands).

        ``version`` is the driver's; with the gate on, the learners' own is asked: a step or a probe
        the stop interrupted leaves them holding a candidate past it (the driver's version moves only
        once the step's sync is done), whose weights were checkpointed as the promoted version and
        served as the resume's baseline."""
        if not self.enabled or self.promoted is None:
            return version
        try:
            version = actors.learners.version()
        except Exception as e:  # noqa: BLE001 - the at-exit path must finish
            print(f"[clawray] gate: no exit checkpoint (the learners' version is unknown: {e})", flush=True)
            return None
        if self.settled(version):
            return version
        self.dropped_samples += len(self.pending)  # trained into versions never probed, never served: gone with them
        self.pending, self.pending_seqs = [], []
        try:
            actors.learners.restore_promoted(1.0)
        except Exception as e:  # noqa: BLE001 - the at-exit path must finish
            print(f"[clawray] gate: no exit checkpoint (return to v{self.promoted} failed: {e})", flush=True)
            return None
        return self.promoted

    def _record(self, record: dict[str, Any]) -> None:
        record = {"time": time.time(), **record}
        self.records.append(record)
        try:
            with open_private(os.path.join(self.run_dir, "versions.jsonl"), "a+") as f:
                append_whole(f.fileno(), (json.dumps(record) + "\n").encode())  # never a torn record
        except OSError as e:  # a full disk loses a record line, never the run
            print(f"[clawray] versions.jsonl not updated ({e.strerror or type(e).__name__})", flush=True)


def _reward_tallies(queue: Any) -> dict:
    """The trajectory queue's live reward tallies per policy version (the canary's window)."""
    import ray

    return ray.get(queue.reward_tallies.remote(), timeout=30)


def _set_arm(engine: Any, arm: str | None, fraction: float = 0.0) -> None:
    """:meth:`~clawray.actors.rollout.RolloutEngine.set_arm`; an engine that died says so (a restarted
    one serves everyone: its arm starts at None)."""
    import ray

    try:
        ray.get(engine.set_arm.remote(arm, fraction), timeout=30)
    except Exception as e:  # noqa: BLE001 - the gate's decision stands; recovery restarts the engine
        print(f"[clawray] gate: setting an engine's arm to {arm} failed: {type(e).__name__}", flush=True)


PROBE_TIMEOUT_S = 600.0
"""The longest the probe's generations may take: past it they are cancelled and the probe fails (the
candidate is withdrawn) rather than hold the users' requests for ever."""


def probe_generate(engines: list, requests: list, timeout_s: float = PROBE_TIMEOUT_S) -> list[dict]:
    """The probe's generations, spread over ``engines``; they run while the engines hold the users'
    requests (:meth:`~clawray.actors.rollout.RolloutEngine.generate` ``probe=True``).

    Raises:
        ray.exceptions.GetTimeoutError: not all answered within ``timeout_s`` seconds (those left are cancelled).
    """
    import ray

    refs = [engines[i % len(engines)].generate.remote(r, None, True) for i, r in enumerate(requests)]
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        for ref in refs:
            ray.cancel(ref)
        raise
