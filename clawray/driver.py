"""The Driver: runs the training loop over the actors that :mod:`clawray.build` made from the config.

Loop (one iteration per policy update)::

    wait for a batch (staleness-capped) -> train_step on all learners -> pause rollout engines
    -> broadcast weights (new version) -> resume -> log -> checkpoint every k steps -> next

Serving never stops except for the weight broadcast; requests that arrive during it wait.
``trainer.overlap: false`` makes the loop serial (the baseline of ``bench/loop_throughput.py``): after
taking a batch the driver holds its simulated users and waits for their requests in flight and the
judgements they started, trains, syncs, then releases them (:meth:`~clawray.traffic.SimUsers.hold`), so no
generation overlaps a train step or a sync. ``Driver.timeline`` keeps the wall-clock spans of each
step's train and sync phases.
The policy is evaluated (``eval.*``, :mod:`clawray.evaluation`) before the loop, every
``eval.every_steps`` and after it (a resumed run: once at the resume, unless that policy's
evaluation was written), on rollout engine 0 between steps, so each evaluation sees one policy
version; the run ends by printing each measure before -> after with its 95% CI.

Owns: the order of a step's phases and what is decided between them (guards, skips, versions).
Must not: build actors (:mod:`clawray.build`), write checkpoints or resume (:mod:`clawray.resume`),
judge a failure (:mod:`clawray.recovery`) or read counters (:mod:`clawray.run_stats`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf

from clawray.algos.advantages import batch_advantages
from clawray.algos.algorithm import algorithm_class
from clawray.checkpoint import precision_mismatch
from clawray.closing import closing_lines, eval_change_lines
from clawray.evaluation import RunEvaluations
from clawray.gate import PromotionGate
from clawray.mismatch_probe import MismatchProbe
from clawray.monitor import BehaviourMonitor
from clawray.file_modes import open_private, private_dir
from clawray.batching import sample_groups, take_batch
from clawray.recovery import ActorLost, actor_lost, learner_lost, recovery_for
from clawray.resume import Checkpoints, LoopState
from clawray.run_actors import RunActors
from clawray.run_lock import RunFolderLock, checkpoint_folder_lock
from clawray.run_stats import RunStats
from clawray.serve.instance import APP_NAME, ServeLease
from clawray.traffic import SimUsers
from clawray.step_metrics import Timeline, step_line
from clawray.step_sync import sync_step


class Driver:
    """Owns the actors of one run and runs its loop.

    Args:
        cfg: a config from :func:`clawray.config.load_config`.

    Attributes:
        actors: the run's :class:`~clawray.run_actors.RunActors`.
        state: the loop's :class:`~clawray.resume.LoopState` (policy version, steps, counters).
        checkpoints: the run's :class:`~clawray.resume.Checkpoints`.
        stats: the actors' counters (:class:`~clawray.run_stats.RunStats`).
        history: every step's metrics row.
        eval_results: ``{"when", "step", "policy_version", "metrics", ...}`` of each evaluation.
        timeline: the wall-clock spans of each step's ``train`` and ``sync`` phases.
    """

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.run_dir = os.path.abspath(cfg.run_dir)
        self._run_lock = RunFolderLock(self.run_dir)  # taken in setup, released by shutdown
        self.actors = RunActors()
        self.state = LoopState.from_config(cfg)
        self.checkpoints = Checkpoints(cfg, self.state, self.actors)
        self._checkpoint_lock = checkpoint_folder_lock(self.checkpoints.dir)  # checkpoint.dir may be shared
        self.stats = RunStats(self.actors)
        self.history: list[dict[str, Any]] = []
        self.monitor = BehaviourMonitor(cfg.monitor, cfg.env, self.state.behaviour, cfg.serve.untagged_tool_calls)
        self.probe = MismatchProbe(cfg.monitor)  # inv/logprob_mismatch_kl at every version
        self.evals = RunEvaluations(cfg.eval, cfg.env, self.run_dir, cfg.serve.untagged_tool_calls)
        self.gate = PromotionGate(cfg.deploy, cfg.env, self.run_dir, cfg.serve.untagged_tool_calls, cfg.judge.backend)
        self.eval_results = self.evals.results
        self.model_path = cfg.model.path  # the policy's HF folder; setup resolves it (a build, a conversion)
        self.timeline = Timeline()
        self.base_url = ""
        self.users = SimUsers(cfg)  # env.enabled
        self.premise: Any = None  # OPD's premise, probed before training (clawray.premise)
        self.metrics: Any = None  # the run's MetricsLog (metrics.jsonl, wandb), opened by setup
        self._owns_ray = False
        self.serve = ServeLease(APP_NAME)  # stops all of Serve at shutdown only if this run started it
        self._shut_down = False
        self._ready = False  # setup (and a resume) completed: only then may an exit checkpoint be written
        self._lost: ActorLost | None = None  # the actor whose death ended the loop

    @property
    def version(self) -> int:
        """The learners' policy version."""
        return self.state.version

    @property
    def steps_done(self) -> int:
        """Driver steps, continued across a resume."""
        return self.state.steps_done

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Build the run (:mod:`clawray.build`): the policy folder, the queue, engines, judges,
        teachers, session tracker, learners, the sync group; resume (``resume=true``); start the
        server and the tracking.

        A failure part-way (a learner or engine that does not start, a sync group that does not
        form, a resume or a server that fails) first shuts down everything created so far (actors,
        the learners' placement group, Serve, the sync mailbox; Ray itself when this driver started
        it), then re-raises: nothing stays reserved.
        """
        try:
            self._setup()
        except BaseException:
            self.shutdown()
            raise

    def _setup(self) -> None:
        from clawray import build
        from clawray.metrics_log import MetricsLog
        from clawray.ray_env import init_ray

        cfg, t0 = self.cfg, time.perf_counter()
        self.checkpoints.check_resumable()  # a mistyped run_dir: said before any folder, model or Ray
        private_dir(self.run_dir)  # 0700: records, checkpoints, metrics and wandb files are the user's only
        self._run_lock.acquire()  # one run per folder: before anything in it is read, pruned or replaced
        self._checkpoint_lock.acquire()  # and per checkpoint folder, before it is set aside or pruned
        self.model_path = build.ensure_model(cfg)
        self._owns_ray = not ray.is_initialized()
        init_ray(cfg.ray.address, cfg.ray.num_cpus)
        journals = self.checkpoints.prepare_journals()
        build.build_actors(cfg, self.model_path, journals, self.actors)
        deploy = lambda: build.deploy_server(cfg, self.model_path, self.actors)  # noqa: E731
        if not cfg.resume:  # the server's replicas start while the learners do (a resume serves once restored)
            self.base_url = self.serve.deploy(deploy)
        build.start_learners(cfg, self.model_path, self.actors)
        build.connect_weight_sync(cfg, self.actors)
        print(build.placement_line(self.actors), flush=True)
        if cfg.resume:
            self.checkpoints.restore()
            self.evals.resume(self.steps_done)
            self.base_url = self.serve.deploy(deploy)
        build.await_server(self.base_url, self.actors)
        resume_step = self.state.steps_done if cfg.resume else None
        run_id = self.state.wandb_run_id  # a resumed run continues the checkpoint's wandb run
        config = OmegaConf.to_container(cfg, resolve=True)
        self.metrics = MetricsLog(
            self.run_dir,
            cfg.wandb.mode,
            cfg.wandb.project,
            cfg.wandb.name,
            config,
            resume_step,
            run_id,
            self.state.metrics_row if cfg.resume else None,
        )
        self.state.wandb_run_id = self.metrics.run_id
        self._ready = True
        print(build.ready_line(cfg, self.actors, time.perf_counter() - t0, self.base_url), flush=True)
        warning = precision_mismatch(cfg)  # said loudly: it cost most of the CPU demo's gain
        if warning is not None:
            print(f"[clawray] WARNING {warning}", flush=True)
        fresh = self.state.steps_done == 0 and cfg.trainer.num_steps != 0 and cfg.env.enabled
        if algorithm_class(cfg.trainer.algo).needs_teacher and cfg.opd.premise_check != "none" and fresh:
            self.premise = build.check_premise(cfg, self.model_path, self.actors)
            if self.premise is not None:
                self.metrics.log({**self.premise.metrics(), "policy_version": self.version}, step=self.steps_done)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, when: str) -> dict[str, Any] | None:
        """Evaluate the current policy on the environment's eval split (``eval.*``,
        :class:`~clawray.evaluation.RunEvaluations`) through rollout engine 0, which serves the current
        policy (no extra engine); the driver syncs weights only inside :meth:`step`, so every sample
        comes from one policy version. Logged at the current step; appended to ``self.eval_results``.

        Args:
            when: ``"before"``, ``"step"``, ``"after"`` or ``"resume"``.

        Returns:
            the record, or None when ``eval.enabled`` is false or the evaluation failed (printed).
        """
        if not self.cfg.eval.enabled:
            return None
        served = self.gate.served(self.version)  # with deploy.gate: the promoted version, not the learners'
        return self.evals.run(when, self.steps_done, served, self.model_path, self._engine0_generate, self.metrics.log)

    def _engine0_generate(self, requests: list) -> list[dict]:
        from clawray.console import wait_with_progress

        engine = self.actors.engines[0]
        return wait_with_progress([engine.generate.remote(r) for r in requests], "eval", "sample")

    # ------------------------------------------------------------------ loop
    def step(self) -> dict[str, Any]:
        """Wait for one batch, apply the signal guards, train, sync; returns the step's metrics.

        The phases, each a named call: take a batch (:func:`~clawray.batching.take_batch`) -> advantages
        (:func:`~clawray.algos.advantages.batch_advantages`) -> train (:meth:`_train`) -> sync
        (:func:`~clawray.step_sync.sync_step`) -> advance the policy version -> the metrics row
        (:meth:`~clawray.run_stats.RunStats.step_row`) ->
        checkpoint (:meth:`~clawray.resume.Checkpoints.periodic`) -> log (:meth:`_log_step`).

        A batch is not trained when the degenerate-batch guard says skip (``skipped: degenerate``)
        or when the learners met a non-finite loss or gradient (``skipped: nonfinite``); then no
        weights are synced and the policy version stays.

        Raises:
            TimeoutError: no full batch arrived within ``trainer.batch_timeout_s``.
        """
        st, tr, clock = self.state, self.cfg.trainer, self.timeline
        t0, next_version = time.perf_counter(), st.version + 1
        with clock.phase("wait_batch"):
            batch, refs, metas = take_batch(tr, self.actors, st, next_version, self.stats.lagging)
        rewards = [m.reward for m in metas]
        teacher = [m.teacher for m in metas]  # a Combine turn without an accepted hint: its reward alone
        adv = batch_advantages(rewards, st.guard, tr.advantage, sample_groups(metas, tr.group_by), teacher)
        skipped = "" if adv.train and refs else "degenerate"
        with clock.phase("hold"):
            self.users.hold(self.actors.tracker)  # serial loop only (trainer.overlap: false)
        try:
            with clock.phase("train", keep=True):
                train, skipped = self._train(refs, metas, adv.advantages, next_version, skipped)
            with clock.phase("sync", keep=True):
                synced = sync_step(
                    self.actors,
                    self.gate,
                    self.probe,
                    self.model_path,
                    st.version,
                    next_version,
                    skipped,
                    refs,
                    metas,
                    st.in_flight["seqs"] if st.in_flight else None,
                )
                sync_s, sync_error, sync_metrics = synced.seconds, synced.error, synced.metrics
        finally:
            self.users.release()
        if not skipped:
            # the learner's weights moved on even when the sync failed, unless the gate rolled them back
            st.version = self.gate.promoted if synced.rolled_back else next_version
            st.entropy.update(train["inv/entropy"])
            self.checkpoints.tell_tracker()
        else:
            st.skipped_steps[skipped] = st.skipped_steps.get(skipped, 0) + 1
        st.steps_done += 1
        behaviour = self._monitor_behaviour()
        st.in_flight = None  # the step is complete (trained, or decided against)
        timing = {f"timing/{k}_s": clock.seconds[k] for k in ("wait_batch", "hold", "train")}
        # the row is ready before the checkpoint commits and travels in it: a driver killed right
        # after the commit loses no row of a checkpointed step (the resume writes it back)
        coef = st.entropy_coef(self.cfg.learner.entropy_coef_max)
        metrics, dropped = self.stats.step_row(
            st, batch, metas, adv, skipped, train, {**timing, **sync_metrics}, coef, tr.dynamic_sampling
        )
        metrics["timing/step_s"] = time.perf_counter() - t0
        metrics.update(behaviour, **({"sync_error": sync_error} if sync_error else {}))
        st.metrics_row = self.metrics.row(_logged(metrics), st.steps_done)  # the checkpoint carries it
        # with the gate, only a promoted version is checkpointed: a resume never serves an unprobed one
        metrics["timing/checkpoint_s"] = ckpt_s = self.checkpoints.periodic(self.gate.settled(st.version))
        metrics["timing/step_s"] += ckpt_s
        self._log_step(metrics, dropped, bool(adv.rewarded), train, skipped, sync_s, sync_error)
        self.gate.check_stop()
        return metrics

    def _monitor_behaviour(self) -> dict[str, float]:
        """Every ``monitor.every_steps`` steps: the behaviour-diversity probe on engine 0 (the current
        policy, :class:`~clawray.monitor.BehaviourMonitor`), which feeds the behaviour controller;
        ``{}`` when it is not this step's turn."""
        engines = self.actors.engines
        generate = lambda reqs: ray.get([engines[0].generate.remote(r) for r in reqs])  # noqa: E731
        return self.monitor.maybe_probe(self.steps_done, self.model_path, generate)

    def _train(
        self, refs: list, metas: list, advantages: list[float], next_version: int, skipped: str
    ) -> tuple[dict[str, Any], str]:
        """Train the batch on every learner unless ``skipped``; returns ``(train metrics, skipped)``
        (``"nonfinite"`` or ``"no_gradient"`` when the learners skipped every optimizer step). The journal marks the batch
        consumed by this step; it stays in flight until :meth:`step` completes the step.

        Raises:
            ActorLost: a learner rank died inside the step (:func:`~clawray.recovery.learner_lost`).
        """
        st, train = self.state, {}
        if not skipped:
            coef = st.entropy_coef(self.cfg.learner.entropy_coef_max)
            probe = self.probe.take(st.version)
            try:
                versions = [m.policy_version for m in metas]  # as the queue holds them: re-stamped past a fork
                train = self.actors.learners.train_step(
                    refs,
                    next_version,
                    advantages,
                    coef,
                    probe=probe,
                    probe_wait_s=self.probe.wait_s,
                    versions=versions,
                    lengths=[m.num_tokens for m in metas],  # split the batch over the ranks without its payloads
                )
            except ray.exceptions.RayError as e:
                lost = learner_lost(self.actors, e)
                if lost is None:
                    raise
                raise lost from None
            if probe is not None:
                self.probe.record(train)
            untrained = set(train.pop("untrained_samples", ()))  # a non-finite mini-batch's: not trained
            train = {**train, **self.probe.metrics()}
            if train["skipped"]:  # no optimizer step: a non-finite loss, or no gradient at all
                skipped = "nonfinite" if train.get("nonfinite_mini_batches", 0) > 0 else "no_gradient"
            else:
                st.record_trained([m for i, m in enumerate(metas) if i not in untrained])
                st.in_flight["counted"] = True
                st.in_flight["train"] = train  # an exit checkpoint may hold this update: its row (_log_interrupted)
        # the batch is consumed by this step (a resume from an older checkpoint replays it); it
        # stays in flight until the step is complete (see step)
        seqs, step, queue = st.in_flight["seqs"], st.steps_done + 1, self.actors.queue
        self.checkpoints.mark(lambda: queue.consumed.remote(seqs, step, not skipped), f"step {step}'s batch")
        st.in_flight["marked"] = True  # an exit checkpoint during this step's sync need not mark it again
        return train, skipped

    def _log_step(
        self,
        metrics: dict,
        dropped: dict,
        rewarded: bool,
        train: dict,
        skipped: str,
        sync_s: float,
        sync_error: str | None,
    ) -> None:
        """Append the row to the history, log it (wandb, ``metrics.jsonl``) and print the step's line
        (:func:`~clawray.step_metrics.step_line`)."""
        self.history.append(metrics)
        self.metrics.log(_logged(metrics), step=self.steps_done)
        s = self.timeline.seconds
        args = (metrics, dropped, train, rewarded, skipped, sync_s, sync_error, s["wait_batch"], s["train"])
        print(step_line(self.steps_done, self.cfg.trainer.num_steps, *args), flush=True)

    def run(self) -> dict[str, Any]:
        """``setup`` (if needed), start traffic, run ``trainer.num_steps`` updates (``-1``: until
        interrupted); returns the summary."""
        if not self._ready:
            self.setup()
        t0, tr = time.perf_counter(), self.cfg.trainer  # tr.num_steps may be lowered while it runs (bench/chaos.py)
        self.evaluate("resume" if self.cfg.resume else "before")  # before any traffic: the initial (or resumed) policy
        if tr.num_steps != 0:  # deploy.gate: the served version is the promoted one, probed as the reference
            self.gate.start(self.actors, self.version, self.model_path, resumed=self.cfg.resume)
        self.users.start(self.base_url)
        try:
            while tr.num_steps < 0 or self.steps_done < tr.num_steps:
                self._step_or_recover()
                if self.evals.due(self.steps_done, 0 <= tr.num_steps <= self.steps_done):
                    self.evaluate("step")
        except BaseException as e:  # interrupted (a serving run ends this way): still leave a summary
            self.users.stop()
            self._lost = e if isinstance(e, ActorLost) else actor_lost(self.actors, e)  # a dead actor: one line
            try:
                self.summary(time.perf_counter() - t0)
            except Exception:  # noqa: BLE001 - the interruption is what the user must see
                pass
            if self._lost is not None:
                raise self._lost from None
            raise
        self.users.stop()  # the summary describes the final state: no traffic after it
        self.evaluate("after")
        return self.summary(time.perf_counter() - t0)

    def _step_or_recover(self) -> None:
        """:meth:`step`, surviving a dead actor where :func:`~clawray.recovery.recovery_for` allows:
        a restarted one goes on; a dead learner rank rebuilds the group from the last checkpoint
        (``learner.max_restarts`` times at most).

        Raises:
            ActorLost: an actor died for good, or one that is not restartable died.
        """
        try:
            self.step()
        except Exception as e:
            st = self.state
            plan = recovery_for(self.actors, e, st.learner_restarts < self.cfg.learner.max_restarts)
            if plan is None:
                raise
            if plan.action == "go_on":
                print(f"[clawray] the {plan.lost.role} actor died and was restarted; training goes on", flush=True)
                self.checkpoints.give_back_batch()
                return
            st.learner_restarts += 1
            from clawray.build import learner_group

            self.checkpoints.rebuild_learners(plan.lost, lambda: learner_group(self.cfg, self.model_path))
            self.gate.after_learner_rebuild(self.actors, self.version)
            self.checkpoints.tell_tracker()  # the checkpoint's version: lower than the tracker was told

    def _log_interrupted(self) -> None:
        """After the exit checkpoint: when it holds the update of a step stopped after the learners'
        update and before the step's end (a Ctrl-C during the sync; :meth:`Checkpoints.save
        <clawray.resume.Checkpoints.save>` counts it as step ``steps_done + 1``), that step's row is
        logged (``interrupted``: 1 and its train metrics) and ``summary.json`` gets
        ``interrupted_update`` (its step and version, which the engines never served), so the run
        folder agrees with the checkpoint; the step is said in one line."""
        flight, saved, step = self.state.in_flight, self.checkpoints.last, self.state.steps_done + 1
        if not flight or "train" not in flight or not saved or saved.get("steps_done") != step:
            return
        version = saved["version"]
        train = {k: v for k, v in flight["train"].items() if isinstance(v, (int, float))}
        self.metrics.log({**train, "step": step, "policy_version": version, "interrupted": 1.0}, step=step)
        path = os.path.join(self.run_dir, "summary.json")
        try:
            with open(path) as f:
                summary = json.load(f)
            with open_private(path) as f:
                json.dump({**summary, "interrupted_update": {"step": step, "version": version}}, f, indent=2)
        except (OSError, ValueError):  # no summary to complete: the row and the line say it
            pass
        print(
            f"[clawray] step {step}/{self.cfg.trainer.num_steps}: stopped after its update (policy v{version}, "
            f"{len(flight['metas'])} samples, never served); the exit checkpoint holds it",
            flush=True,
        )

    def summary(self, seconds: float) -> dict[str, Any]:
        """Counters of every component, written to ``run_dir/summary.json``."""
        st = self.state
        out = {
            "policy_version": st.version,
            "steps": st.steps_done,
            "skipped_steps": st.skipped_steps,
            "loop_seconds": round(seconds, 1),
            **self.stats.summary(),
            "journal_waits": self.checkpoints.journal_waits,
            "sim_user": self.users.stats(self.stats.read),
            "samples_trained": st.samples_trained,
            "eval": [{k: v for k, v in r.items() if k != "replies"} for r in self.eval_results],
        }
        with open_private(os.path.join(self.run_dir, "summary.json")) as f:
            json.dump(out, f, indent=2)
        return out

    def close(self) -> None:
        """Stop traffic, write the at-exit checkpoint (``checkpoint.save_at_exit``, only after a
        complete setup, so a failed start or resume never replaces ``latest``; a failure to write it
        is reported, not raised), then :meth:`shutdown`."""
        self.users.stop()
        if self._lost is not None and self._lost.kind == "learner":  # the group cannot save
            print(
                f"[clawray] {self._lost.role} died: no checkpoint at exit; the last checkpoint and the journal "
                "stand (resume=true replays every untrained sample)",
                flush=True,
            )
        elif self._ready:
            settled = self.gate.settle(self.actors, self.state.version)  # never checkpoint an unprobed version
            if settled is not None:
                self.state.version = settled
                self.checkpoints.at_exit()
                self._log_interrupted()
        self.shutdown()

    def shutdown(self) -> None:
        """Stop traffic, the server and every actor; stop Ray if this driver started it. Idempotent
        (a failed :meth:`setup` has already called it). Releases the run folder last."""
        if self._shut_down:
            return
        self._shut_down = True
        try:
            ray_up = ray.is_initialized()  # False when setup failed before Ray started
            if ray_up:
                self.users.stop()
            if self.metrics is not None:  # the wandb run ends; its files become the user's only
                self.metrics.finish()
            if ray_up:
                try:
                    self.serve.release()
                except Exception:  # noqa: BLE001 - the actors must still be released
                    pass
            if ray_up:
                self.actors.kill()
            if ray_up and self._owns_ray:
                ray.shutdown()
        finally:
            self._checkpoint_lock.release()
            self._run_lock.release()  # the folder is free only once nothing of this run writes to it


def _logged(metrics: dict) -> dict:
    """The step row's logged scalars: the row less its ``skipped`` and ``sync_error`` strings."""
    return {k: v for k, v in metrics.items() if k not in ("skipped", "sync_error")}


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run a whole job from a config; always shuts everything down. Returns the summary."""
    driver = Driver(cfg)
    try:
        summary = driver.run()
        print(
            f"[clawray] done: {summary['steps']} updates, policy v{summary['policy_version']}, "
            f"engines at {summary['engine_versions']}, {summary['loop_seconds']}s; run folder {driver.run_dir}",
            flush=True,
        )
    finally:
        driver.close()
        if driver._ready:  # also after Ctrl-C / SIGTERM: where the (at-exit) checkpoint is
            lines = eval_change_lines(driver.eval_results) + closing_lines(cfg, driver.checkpoints.last)
            for line in lines:
                print(f"[clawray] {line}", flush=True)
    return summary
