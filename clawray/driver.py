"""The Driver: builds every actor and the Serve app from the config, then runs the training loop.

Loop (one iteration per policy update)::

    wait for a batch (staleness-capped) -> train_step on all learners -> pause rollout engines
    -> broadcast weights (new version) -> resume -> log -> checkpoint every k steps -> next

Serving never stops except for the weight broadcast; requests that arrive during it wait.
``trainer.overlap: false`` makes the loop serial (the baseline of ``bench/loop_throughput.py``): after
taking a batch the driver holds its simulated users and waits for their requests in flight and the
judgements they started, trains, syncs, then releases them (:meth:`Driver._hold_traffic`), so no
generation overlaps a train step or a sync. ``Driver.timeline`` keeps the wall-clock ``[start, end]``
of each step's train and sync phases.
The policy is evaluated (``eval.*``, :mod:`clawray.evaluation`) before the loop, every
``eval.every_steps`` and after it, on rollout engine 0 between steps, so each evaluation sees one
policy version; the run ends by printing each measure before -> after with its 95% CI.
Checkpoints (``checkpoint.every_steps`` and at exit) hold the learner state and the driver's
counters; the samples and the session state live in the durable journal (:mod:`clawray.journal`):
each step journals the samples it consumed, and ``resume=true`` continues from the latest checkpoint
with the same policy-version numbering and queues every acknowledged sample its weights did not
train again, exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections import Counter, deque
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf

from clawray.algos.advantages import BatchAdvantages, batch_advantages
from clawray.algos.algorithm import algorithm_class
from clawray.algos.invariants import DegenerateBatchGuard, EntropyController
from clawray.checkpoint import (
    commit_checkpoint,
    latest_checkpoint,
    latest_intact_checkpoint,
    new_checkpoint_dirs,
    policy_card,
    precision_mismatch,
    prefix_cache_warning,
    write_manifest,
    write_policy_card,
)
from clawray.private import open_private, private_dir, private_tree
from clawray.run_lock import RunFolderLock
from clawray.config import checkpoint_dir, model_path
from clawray.evaluation import RunEvaluations
from clawray.monitor import BehaviourMonitor
from clawray.step_metrics import GenerationMeter, credit_metrics, drop_counts, judge_metrics, step_line, traffic
from clawray.weight_sync import WeightSyncController


def ensure_model(cfg: DictConfig) -> str:
    """The policy folder, built first when it is missing and ``model.build`` says how.

    Raises:
        FileNotFoundError: the folder does not exist and ``model.build`` is none.
    """
    path = model_path(cfg)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if cfg.model.build == "none":
        raise FileNotFoundError(f"model.path {path} is not an HF folder (no config.json) and model.build is none")
    from clawray import models

    print(f"[clawray] building model '{cfg.model.build}' into {path}", flush=True)
    build = {
        "tiny": models.build_tiny_model,
        "smollm2": models.convert_smollm2,
        "qwen2.5-coder-0.5b": models.convert_qwen_coder_05b,
        "qwen2.5-coder-1.5b": models.convert_qwen_coder_15b,
    }[cfg.model.build]
    build(path)
    return path


def sample_groups(metas: list, group_by: str) -> list:
    """The group key of each sample (:class:`~clawray.types.SampleMeta`) under ``trainer.group_by``
    (:func:`clawray.algos.rejection.group_keys`)."""
    from clawray.algos.rejection import group_keys

    return group_keys(
        group_by, [m.prompt_key for m in metas], [m.opening_key for m in metas], [m.turn_index for m in metas]
    )


class Driver:
    """Owns the actors of one run.

    Args:
        cfg: a config from :func:`clawray.config.load_config`.
    """

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.run_dir = os.path.abspath(cfg.run_dir)
        self._run_lock = RunFolderLock(self.run_dir)  # taken in setup, released by shutdown
        self.version = 0
        self.history: list[dict[str, Any]] = []
        self._owns_ray = False
        self._serve_started = False  # only a driver that started Serve shuts it down
        self.journal_waits = 0  # sample-journal marks that waited for the disk (ENOSPC)
        self.guard = DegenerateBatchGuard(cfg.trainer.degenerate_batches, cfg.trainer.baseline_momentum)
        self.entropy = EntropyController(
            cfg.learner.entropy_coef,
            cfg.learner.entropy_floor,
            cfg.learner.entropy_coef_lr,
            cfg.learner.entropy_coef_max,
        )
        # learner.behaviour_floor: the same controller, fed inv/behaviour_entropy; its coefficient
        # adds to the entropy bonus (the sum capped at entropy_coef_max)
        self.behaviour = EntropyController(
            0.0, cfg.learner.behaviour_floor, cfg.learner.entropy_coef_lr, cfg.learner.entropy_coef_max
        )
        self.monitor = BehaviourMonitor(
            cfg.monitor, cfg.env, self.behaviour, cfg.serve.untagged_tool_calls
        )  # every monitor.every_steps
        self.model_path = cfg.model.path  # the policy's HF folder; setup resolves it (a build, a conversion)
        self.all_masked_dropped = 0
        self.zero_variance_dropped = 0  # samples rejected by dynamic sampling (trainer.dynamic_sampling)
        self.samples_trained = 0  # samples that reached an optimizer step (all-masked and skipped ones not)
        self.evals = RunEvaluations(
            cfg.eval, cfg.env, self.run_dir, cfg.serve.untagged_tool_calls
        )  # before, every eval.every_steps, after
        self.eval_results = self.evals.results  # {"when", "step", "policy_version", "metrics", ...} each
        self.skipped_steps: dict[str, int] = {}
        self.checkpoint_failures = 0  # periodic checkpoints the disk refused (the run goes on)
        self.stats_timeouts: dict[str, int] = {}  # counter reads that missed STATS_TIMEOUT_S, by component
        self._last_counters: dict[str, Any] = {}  # the last answer of each component's counters
        self.steps_done = 0  # driver steps, continued across a resume
        self.checkpoint_dir = checkpoint_dir(cfg)
        # the batch taken from the queue and not yet trained: requeued by a checkpoint at exit
        self._in_flight: dict | None = None
        # (session_id, turn_index) of the most recently trained samples, for audits of "trained once"
        self.trained_samples: deque[tuple[str, int]] = deque(maxlen=1 << 16)
        self._shut_down = False
        self._ready = False  # setup (and a resume) completed: only then may an exit checkpoint be written
        self.generation = GenerationMeter()  # rollout tokens and throughput between steps
        from clawray.recovery import RestartCounters

        self.counters = RestartCounters()  # engine, judge and teacher counters survive their restarts
        self._wandb_run_id: str | None = None  # a resumed run continues the checkpoint's wandb run
        self.learner_restarts = 0  # learner-group rebuilds so far (learner.max_restarts, clawray.recovery)
        self._trained_since_ckpt = 0  # entries of trained_samples after the last checkpoint (a rebuild drops them)
        # (phase, start, end): wall-clock seconds (time.time()) of each step's "train" and "sync"
        self.timeline: deque[tuple[str, float, float]] = deque(maxlen=4096)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Create queue, engines, judges, session tracker, learners, the sync group and the server.

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
        from clawray.actors.judge import JudgeWorkerActor
        from clawray.actors.queue import TrajectoryQueueActor
        from clawray.actors.rollout import RolloutEngineActor
        from clawray.actors.session import SessionTrackerActor
        from clawray.actors.teacher import TeacherWorkerActor, check_same_tokenizer
        from clawray.ray_env import init_ray
        from clawray.recovery import RESTART, RESTART_RETRY, engine_options
        from clawray.serve.app import start_policy_server
        from clawray.tracking import Tracker

        cfg = self.cfg
        t0 = time.perf_counter()
        private_dir(self.run_dir)  # 0700: records, checkpoints, metrics and wandb files are the user's only
        self._run_lock.acquire()  # one run per folder: before anything in it is read, pruned or replaced
        path = ensure_model(cfg)
        self.model_path = path
        self._owns_ray = not ray.is_initialized()
        init_ray(cfg.ray.address, cfg.ray.num_cpus)

        journals = self._prepare_journals()  # [journal hook]
        self.queue = TrajectoryQueueActor.options(num_cpus=0, **RESTART_RETRY).remote(
            cfg.queue.max_staleness, cfg.learner.max_tokens_per_micro_batch, journal=journals["samples"]
        )
        ro = cfg.rollout
        engine_kwargs = self._engine_kwargs(ro.backend)
        self.engines = [
            RolloutEngineActor.options(
                num_cpus=ro.num_cpus,
                num_gpus=ro.num_gpus,
                resources=dict(ro.resources) or None,
                **engine_options(ro.max_restarts),
            ).remote(  # [recovery hook]
                ro.backend,
                path,
                f"rollout-{i}",
                ro.torch_threads,
                ro.max_batch_size,
                engine_kwargs,
                resync_on_restart=True,
            )
            for i in range(ro.num_engines)
        ]
        # every actor is stored on self as soon as it exists, so that shutdown() finds it after a failure
        self.judge_engine = self.teacher_engine = judge_engine = None
        if cfg.judge.backend == "engine":  # a frozen copy of the initial policy, never synced
            self.judge_engine = judge_engine = RolloutEngineActor.options(num_cpus=ro.num_cpus, **RESTART_RETRY).remote(
                cfg.judge.engine_backend,
                path,
                "judge-engine",
                ro.torch_threads,
                ro.max_batch_size,
                self._engine_kwargs(cfg.judge.engine_backend),
            )
        self.judges = [
            JudgeWorkerActor.options(num_cpus=cfg.judge.num_cpus, **RESTART_RETRY).remote(
                OmegaConf.to_object(cfg.judge), judge_engine, path
            )
            for _ in range(cfg.judge.num_workers)
        ]
        # OPD / Combine: a frozen teacher (the initial policy) on its own engine; it shares the judge's
        # engine when that one is the same frozen model on the same backend
        teacher_engine, self.teachers = None, []
        algorithm = algorithm_class(cfg.trainer.algo)  # what the algorithm needs: a teacher or not
        if algorithm.needs_teacher and cfg.opd.teacher.startswith(("http://", "https://")):
            endpoint = {"base_url": cfg.opd.teacher, "model": cfg.opd.teacher_model, "api_key": cfg.opd.teacher_api_key}
            teacher = TeacherWorkerActor.options(num_cpus=0, **RESTART_RETRY).remote(
                None, path, cfg.opd.hint_template, endpoint, cfg.opd.hint_placement, cfg.opd.teacher_timeout_s
            )
            self.teachers = [teacher]
            ray.get(teacher.check_endpoint.remote(path))  # the same tokenizer, or an error naming the difference
        elif algorithm.needs_teacher:
            teacher_path = path
            if cfg.opd.teacher == "live":
                teacher_engine = self.engines[0]
            elif cfg.opd.teacher != "frozen":
                teacher_path = os.path.abspath(os.path.expanduser(cfg.opd.teacher))
                check_same_tokenizer(path, teacher_path)
            elif judge_engine is not None and cfg.judge.engine_backend == cfg.opd.teacher_backend:
                teacher_engine = judge_engine
            if teacher_engine is None:
                teacher_engine = RolloutEngineActor.options(num_cpus=ro.num_cpus, **RESTART_RETRY).remote(
                    cfg.opd.teacher_backend,
                    teacher_path,
                    "teacher-engine",
                    ro.torch_threads,
                    ro.max_batch_size,
                    self._engine_kwargs(cfg.opd.teacher_backend),
                )
            self.teacher_engine = teacher_engine
            self.teachers = [
                TeacherWorkerActor.options(num_cpus=0, **RESTART_RETRY).remote(
                    teacher_engine, path, cfg.opd.hint_template, None, cfg.opd.hint_placement, cfg.opd.teacher_timeout_s
                )
            ]
        self.tracker = SessionTrackerActor.options(num_cpus=0, **RESTART).remote(
            self.judges,
            self.queue,
            algo=cfg.trainer.algo,
            teachers=self.teachers,
            idle_timeout_s=cfg.session.idle_timeout_s,
            truncated=cfg.session.truncated,
            opd={
                "accept": cfg.opd.accept,
                "min_hint_chars": cfg.opd.min_hint_chars,
                "topk": cfg.opd.topk if cfg.opd.loss == "topk" else 0,
                "teacher_timeout_s": cfg.opd.teacher_timeout_s,
            },
            records_dir=os.path.join(self.run_dir, "records") if cfg.records.enabled else None,
            records_max_bytes=int(cfg.records.max_mb * 2**20),
            records_keep=cfg.records.keep_files,
            journal=journals["sessions"],
            credit={
                "mode": cfg.trainer.credit,
                "gamma": cfg.trainer.gamma,
                "outcome_turn_weight": cfg.trainer.outcome_turn_weight,
                "max_staleness": cfg.queue.max_staleness,
                "outcome_judge": cfg.trainer.outcome_judge,
            },
            shaping=OmegaConf.to_container(cfg.trainer.shaping),
        )
        self.learners = self._learner_group()
        aux = [e for e in dict.fromkeys([judge_engine, teacher_engine]) if e is not None and e not in self.engines]
        from clawray.console import wait_with_progress

        print(
            f"[clawray] starting {len(self.engines) + len(aux)} engine(s) ({ro.backend}) and "
            f"{cfg.learner.num_workers} learner(s)",
            flush=True,
        )
        ready = wait_with_progress([e.ready.remote() for e in self.engines + aux], "engines ready", "engine")

        plan = ray.get(self.engines[0].weight_specs.remote())
        self.weight_sync = WeightSyncController(
            self.learners.workers,
            self.engines,
            [f"rollout-{i}" for i in range(len(self.engines))],
            plan,
            transport=cfg.sync.transport,
            bucket_bytes=cfg.sync.bucket_mb << 20,
            timeout_s=cfg.sync.timeout_s,
            mode=cfg.sync.mode,
        )
        self.weight_sync.connect(check_plan=True)
        print(self._placement_line(), flush=True)
        if cfg.resume:
            self._restore_checkpoint()

        actors = {
            "judges": self.judges,
            "teachers": self.teachers,
            "learners": self.learners.workers,
            "queue": self.queue,
        }  # [recovery hook] their states in /health
        self._serve_started = True
        self.base_url = start_policy_server(
            path, self.engines, self.tracker, OmegaConf.to_object(cfg.serve), ro.max_model_len, actors
        )
        self.tracking = Tracker(
            self.run_dir,
            cfg.wandb.mode,
            cfg.wandb.project,
            cfg.wandb.name,
            OmegaConf.to_container(cfg, resolve=True),
            resume_step=self.steps_done if cfg.resume else None,
            run_id=self._wandb_run_id,
        )
        self.sim = None
        extra = (
            f" + {len(ready) - len(self.engines)} frozen judge/teacher engine(s)"
            if len(ready) > len(self.engines)
            else ""
        )
        self._ready = True
        print(
            f"[clawray] ready in {time.perf_counter() - t0:.1f}s: {len(self.engines)} engine(s) ({ro.backend}){extra}, "
            f"{cfg.learner.num_workers} learner(s), judge={cfg.judge.backend}, serving {self.base_url}",
            flush=True,
        )
        # said loudly: each cost most of the CPU demo's gain
        for warning in (precision_mismatch(cfg), prefix_cache_warning(cfg) if cfg.trainer.num_steps != 0 else None):
            if warning is not None:
                print(f"[clawray] WARNING {warning}", flush=True)
        self.premise = None  # OPD's premise, probed before training (clawray.premise)
        fresh = self.steps_done == 0 and cfg.trainer.num_steps != 0 and cfg.env.enabled
        if algorithm.needs_teacher and cfg.opd.premise_check != "none" and fresh:
            self._check_premise()

    def _check_premise(self) -> None:
        """Probe whether the teacher does better at the user's check with the user's hint than
        without (:func:`clawray.premise.probe_actors`) and say it; a probe that fails is said and the
        run goes on.

        Raises:
            PremiseRefused: the premise is not shown and ``opd.premise_check`` is ``refuse``.
        """
        from clawray.premise import PremiseRefused, premise_action, probe_actors, teacher_name

        cfg = self.cfg
        # the teacher's own replies: a frozen or live teacher is the initial policy before step 1, which
        # rollout engine 0 samples fastest; a path teacher has its own engine; an endpoint only scores
        sampler = self.engines[0] if cfg.opd.teacher in ("frozen", "live") else self.teacher_engine
        try:
            self.premise = probe_actors(
                cfg, self.model_path, self.engines[0], self.judges[0], self.teachers[0], sampler
            )
        except Exception as e:  # the probe is advice: it never ends a run by failing
            print(f"[clawray] OPD premise check failed: {type(e).__name__}: {e}", flush=True)
            return
        level, text = premise_action(
            self.premise, cfg.opd.premise_check, teacher_name(cfg.opd.teacher, self.model_path)
        )
        if level == "refuse":
            raise PremiseRefused(text)
        print(f"[clawray] {'WARNING ' if level == 'warn' else ''}{text}", flush=True)
        self.tracking.log({**self.premise.metrics(), "policy_version": self.version}, step=self.steps_done)

    def _learner_group(self):
        """A new :class:`~clawray.actors.learner.LearnerGroup` on the initial policy (its own
        placement group; rank 0 picks the FSDP rendezvous port on its own node)."""
        from clawray.actors.learner import LearnerGroup

        cfg = self.cfg
        w_rl, w_opd = algorithm_class(cfg.trainer.algo).loss_weights(cfg.opd.w_rl, cfg.opd.w_opd)
        return LearnerGroup(
            self.model_path,
            OmegaConf.to_object(cfg.learner),
            loss_weights={"w_rl": w_rl, "w_opd": w_opd, "opd_adv_clip": cfg.opd.adv_clip},
        )

    def rebuild_learners(self) -> None:
        """[recovery hook] Replace the learner group after a rank died (:func:`clawray.recovery.rebuild_learners`
        decides when): kill the old group, have the queue re-queue from its journal every sample the
        latest checkpoint did not train (the batch in flight, and batches of later steps), start a
        new group, restore the checkpoint into it and the driver, and re-sync its weights to the
        engines through a rebuilt sync group. The samples trained after the checkpoint leave
        ``trained_samples`` (they will be trained again, once).

        Raises:
            FileNotFoundError: no resumable checkpoint.
            RuntimeError: the new group did not start, or the re-sync failed.
        """
        steps = self._checkpoint_steps()
        self.learners.shutdown()
        # the in-flight batch and later steps' samples are queued again
        self._journal_mark(lambda: self.queue.rewind.remote(steps), "the learners' rewind")
        self._in_flight = None
        for _ in range(min(self._trained_since_ckpt, len(self.trained_samples))):
            self.trained_samples.pop()
        self._trained_since_ckpt = 0
        self.learners = self._learner_group()
        self._restore_checkpoint(senders=self.learners.workers)
        try:  # /health reports the new ranks
            from ray import serve

            # every replica answers /health: each gets the new list
            serve.get_app_handle("clawray").broadcast("set_actors", "learners", self.learners.workers).results(
                timeout_s=30
            )
        except Exception as e:  # noqa: BLE001 - /health then shows the old ranks as dead: degraded, not wrong
            print(f"[clawray] /health keeps the old learner list ({type(e).__name__})", flush=True)

    def _checkpoint_steps(self) -> int:
        """``steps_done`` of the latest checkpoint.

        Raises:
            FileNotFoundError: no committed checkpoint in ``checkpoint.dir``.
        """
        path = latest_intact_checkpoint(self.checkpoint_dir)
        if path is None:
            raise FileNotFoundError(f"no checkpoint in {self.checkpoint_dir}")
        with open(os.path.join(path, "driver.json")) as f:
            return json.load(f)["steps_done"]

    def _placement_line(self) -> str:
        """One line saying where the learners and engines run (Ray node addresses), the learner
        group's and the sync group's rendezvous (bound on learner rank 0's node) and the transport."""
        from clawray.placement import actor_node_ips

        ips = actor_node_ips(
            {
                **{f"learner-{i}": w for i, w in enumerate(self.learners.workers)},
                **{f"rollout-{i}": e for i, e in enumerate(self.engines)},
            }
        )

        def hosts(prefix: str) -> str:
            return ", ".join(
                f"{ip} x{n}" for ip, n in Counter(v for k, v in ips.items() if k.startswith(prefix)).items()
            )

        host, port = self.learners.rendezvous
        sync = self.weight_sync.transport + (
            f" at {self.weight_sync.rendezvous[0]}:{self.weight_sync.rendezvous[1]}"
            if self.weight_sync.rendezvous
            else ""
        )
        return (
            f"[clawray] placement: learners on {hosts('learner-')} (rendezvous {host}:{port}), engines on "
            f"{hosts('rollout-')}; weight sync {sync}"
        )

    def _prepare_journals(self) -> dict[str, dict]:
        """[journal hook] Ready the run's journals (:func:`clawray.journal.prepare_journals`): a fresh
        run starts them empty; a resume voids the samples consumed after the checkpoint it resumes.
        Returns the queue's and the tracker's ``journal`` arguments."""
        from clawray.journal import prepare_journals

        from clawray.journal import SAMPLES_FILE, journal_dir

        resume_step = None
        self._resume_from_start = False
        if self.cfg.resume:
            # verified (manifest sizes and CRC-32s); a damaged newest one falls back to an older one, said
            path = self._resume_checkpoint = latest_intact_checkpoint(self.checkpoint_dir)
            if path is not None:
                with open(os.path.join(path, "driver.json")) as f:
                    resume_step = json.load(f)["steps_done"]
                if path != latest_checkpoint(self.checkpoint_dir):
                    print(
                        f"[clawray] resume from step {resume_step}: the samples trained after it are queued "
                        "again (the journal keeps them until a newer checkpoint is not the only one kept)",
                        flush=True,
                    )
            elif os.path.exists(os.path.join(journal_dir(self.run_dir), SAMPLES_FILE)):
                # died before its first checkpoint: the initial policy trains every journaled sample again
                resume_step, self._resume_from_start = 0, True
            else:
                raise FileNotFoundError(
                    f"resume=true but there is no checkpoint in {self.checkpoint_dir} "
                    f"and no journal in {journal_dir(self.run_dir)}"
                )
        paths = prepare_journals(self.run_dir, resume_step, report=lambda line: print(line, flush=True))
        opts = {"fsync": self.cfg.queue.journal_fsync, "compact_bytes": int(self.cfg.queue.journal_compact_mb * 2**20)}
        return {kind: {"path": p, **opts} for kind, p in paths.items()}

    def _engine_kwargs(self, backend: str) -> dict:
        from clawray.engines import backend_kwargs

        return backend_kwargs(self.cfg.rollout, backend, self.cfg.seed)

    def stop_traffic(self) -> None:
        """Stop the simulated users (waits up to 30 s for their sessions to end)."""
        if getattr(self, "sim", None) is not None:
            try:
                ray.get(self.sim.stop.remote(), timeout=30)
                self.sim_stats = ray.get(self.sim.get_stats.remote(), timeout=30)
            except Exception:
                pass
            self.sim = None

    def start_traffic(self) -> None:
        """Start the simulated users (``env.enabled``)."""
        from clawray.envs.sim_user import SimUserPoolActor

        if not self.cfg.env.enabled:
            return
        self.sim = SimUserPoolActor.options(num_cpus=0).remote(
            self.base_url, OmegaConf.to_object(self.cfg.env), self.cfg.serve.model_name
        )
        ray.get(self.sim.start.remote())

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, when: str) -> dict[str, Any] | None:
        """Evaluate the current policy on the environment's eval split (``eval.*``,
        :class:`~clawray.evaluation.RunEvaluations`) through rollout engine 0, which serves the current
        policy (no extra engine); the driver syncs weights only inside :meth:`step`, so every sample
        comes from one policy version. Logged at the current step; appended to ``self.eval_results``.

        Args:
            when: ``"before"``, ``"step"`` or ``"after"``.

        Returns:
            the record, or None when ``eval.enabled`` is false or the evaluation failed (printed).
        """
        if not self.cfg.eval.enabled:
            return None
        generate, log = self._engine0_generate, self.tracking.log
        return self.evals.run(when, self.steps_done, self.version, self.model_path, generate, log)

    def _engine0_generate(self, requests: list) -> list[dict]:
        from clawray.console import wait_with_progress

        return wait_with_progress([self.engines[0].generate.remote(r) for r in requests], "eval", "sample")

    # ------------------------------------------------------------------ loop
    def step(self) -> dict[str, Any]:
        """Wait for one batch, apply the signal guards, train, sync; returns the step's metrics.

        The phases, each a named call: take a batch (:meth:`_take_batch`) -> advantages
        (:func:`~clawray.algos.advantages.batch_advantages`) -> train (:meth:`_train`) -> sync
        (:meth:`_sync`) -> advance the policy version -> the metrics row (:meth:`_step_metrics`) ->
        checkpoint (:meth:`_periodic_checkpoint`) -> log (:meth:`_log_step`).

        A batch is not trained when the degenerate-batch guard says skip (``skipped: degenerate``)
        or when the learners met a non-finite loss or gradient (``skipped: nonfinite``); then no
        weights are synced and the policy version stays.

        Raises:
            TimeoutError: no full batch arrived within ``trainer.batch_timeout_s``.
        """
        t0 = time.perf_counter()
        next_version = self.version + 1
        batch, refs, metas = self._take_batch(next_version)
        t_wait = time.perf_counter() - t0
        adv = batch_advantages(
            [m.reward for m in metas],
            self.guard,
            self.cfg.trainer.advantage,
            sample_groups(metas, self.cfg.trainer.group_by),
        )
        skipped = "" if adv.train and refs else "degenerate"
        hold_s = self._hold_traffic()  # serial loop only (trainer.overlap: false)
        try:
            t1, w1 = time.perf_counter(), time.time()
            train, skipped = self._train(refs, metas, adv.advantages, next_version, skipped)
            t_train, w2 = time.perf_counter() - t1, time.time()
            sync_s, sync_error, sync_metrics = self._sync(next_version, skipped)
            self.timeline.extend([("train", w1, w2), ("sync", w2, time.time())])
        finally:
            self._release_traffic()
        if not skipped:
            self.version = next_version  # the learner's weights moved on even when the sync failed
            self.entropy.update(train["inv/entropy"])
        else:
            self.skipped_steps[skipped] = self.skipped_steps.get(skipped, 0) + 1
        self.steps_done += 1
        behaviour = self._monitor_behaviour()
        self._in_flight = None  # the step is complete (trained, or decided against)
        timing = {"timing/wait_batch_s": t_wait, "timing/hold_s": hold_s, "timing/train_s": t_train, **sync_metrics}
        # the row is ready before the checkpoint commits, so a driver killed right after the commit
        # loses no row of a checkpointed step (the serve/queue/tracker stats calls take a while)
        metrics, dropped = self._step_metrics(batch, metas, adv, skipped, train, timing, t0)
        ckpt_s = self._periodic_checkpoint()
        metrics["timing/checkpoint_s"] = ckpt_s
        metrics["timing/step_s"] += ckpt_s
        metrics.update(behaviour)
        if sync_error:
            metrics["sync_error"] = sync_error
        self._log_step(metrics, dropped, adv, train, skipped, sync_s, sync_error, t_wait, t_train)
        return metrics

    def _hold_traffic(self) -> float:
        """Serial loop (``trainer.overlap: false``): hold the simulated users and wait until their
        requests in flight are answered and the tracker's judgements are done; returns the seconds
        this took (0.0 in the asynchronous loop, or without simulated users)."""
        if self.cfg.trainer.overlap or getattr(self, "sim", None) is None:
            return 0.0
        t0 = time.perf_counter()
        timeout = self.cfg.env.request_timeout_s
        left = ray.get(self.sim.hold.remote(timeout))
        if left:
            print(f"[clawray] serial loop: {left} request(s) still in flight after {timeout:.0f}s", flush=True)
        ray.get(self.tracker.drain.remote(timeout))
        return time.perf_counter() - t0

    def _release_traffic(self) -> None:
        """Let the simulated users held by :meth:`_hold_traffic` go on (a no-op in the asynchronous loop)."""
        if not self.cfg.trainer.overlap and getattr(self, "sim", None) is not None:
            ray.get(self.sim.release.remote())

    def _take_batch(self, next_version: int) -> tuple[dict, list, list]:
        """The next batch from the queue (``trainer.batch_size`` .. ``max_batch_size`` samples), without
        its all-masked samples (they only cost compute; counted): ``(batch, refs, metas)``, the kept
        samples' object refs and :class:`~clawray.types.SampleMeta`. The driver never fetches a sample
        (only the learners do). The batch is in flight (requeued by a checkpoint) until :meth:`_train`
        has decided on it.

        Raises:
            TimeoutError: no full batch arrived within ``trainer.batch_timeout_s``.
        """
        cfg = self.cfg
        timeout = cfg.trainer.batch_timeout_s or None  # 0 waits for as long as it takes
        from clawray.recovery import wait_batch  # [recovery hook] a dead actor ends the wait with one line

        batch = wait_batch(
            self,
            cfg.trainer.batch_size,
            next_version,
            timeout,
            cfg.trainer.max_batch_size,
            desc=f"step {self.steps_done + 1}/{cfg.trainer.num_steps}: samples",
            why=self.lagging,
        )
        if batch is None:
            raise TimeoutError(
                f"no batch of {cfg.trainer.batch_size} samples within {cfg.trainer.batch_timeout_s}s "
                f"(queue: {ray.get(self.queue.stats.remote())}, "
                f"sessions: {ray.get(self.tracker.stats.remote())})"
            )
        self._in_flight = {"next_version": next_version, "metas": batch["meta"], "seqs": batch["seqs"]}
        rejected: set[int] = set()
        if cfg.trainer.dynamic_sampling:
            batch, rejected = self._fill_dynamic(batch, next_version)
            self._in_flight.update(metas=batch["meta"], seqs=batch["seqs"])
        keep = [i for i, m in enumerate(batch["meta"]) if m.trainable_tokens > 0 and i not in rejected]
        self.all_masked_dropped += sum(
            1 for i, m in enumerate(batch["meta"]) if m.trainable_tokens == 0 and i not in rejected
        )
        refs = [batch["refs"][i] for i in keep]
        metas = [batch["meta"][i] for i in keep]
        self._in_flight = {"next_version": next_version, "metas": metas, "seqs": batch["seqs"]}
        return batch, refs, metas

    def entropy_coef(self) -> float:
        """The entropy-bonus coefficient of the next update: the entropy controller's plus the
        behaviour controller's (``learner.behaviour_floor``), at most ``learner.entropy_coef_max``
        when the behaviour floor is on."""
        if self.behaviour.floor <= 0:
            return self.entropy.coef
        return min(self.entropy.coef + self.behaviour.coef, self.cfg.learner.entropy_coef_max)

    def _monitor_behaviour(self) -> dict[str, float]:
        """Every ``monitor.every_steps`` steps: the behaviour-diversity probe on engine 0 (the current
        policy, :class:`~clawray.monitor.BehaviourMonitor`), which feeds the behaviour controller;
        ``{}`` when it is not this step's turn."""
        generate = lambda reqs: ray.get([self.engines[0].generate.remote(r) for r in reqs])  # noqa: E731
        return self.monitor.maybe_probe(self.steps_done, self.model_path, generate)

    def _fill_dynamic(self, batch: dict, next_version: int) -> tuple[dict, set[int]]:
        """DAPO dynamic sampling (:mod:`clawray.algos.rejection`): while fewer than
        ``trainer.batch_size`` samples lie in groups with reward variance, take more from the queue
        (at least one sample at a time, up to ``max_batch_size`` each), for at most
        ``trainer.dynamic_sampling_wait_s`` seconds; returns ``(merged batch, indexes of the rejected
        zero-variance samples)``, decided on the samples' metadata, counted as ``dropped/zero_variance``. Every taken sample
        stays in the batch's journal marks (consumed by this step, rejected or trained)."""
        from clawray.algos.rejection import zero_variance
        from clawray.recovery import wait_batch

        tr = self.cfg.trainer
        deadline = time.monotonic() + tr.dynamic_sampling_wait_s
        while True:
            metas = batch["meta"]
            rejected = set(zero_variance(sample_groups(metas, tr.group_by), [m.reward for m in metas]))
            remaining = deadline - time.monotonic()
            if len(metas) - len(rejected) >= tr.batch_size or remaining <= 0:
                break
            more = wait_batch(self, 1, next_version, remaining, tr.max_batch_size)
            if more is None:
                continue
            batch = {k: batch[k] + more[k] for k in ("refs", "meta", "versions", "staleness", "seqs")}
        self.zero_variance_dropped += len(rejected)
        return batch, rejected

    def _train(
        self, refs: list, metas: list, advantages: list[float], next_version: int, skipped: str
    ) -> tuple[dict[str, Any], str]:
        """Train the batch on every learner unless ``skipped``; returns ``(train metrics, skipped)``
        (``"nonfinite"`` or ``"no_gradient"`` when the learners skipped every optimizer step). The journal marks the batch
        consumed by this step; it stays in flight until :meth:`step` completes the step."""
        train: dict[str, Any] = {}
        if not skipped:
            try:
                train = self.learners.train_step(refs, next_version, advantages, self.entropy_coef())
            except ray.exceptions.RayError as e:  # [recovery hook] a rank died inside the step: name it
                from clawray.recovery import learner_lost

                lost = learner_lost(self, e)
                if lost is None:
                    raise
                raise lost from None
            if train["skipped"]:  # no optimizer step: a non-finite loss, or no gradient at all
                skipped = "no_gradient" if train.get("no_gradient_mini_batches", 0) > 0 else "nonfinite"
            else:
                self.trained_samples.extend((m.session_id, m.turn_index) for m in metas)
                self._trained_since_ckpt += len(metas)
                self.samples_trained += len(metas)
                self._in_flight["counted"] = True
        # [journal hook] the batch is consumed by this step (a resume from an older checkpoint replays it);
        # it stays in flight until the step is complete (see step)
        seqs, step = self._in_flight["seqs"], self.steps_done + 1
        self._journal_mark(lambda: self.queue.consumed.remote(seqs, step, not skipped), f"step {step}'s batch")
        self._in_flight["marked"] = True  # an exit checkpoint during this step's sync need not mark it again
        return train, skipped

    def _sync(self, next_version: int, skipped: str) -> tuple[float, str | None, dict[str, float]]:
        """Broadcast the weights after a trained step (or a skipped one while an engine is behind);
        returns ``(seconds, error or None, sync metrics)``.

        Sync time = the whole sync (a group rebuild included); ``sync/pause_s`` = pause -> resume of
        the engines: gather, broadcast and load, plus, with ``sync.mode: drain``, the engines
        finishing the generations already running (``interrupt`` stops them at their current token
        and continues them after the load instead). A failed sync
        never stops training: the engines are resumed on their old version, and the next sync (even on
        a skipped step) rebuilds the group and sends the newest weights.
        """
        sync_s, sync_error = 0.0, None
        sync_metrics = {
            "timing/weight_sync_s": 0.0,
            "sync/bytes": 0.0,
            "sync/gbytes_per_s": 0.0,
            "sync/gather_s": 0.0,
            "sync/send_s": 0.0,
            "sync/load_s_max": 0.0,
            "sync/pause_s": 0.0,
            "sync/interrupted_requests": 0.0,
        }
        from clawray.recovery import restarted_engines

        restarted = restarted_engines(self)  # [recovery hook] they rejoin a rebuilt group
        if not skipped or self.weight_sync.behind or restarted:
            version = next_version if not skipped else self.version
            result = self.weight_sync.resync(version) if restarted else self.weight_sync.sync(version)
            sync_s = result["seconds"]
            sync_metrics.update(WeightSyncController.metrics(result, self.weight_sync.failures))
            if not result["ok"]:
                sync_error = result["error"]
                print(
                    f"[clawray] {sync_error}; engines resumed at versions {result['versions']}; the sync group "
                    "is rebuilt and the newest weights re-sent at the next sync",
                    flush=True,
                )
        if not any(k.startswith("engine_version/") for k in sync_metrics):
            sync_metrics.update(
                {f"engine_version/{n}": (-1 if v is None else v) for n, v in self.engine_versions().items()}
            )
        return sync_s, sync_error, sync_metrics

    def _periodic_checkpoint(self) -> float:
        """Save a checkpoint every ``checkpoint.every_steps`` steps; returns its seconds (0 if none)."""
        every = self.cfg.checkpoint.every_steps
        if every > 0 and self.steps_done % every == 0:
            try:
                self.save_checkpoint()
            except Exception as e:  # a full disk: the previous checkpoint and the journal stand
                cause = getattr(e, "cause", None) or e  # a learner's OSError comes wrapped by Ray
                if not isinstance(cause, OSError):
                    raise
                self.checkpoint_failures += 1
                print(
                    f"[clawray] checkpoint at step {self.steps_done} failed ({cause.strerror or type(cause).__name__}): "
                    "the previous one and the journal stand; the next one is tried at its step",
                    flush=True,
                )
                return 0.0
            return self.last_checkpoint["seconds"]
        return 0.0

    def _step_metrics(
        self,
        batch: dict,
        metas: list,
        adv: BatchAdvantages,
        skipped: str,
        train: dict,
        timing: dict[str, float],
        t0: float,
    ) -> tuple[dict[str, Any], dict[str, int]]:
        """The step's metrics row (see README) and the cumulative drop counts by reason; ``timing/step_s``
        is measured from ``t0`` (``time.perf_counter()`` at the step's start)."""
        qstats = ray.get(self.queue.stats.remote())
        tstats = self._counters("sessions", self.tracker.stats.remote(), {})
        judge_metrics = self._judge_metrics(tstats)
        gen_metrics = self._generation_metrics()
        replicas = self.serve_stats()
        serve_metrics = {f"serve/replica_requests/{i}": float(st["requests"]) for i, st in enumerate(replicas)}
        serve_counts: Counter[str] = Counter()
        for st in replicas:
            serve_counts.update(st.get("counts") or {})
        zero_variance = self.zero_variance_dropped if self.cfg.trainer.dynamic_sampling else None
        dropped = drop_counts(tstats, qstats, self.all_masked_dropped, zero_variance)
        decided = qstats["taken"] + qstats["dropped"].get("stale", 0)
        rewarded = adv.rewarded
        metrics = {
            "policy_version": self.version,
            "samples": len(metas),
            # pure OPD samples carry no reward: no value (null), not a 0
            "reward_mean": sum(float(metas[i].reward) for i in rewarded) / len(rewarded) if rewarded else math.nan,
            "skipped": skipped or "no",
            **{k: v for k, v in train.items() if k not in ("skipped", "train_s")},
            "inv/nonzero_reward_frac": adv.signal["nonzero_reward_frac"],
            "inv/reward_std": adv.signal["reward_std"],
            "inv/degenerate_batches": self.guard.degenerate_batches,
            "inv/baseline": self.guard.baseline,
            "inv/entropy_coef": self.entropy_coef(),
            "inv/staleness_mean": sum(batch["staleness"]) / len(batch["staleness"]),
            "inv/staleness_max": max(batch["staleness"]),
            # samples trained / samples whose fate the queue decided (taken by the learner or dropped
            # as stale); queued ones are not counted yet. All-masked samples and skipped steps count
            # as taken, not trained.
            "inv/effective_sample_rate": self.samples_trained / decided if decided else math.nan,
            **{f"inv/dropped_samples/{k.removeprefix('dropped/')}": v for k, v in dropped.items()},
            **judge_metrics,
            **{f"stats_timeouts/{k}": float(v) for k, v in self.stats_timeouts.items()},
            **gen_metrics,
            **serve_metrics,
            **(traffic(serve_counts, tstats) if replicas else {}),
            **credit_metrics(metas, tstats),
            "sessions/open": tstats.get("open_sessions", 0),
            "sessions/idle_closed": tstats.get("sessions_idle_closed", 0),
            "samples_in": qstats["put"],
            "samples_taken": qstats["taken"],
            "samples_trained": self.samples_trained,
            "samples_dropped": sum(dropped.values()),
            **timing,
            "timing/step_s": time.perf_counter() - t0,
        }
        return metrics, dropped

    def _log_step(
        self,
        metrics: dict[str, Any],
        dropped: dict[str, int],
        adv: BatchAdvantages,
        train: dict,
        skipped: str,
        sync_s: float,
        sync_error: str | None,
        t_wait: float,
        t_train: float,
    ) -> None:
        """Append the row to the history, log it (wandb, ``metrics.jsonl``) and print the step's line
        (:func:`~clawray.step_metrics.step_line`)."""
        self.history.append(metrics)
        self.tracking.log(
            {k: v for k, v in metrics.items() if k not in ("skipped", "sync_error")}, step=self.steps_done
        )
        args = (metrics, dropped, train, bool(adv.rewarded), skipped, sync_s, sync_error, t_wait, t_train)
        print(step_line(self.steps_done, self.cfg.trainer.num_steps, *args), flush=True)

    def _generation_metrics(self) -> dict[str, float]:
        """The engines' generation figures since the last step (:class:`~clawray.step_metrics.GenerationMeter`);
        ``{}`` when an engine does not answer within 10 s."""
        from clawray.recovery import ENGINE_COUNTERS

        try:
            stats = ray.get([e.stats.remote() for e in self.engines], timeout=10)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
            return {}
        # [recovery hook] a restarted engine counts from 0 again: totals across its restarts
        return self.generation.update([self.counters.rebase(st["name"], st, ENGINE_COUNTERS) for st in stats])

    def serve_stats(self, session_ids: bool = False) -> list[dict]:
        """Every PolicyServer replica's :meth:`~clawray.serve.app.PolicyServer.stats` (one call per
        replica, ``DeploymentHandle.broadcast``), sorted by replica id: entry ``i`` is the ``i`` of the
        metric ``serve/replica_requests/<i>`` (chat requests that replica received since it started).
        ``[]`` when Serve does not answer within 10 s."""
        from ray import serve

        try:
            handle = serve.get_app_handle("clawray")
            stats = handle.broadcast("stats", session_ids).results(timeout_s=10)
        except Exception:  # noqa: BLE001 - metrics without the serve part, never a failed step
            return []
        return sorted(stats, key=lambda st: st["replica"])

    def engine_versions(self) -> dict[str, int | None]:
        """``{engine name: policy version it serves}`` for the synced rollout engines (None: the engine
        did not answer within 10 s). After a failed sync an engine may lag ``self.version`` until the
        next sync; the per-engine data for ``/health``."""
        return self.weight_sync.engine_versions()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> str:
        """Write a checkpoint atomically (see :mod:`clawray.checkpoint`) and return its folder.

        Contents: the learners' part (HF ``model/``, sharded weights + AdamW state, scheduler,
        version, RNG states per rank) and ``driver.json`` (version, steps, guard and entropy-controller
        state, drop, skip and trained-sample counters, the wandb run id that a resume continues). The
        queued samples and the session state are in the journal (:mod:`clawray.journal`); a batch taken
        but interrupted before its step ended counts as that step when the learners trained it (it is
        journaled as consumed), else it stays unconsumed and a resume queues it again. After the commit
        the journal may forget the samples consumed by the covered steps. A periodic checkpoint's
        seconds are the step's ``timing/checkpoint_s``.
        """
        t0 = time.perf_counter()
        tmp, final = new_checkpoint_dirs(self.checkpoint_dir)
        try:
            return self._save_checkpoint(t0, tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a half-written checkpoint only takes space
            raise

    def _save_checkpoint(self, t0: float, tmp: str, final: str) -> str:
        save_optimizer = self.cfg.checkpoint.save_optimizer
        results = ray.get([w.save_checkpoint.remote(tmp, save_optimizer) for w in self.learners.workers])
        learner_version = results[0]["version"]
        queue_state = ray.get(self.queue.stats.remote())
        marker = self._checkpoint_marker(queue_state)
        steps_done, samples_trained = self.steps_done, self.samples_trained
        queued = queue_state["size"]
        if self._in_flight is not None:
            if learner_version >= self._in_flight["next_version"]:  # trained, interrupted before the step ended
                steps_done += 1
                if not self._in_flight.get("counted"):
                    samples_trained += len(self._in_flight["metas"])
                    self.trained_samples.extend((m.session_id, m.turn_index) for m in self._in_flight["metas"])
                if not self._in_flight.get("marked"):
                    seqs = self._in_flight["seqs"]
                    self._journal_mark(
                        lambda: self.queue.consumed.remote(seqs, steps_done, True), f"step {steps_done}'s batch"
                    )
            else:  # not trained: unconsumed in the journal, so a resume queues it again
                queued += len(self._in_flight["metas"])
        state = {
            "version": learner_version,
            "steps_done": steps_done,
            "guard": dataclasses.asdict(self.guard),
            "entropy": dataclasses.asdict(self.entropy),
            "behaviour": dataclasses.asdict(self.behaviour),
            "all_masked_dropped": self.all_masked_dropped,
            "zero_variance_dropped": self.zero_variance_dropped,
            "samples_trained": samples_trained,
            "skipped_steps": self.skipped_steps,
            "queued_samples": queued,
            "learner_world_size": len(self.learners.workers),
            "time": time.time(),
            "resumable": save_optimizer,
            "wandb_run_id": self.tracking.run_id if hasattr(self, "tracking") else self._wandb_run_id,
        }
        with open(os.path.join(tmp, "driver.json"), "w") as f:
            json.dump(state, f, indent=2)
        if os.path.isdir(os.path.join(tmp, "model")):  # the model's precision and eval settings travel with it
            write_policy_card(os.path.join(tmp, "model"), policy_card(self.cfg, learner_version, steps_done))
        private_tree(tmp)  # the learners' files too, whatever their umask
        write_manifest(tmp)  # every file's size and CRC-32: a resume verifies them (about 1 s per GB)
        commit_checkpoint(tmp, final, self.cfg.checkpoint.keep_last)
        self._trained_since_ckpt = 0  # [recovery hook] a learner rebuild starts from here
        self._forget_covered(steps_done)  # [journal hook]
        seconds = time.perf_counter() - t0
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(final) for f in files)
        self.last_checkpoint = {
            "path": final,
            "seconds": seconds,
            "bytes": size,
            "version": learner_version,
            "marker": marker,
        }
        print(
            f"[clawray] checkpoint {final}: policy v{learner_version}, {queued} queued "
            f"sample(s), {size / 2**20:.1f} MiB in {seconds:.1f}s"
            f"{'' if save_optimizer else ' (model only: checkpoint.save_optimizer=false, not resumable)'}",
            flush=True,
        )
        return final

    def _forget_covered(self, steps_done: int) -> None:
        """[journal hook] Let the sample journal drop what no kept checkpoint can need: the samples
        consumed up to the previous kept checkpoint's step (``steps_done``, this one's, when
        ``checkpoint.keep_last`` is 1 or it is the only one). A resume that falls back from a damaged
        newest checkpoint to the previous one then still finds every sample trained after it. A disk
        that refuses the mark only leaves the journal longer (said)."""
        from clawray.checkpoint import list_checkpoints

        step = steps_done
        kept = list_checkpoints(self.checkpoint_dir)
        if self.cfg.checkpoint.keep_last != 1 and len(kept) >= 2:
            try:
                with open(os.path.join(kept[-2], "driver.json")) as f:
                    step = min(step, int(json.load(f)["steps_done"]))
            except (OSError, ValueError, KeyError, TypeError):
                return  # the previous checkpoint is unreadable: forget nothing
        try:
            ray.get(self.queue.forget.remote(step))
        except OSError as e:  # a RayTaskError(OSError) from the queue's journal write
            print(
                f"[clawray] sample journal: steps <= {step} not marked covered ({_os_error_text(e)}); kept", flush=True
            )

    def _journal_mark(self, call: Any, what: str) -> None:
        """``ray.get(call())`` of a sample-journal mark (consumed, rewind), retried every
        :data:`JOURNAL_RETRY_S` seconds while the disk refuses it (ENOSPC: a ``RayTaskError(OSError)``):
        the loop waits for room rather than skip a mark, which would train its samples again after a
        resume. Requests are still served meanwhile; said once, and once when it is written.

        Raises:
            Exception: any other failure of the call.
        """
        waited = 0.0
        while True:
            try:
                ray.get(call())
                break
            except OSError as e:
                if waited == 0.0:
                    print(
                        f"[clawray] sample journal: {what} cannot be recorded ({_os_error_text(e)}); "
                        f"training waits for the disk, retrying every {JOURNAL_RETRY_S:g} s",
                        flush=True,
                    )
                time.sleep(JOURNAL_RETRY_S)
                waited += JOURNAL_RETRY_S
        if waited:
            self.journal_waits += 1
            print(f"[clawray] sample journal: {what} recorded after {waited:.0f} s", flush=True)

    def _checkpoint_marker(self, queue_state: dict) -> tuple:
        """What a checkpoint would capture: the same marker twice means nothing changed in between."""
        # the queue is not part of a checkpoint (the journal holds it): new samples need none
        return (self.version, self.steps_done, self._in_flight is None)

    def _restore_checkpoint(self, senders: list | None = None) -> None:
        """Load the latest checkpoint into the learners and the driver, then sync the engines to its
        weights at its version (``resume=true``). The queue and the session tracker have already
        replayed the journal (see :meth:`_prepare_journals`). A run that died before its first
        checkpoint resumes from the initial policy at step 0 with its whole journal. ``senders``: a rebuilt learner group's
        workers (:meth:`rebuild_learners`): the sync group is rebuilt with them first.

        Raises:
            FileNotFoundError: no committed checkpoint in ``checkpoint.dir``.
        """
        path = getattr(self, "_resume_checkpoint", None) if senders is None else None
        path = path or latest_intact_checkpoint(self.checkpoint_dir)
        if path is None and senders is None and getattr(self, "_resume_from_start", False):
            print(
                "[clawray] resume: no checkpoint yet; the initial policy (v0) trains every journaled, "
                "acknowledged sample",
                flush=True,
            )
            return
        if path is None:
            raise FileNotFoundError(f"resume=true but there is no checkpoint in {self.checkpoint_dir}")
        with open(os.path.join(path, "driver.json")) as f:
            if json.load(f).get("resumable") is False:
                raise FileNotFoundError(
                    f"resume=true but {path} was saved with checkpoint.save_optimizer=false "
                    "(model only): serve or evaluate its model/, or train on with "
                    f"model.path={os.path.join(path, 'model')}"
                )
        with open(os.path.join(path, "driver.json")) as f:
            state = json.load(f)
        ray.get([w.load_checkpoint.remote(path) for w in self.learners.workers])
        queue_state = ray.get(self.queue.stats.remote())  # the journal's samples are queued again already
        self.version, self.steps_done = state["version"], state["steps_done"]
        for key, value in state["guard"].items():
            setattr(self.guard, key, value)
        for key, value in state["entropy"].items():
            setattr(self.entropy, key, value)
        for key, value in state.get("behaviour", {}).items():  # absent in checkpoints of older versions
            setattr(self.behaviour, key, value)
        self.all_masked_dropped, self.skipped_steps = state["all_masked_dropped"], state["skipped_steps"]
        self.zero_variance_dropped = state.get("zero_variance_dropped", 0)
        self._wandb_run_id = state.get("wandb_run_id")  # absent in checkpoints of older versions
        self.samples_trained = state.get("samples_trained", 0)
        # the engines serve the checkpoint's weights, stamped with its version
        result = (
            self.weight_sync.sync(self.version) if senders is None else self.weight_sync.resync(self.version, senders)
        )
        if not result["ok"]:
            raise RuntimeError(f"resume: syncing the checkpoint's weights to the engines failed: {result['error']}")
        print(
            f"[clawray] resumed from {path}: policy v{self.version}, step {self.steps_done}, "
            f"{queue_state['size']} queued sample(s) from the journal",
            flush=True,
        )

    def _counters(self, name: str, refs: Any, default: Any) -> Any:
        """``ray.get(refs)`` of a component's counters within :data:`STATS_TIMEOUT_S`; past it, the
        last answer under ``name`` (or ``default``) and a count in ``stats_timeouts[name]``: metrics
        and shutdown never wait behind a component's work (a judge busy with thousands of slow calls
        held the whole loop before its counters moved to a control concurrency group)."""
        try:
            value = ray.get(refs, timeout=STATS_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.stats_timeouts[name] = self.stats_timeouts.get(name, 0) + 1
            print(
                f"[clawray] {name} counters did not answer within {STATS_TIMEOUT_S:.0f}s: the last ones are used",
                flush=True,
            )
            return self._last_counters.get(name, default)
        self._last_counters[name] = value
        return value

    def lagging(self) -> list[str]:
        """``"judge-0 failing: <reason>"`` for each judge or teacher whose model is slow or failing
        (:meth:`clawray.actors.judge.JudgeWorker.health`), in role order; a worker that does not
        answer within :data:`STATS_TIMEOUT_S` (restarting) is left out: the actor checks cover it."""
        named = [(f"judge-{i}", j) for i, j in enumerate(self.judges)]
        named += [(f"teacher-{i}", t) for i, t in enumerate(self.teachers)]
        refs = [actor.health.remote() for _, actor in named]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=STATS_TIMEOUT_S) if refs else ([], [])
        out = []
        for (name, _), ref in zip(named, refs):
            if ref not in ready:
                continue
            try:
                report = ray.get(ref)
            except ray.exceptions.RayError:
                continue
            if report.get("state", "ok") != "ok":
                out.append(f"{name} {report['state']}: {report['reason']}")
        return out

    def _judge_metrics(self, tracker_stats: dict) -> dict[str, float]:
        """:func:`judge_metrics` over this run's judge and teacher workers."""
        rebase = self.counters.rebase  # [recovery hook] totals across a judge's or teacher's restarts
        teachers = (
            [
                rebase(f"teacher-{i}", st, st)
                for i, st in enumerate(
                    self._counters("teachers", [t.get_stats.remote() for t in self.teachers], [{}] * len(self.teachers))
                )
            ]
            if self.teachers
            else None
        )
        judge_stats = self._counters("judges", [j.get_stats.remote() for j in self.judges], [{}] * len(self.judges))
        judges = [rebase(f"judge-{i}", st, st) for i, st in enumerate(judge_stats)]
        return judge_metrics(judges, teachers, tracker_stats)

    def run(self) -> dict[str, Any]:
        """``setup`` (if needed), start traffic, run ``trainer.num_steps`` updates (``-1``: until
        interrupted); returns the summary."""
        if not hasattr(self, "engines"):
            self.setup()
        t0 = time.perf_counter()
        self.evaluate("before")  # before any traffic: the engines serve the initial (or resumed) policy
        self.start_traffic()
        try:
            from clawray.recovery import step_or_recover

            while self.cfg.trainer.num_steps < 0 or self.steps_done < self.cfg.trainer.num_steps:
                step_or_recover(self)  # [recovery hook] self.step(), surviving a restarted actor
                last = self.cfg.trainer.num_steps >= 0 and self.steps_done >= self.cfg.trainer.num_steps
                if self.evals.due(self.steps_done, last):
                    self.evaluate("step")
        except BaseException as e:  # interrupted (a serving run ends this way): still leave a summary
            from clawray.recovery import ActorLost, actor_lost

            self.stop_traffic()
            # [recovery hook] a dead actor: one line naming it
            self._lost = e if isinstance(e, ActorLost) else actor_lost(self, e)
            try:
                self.summary(time.perf_counter() - t0)
            except Exception:
                pass
            if self._lost is not None:
                raise self._lost from None
            raise
        self.stop_traffic()  # the summary describes the final state: no traffic after it
        self.evaluate("after")
        return self.summary(time.perf_counter() - t0)

    def summary(self, seconds: float) -> dict[str, Any]:
        """Counters of every component, written to ``run_dir/summary.json``."""
        out = {
            "policy_version": self.version,
            "steps": self.steps_done,
            "skipped_steps": self.skipped_steps,
            "loop_seconds": round(seconds, 1),
            # every read bounded (_counters): a summary at Ctrl-C never waits behind a wedged component
            "engine_versions": self._counters(
                "engine_versions", [e.get_version.remote() for e in self.engines], [None] * len(self.engines)
            ),
            "engines": self._counters("engines", [e.stats.remote() for e in self.engines], [{}] * len(self.engines)),
            "queue": self._counters("queue", self.queue.stats.remote(), {}),
            "sessions": self._counters("sessions", self.tracker.stats.remote(), {}),
            "judges": self._counters("judges", [j.get_stats.remote() for j in self.judges], [{}] * len(self.judges)),
            "stats_timeouts": dict(self.stats_timeouts),
            "journal_waits": self.journal_waits,
            "sim_user": self._counters("sim_user", self.sim.get_stats.remote(), {})
            if self.sim
            else getattr(self, "sim_stats", {}),
            "samples_trained": self.samples_trained,
            "eval": [{k: v for k, v in r.items() if k != "replies"} for r in self.eval_results],
        }
        with open_private(os.path.join(self.run_dir, "summary.json")) as f:
            json.dump(out, f, indent=2)
        return out

    def close(self) -> None:
        """Stop traffic, write the at-exit checkpoint (``checkpoint.save_at_exit``, only after a
        complete setup, so a failed start or resume never replaces ``latest``; a failure to write it
        is reported, not raised), then :meth:`shutdown`."""
        self.stop_traffic()
        lost = getattr(self, "_lost", None)
        if lost is not None and lost.kind == "learner":  # [recovery hook] the group cannot save
            print(
                f"[clawray] {lost.role} died: no checkpoint at exit; the last checkpoint and the journal "
                "stand (resume=true replays every untrained sample)",
                flush=True,
            )
        elif self.cfg.checkpoint.save_at_exit and self._ready:
            try:
                last = getattr(self, "last_checkpoint", None)
                if exit_checkpoint_needed(last, self._checkpoint_marker(ray.get(self.queue.stats.remote()))):
                    self.save_checkpoint()
                else:  # the last periodic checkpoint already holds this policy: no second copy of it
                    print(
                        f"[clawray] checkpoint at exit: policy v{last['version']} is already saved in {last['path']}",
                        flush=True,
                    )
            except Exception as e:  # a dead learner cannot save; the last periodic checkpoint stands
                print(f"[clawray] checkpoint at exit failed: {type(e).__name__}: {e}", flush=True)
        self.shutdown()

    def shutdown(self) -> None:
        """Stop traffic, the server and every actor; stop Ray if this driver started it. Idempotent
        (a failed :meth:`setup` has already called it). Releases the run folder last."""
        if self._shut_down:
            return
        self._shut_down = True
        try:
            self._shutdown_components()
        finally:
            self._run_lock.release()  # the folder is free only once nothing of this run writes to it

    def _shutdown_components(self) -> None:
        from clawray.serve.shutdown import shutdown_serve

        ray_up = ray.is_initialized()  # False when setup failed before Ray started
        if ray_up and getattr(self, "sim", None) is not None:
            try:
                ray.get(self.sim.stop.remote(), timeout=30)
            except Exception:
                pass
        if hasattr(self, "tracking"):
            self.tracking.finish()
        if not ray_up:
            return
        if self._serve_started:  # a run refused at start-up (its folder in use) leaves another's Serve alone
            try:
                shutdown_serve()  # serve.shutdown() without its "graceful_shutdown failed" line
            except Exception:
                pass
        for actor in (
            getattr(self, "engines", [])
            + getattr(self, "judges", [])
            + [
                getattr(self, "judge_engine", None),
                getattr(self, "teacher_engine", None),
                getattr(self, "tracker", None),
                getattr(self, "queue", None),
            ]
            + getattr(self, "teachers", [])
        ):
            if actor is not None:
                try:
                    ray.kill(actor)
                except Exception:  # noqa: BLE001 - already gone; the rest must still be released
                    pass
        if getattr(self, "learners", None) is not None:
            self.learners.shutdown()
        if getattr(self, "weight_sync", None) is not None:
            self.weight_sync.close()
        if self._owns_ray:
            ray.shutdown()


#: Seconds the driver waits for a component's counters (metrics, summary) before it uses the last ones.
STATS_TIMEOUT_S = 10.0
#: Seconds between two tries of a sample-journal mark the disk refused.
JOURNAL_RETRY_S = 5.0


def _os_error_text(e: OSError) -> str:
    """``"No space left on device"``: the OS's words for ``e``, also when ``e`` is a Ray task error
    wrapping the actor's OSError (whose own text is the remote traceback)."""
    cause = getattr(e, "cause", None) or e
    return getattr(cause, "strerror", None) or str(cause).splitlines()[0]


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
            for line in eval_change_lines(driver.eval_results) + closing_lines(
                cfg, getattr(driver, "last_checkpoint", None)
            ):
                print(f"[clawray] {line}", flush=True)
    return summary


def exit_checkpoint_needed(last: dict[str, Any] | None, marker: tuple) -> bool:
    """Whether the at-exit checkpoint must be written: no checkpoint yet, or the policy changed since
    the last one (``marker``: :meth:`Driver._checkpoint_marker`; its first three fields are the
    policy version, the steps done and whether no trained batch is in flight). Queue traffic alone
    after the last checkpoint does not rewrite the same policy (hundreds of MB to GB each)."""
    return last is None or tuple(last["marker"][:3]) != tuple(marker[:3])


def clawray_command() -> str:
    """The ``clawray`` executable to print in a command a user pastes: the one beside this Python
    (``.venv/bin/clawray``, absolute) when it exists, else ``clawray``."""
    exe = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "clawray")
    return exe if os.path.isfile(exe) else "clawray"


def eval_command(cfg: DictConfig, model: str) -> str:
    """The ``clawray eval`` command that reproduces the job's own evaluation of ``model``: the same
    environment, prompts, samples, temperature, seeds, token cap, engine backend and precision."""
    from clawray.checkpoint import engine_dtype

    env, ev, ro = cfg.env, cfg.eval, cfg.rollout
    data = f" --data-path {os.path.abspath(env.data_path)}" if env.name in ("student", "teacher") else ""
    return (
        f"{clawray_command()} eval {model} --env {env.name} --level {env.level}{data} --n {ev.n} "
        f"--num-prompts {ev.num_prompts} --temperature {ev.temperature} --seed {ev.seed} "
        f"--max-tokens {env.max_tokens} --backend {ro.backend} --dtype {engine_dtype(ro.backend, ro.dtype)}"
        + (" --untagged-tool-calls" if cfg.serve.untagged_tool_calls else "")
    )


def closing_lines(cfg: DictConfig, last_checkpoint: dict[str, Any] | None) -> list[str]:
    """Where the trained model is and the commands that use it (serve, evaluate, report), with
    absolute paths and the ``clawray`` beside this Python, so they work when pasted."""
    run_dir = os.path.abspath(cfg.run_dir)
    exe = clawray_command()
    lines = []
    if last_checkpoint is not None:
        model = os.path.join(os.path.abspath(last_checkpoint["path"]), "model")
        slim = "" if not cfg.checkpoint.save_optimizer else "; checkpoint.save_optimizer=false keeps only the model"
        lines += [
            f"trained model (policy v{last_checkpoint['version']}): {model} "
            f"(checkpoint {last_checkpoint['bytes'] / 2**20:.0f} MiB{slim})",
            f"serve it:    {exe} serve {model}   (as it is, no training; train on: {exe} run ... model.path={model})",
        ]
        if cfg.env.enabled or cfg.eval.enabled:
            lines.append(f"evaluate it: {eval_command(cfg, model)}")
    lines.append(f"report:      {exe} report {run_dir}   (plots in {os.path.join(run_dir, 'report')}/)")
    return lines


def eval_change_lines(results: list[dict[str, Any]]) -> list[str]:
    """The closing lines: each eval measure before -> after with its 95% CI (first and last
    evaluation of the run); ``[]`` with fewer than two evaluations."""
    from clawray.evaluation import format_change

    if len(results) < 2:
        return []
    first, last = results[0], results[-1]
    head = (
        f"eval on {last['env']} {last['split']} ({last['samples']} samples each): step {first['step']} "
        f"(v{first['policy_version']}) -> step {last['step']} (v{last['policy_version']})"
    )
    return [head, *(f"  {line}" for line in format_change(first["metrics"], last["metrics"]))]
