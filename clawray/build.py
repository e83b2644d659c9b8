"""Building a run from its config: the policy folder, every actor, the weight-sync group.

Owns: which actor each config section makes and with which arguments. Must not: run the loop,
checkpoint or decide about failures (:mod:`clawray.driver`, :mod:`clawray.resume`,
:mod:`clawray.recovery`). Each factory stores what it creates on the :class:`RunActors` it is given
as soon as it exists, so that a failure part-way releases everything created so far.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf

from clawray.algos.algorithm import algorithm_class
from clawray.config import frozen_engines, model_path
from clawray.run_actors import RunActors


def ensure_model(cfg: DictConfig) -> str:
    """The policy folder, built first when it does not exist and ``model.build`` says how. A build
    never writes into a folder that holds files (a user's half-downloaded model stays as it is:
    :func:`clawray.model_folders.build_model_folder`).

    Raises:
        FileNotFoundError: the folder does not exist and ``model.build`` is none.
        FileExistsError: the folder holds files but no ``config.json``.
    """
    path = model_path(cfg)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise FileExistsError(
            f"model.path {path} exists but is not an HF folder (no config.json; an unfinished download?): "
            f"clawray builds model.build={cfg.model.build} only into a new folder and never writes into yours"
        )
    if cfg.model.build == "none":
        raise FileNotFoundError(f"model.path {path} does not exist and model.build is none")
    from clawray import model_folders

    print(
        f"[clawray] model.path {path} does not exist: building model.build={cfg.model.build} there "
        "(model.build=none refuses a missing folder)",
        flush=True,
    )
    model_folders.build_model_folder(cfg.model.build, path)
    return path


def frozen_engine(cfg: DictConfig, backend: str, path: str, name: str, num_gpus: float = 0.0) -> Any:
    """A rollout engine that is never synced (a frozen judge or teacher model) with ``num_gpus`` Ray
    GPUs (``judge.engine_num_gpus``, ``opd.teacher_num_gpus``; 0: on CPU) and the rollout section's
    engine options, restarted by Ray."""
    from clawray.actors.rollout import RolloutEngineActor
    from clawray.recovery import RESTART_RETRY

    return RolloutEngineActor.options(num_cpus=cfg.rollout.num_cpus, num_gpus=num_gpus, **RESTART_RETRY).remote(
        path, OmegaConf.to_object(cfg.rollout), backend=backend, name=name, seed=cfg.seed
    )


def build_actors(cfg: DictConfig, path: str, journals: dict[str, dict], actors: RunActors) -> None:
    """Create the queue, the rollout engines, the judges (and their frozen engine), the teachers
    (OPD/Combine, :func:`clawray.actors.teacher.build_teachers`) and the session tracker on
    ``actors``, without waiting for them (:func:`start_learners` follows).

    Args:
        cfg: the run's config.
        path: the policy's HF folder.
        journals: the queue's and the tracker's ``journal`` arguments (:func:`clawray.resume.prepare_journals`).
        actors: filled in place.
    """
    from clawray.actors.judge import JudgeWorkerActor
    from clawray.actors.queue import TrajectoryQueueActor
    from clawray.actors.rollout import RolloutEngineActor
    from clawray.actors.session import SessionTrackerActor
    from clawray.actors.teacher import build_teachers
    from clawray.recovery import RESTART, RESTART_RETRY, engine_options

    ro = cfg.rollout
    actors.queue = TrajectoryQueueActor.options(num_cpus=0, **RESTART_RETRY).remote(
        cfg.queue.max_staleness, cfg.learner.max_tokens_per_micro_batch, journal=journals["samples"]
    )
    rollout = OmegaConf.to_object(ro)
    actors.engines = [
        RolloutEngineActor.options(
            num_cpus=ro.num_cpus,
            num_gpus=ro.num_gpus,
            resources=dict(ro.resources) or None,
            **engine_options(ro.max_restarts),
        ).remote(path, rollout, name=f"rollout-{i}", seed=cfg.seed, resync_on_restart=True)
        for i in range(ro.num_engines)
    ]
    if cfg.judge.backend == "engine":  # a frozen copy of the initial policy, never synced
        actors.judge_engine = frozen_engine(
            cfg, cfg.judge.engine_backend, path, "judge-engine", num_gpus=cfg.judge.engine_num_gpus
        )
    actors.judges = [
        JudgeWorkerActor.options(num_cpus=cfg.judge.num_cpus, **RESTART_RETRY).remote(
            OmegaConf.to_object(cfg.judge), actors.judge_engine, path
        )
        for _ in range(cfg.judge.num_workers)
    ]
    if algorithm_class(cfg.trainer.algo).needs_teacher:
        # a frozen teacher on the judge engine's backend and GPUs shares it (config.frozen_engines)
        shared = None if "teacher-engine" in frozen_engines(cfg) else actors.judge_engine
        make_engine = lambda backend, p, name: frozen_engine(  # noqa: E731
            cfg, backend, p, name, num_gpus=cfg.opd.teacher_num_gpus
        )
        algorithm = algorithm_class(cfg.trainer.algo)
        topk = cfg.opd.topk if algorithm.term(cfg.opd.loss) == "topk_kl" else 0
        actors.teacher_engine, actors.teachers = build_teachers(
            cfg.opd, path, actors.engines[0], shared, make_engine, topk=topk
        )
    actors.tracker = SessionTrackerActor.options(num_cpus=0, **RESTART).remote(
        actors.judges,
        actors.queue,
        OmegaConf.to_object(cfg),
        teachers=actors.teachers,
        records_dir=os.path.join(os.path.abspath(cfg.run_dir), "records") if cfg.records.enabled else None,
        journal=journals["sessions"],
    )


def start_learners(cfg: DictConfig, path: str, actors: RunActors) -> None:
    """Start the learner group on ``actors`` (:func:`learner_group`: it returns once every rank holds
    its shard), then wait until every engine of :func:`build_actors` is ready (a progress line).

    Args:
        cfg: the run's config.
        path: the policy's HF folder.
        actors: the run's actors, engines created.
    """
    from clawray.console import wait_with_progress

    aux = [e for e in dict.fromkeys([actors.judge_engine, actors.teacher_engine]) if e is not None]
    aux = [e for e in aux if e not in actors.engines]
    print(
        f"[clawray] starting {len(actors.engines) + len(aux)} engine(s) ({cfg.rollout.backend}) and "
        f"{cfg.learner.num_workers} learner(s)",
        flush=True,
    )
    actors.learners = learner_group(cfg, path)
    wait_with_progress([e.ready.remote() for e in actors.engines + aux], "engines ready", "engine")


def learner_group(cfg: DictConfig, path: str) -> Any:
    """A new :class:`~clawray.actors.learner.LearnerGroup` on the policy at ``path`` (its own
    placement group; rank 0 picks the FSDP rendezvous port on its own node), with the algorithm's
    loss weights."""
    from clawray.actors.learner import LearnerGroup

    w_rl, w_opd = algorithm_class(cfg.trainer.algo).loss_weights(cfg.opd.w_rl, cfg.opd.w_opd)
    return LearnerGroup(
        path,
        OmegaConf.to_object(cfg.learner),
        loss_weights={"w_rl": w_rl, "w_opd": w_opd, "opd_adv_clip": cfg.opd.adv_clip},
    )


def deploy_server(cfg: DictConfig, path: str, actors: RunActors) -> str:
    """Submit the PolicyServer (``serve.*``) on the run's engines and tracker, without waiting
    (:func:`clawray.serve.deploy.deploy_policy_server`); returns its base URL (``.../v1``)."""
    from clawray.serve.deploy import deploy_policy_server

    serve_cfg = OmegaConf.to_object(cfg.serve)
    return deploy_policy_server(
        path, actors.engines, actors.tracker, serve_cfg, cfg.rollout.max_model_len, actors.health_handles()
    )


def await_server(base_url: str, actors: RunActors) -> None:
    """Wait until the server answers (:func:`clawray.serve.deploy.wait_policy_server`), then give every
    replica the learner ranks for ``/health`` (it may have been deployed before they existed).

    Raises:
        RuntimeError: the deployment failed or never answered.
    """
    from ray import serve

    from clawray.serve.deploy import wait_policy_server
    from clawray.serve.instance import APP_NAME

    wait_policy_server(base_url)
    handle = serve.get_app_handle(APP_NAME)
    handle.broadcast("set_actors", "learners", actors.learner_workers).results(timeout_s=30)


def connect_weight_sync(cfg: DictConfig, actors: RunActors) -> None:
    """Form the weight-sync group between the learner ranks and the rollout engines
    (``sync.*``) on ``actors.weight_sync``, checking that both ends agree on the plan.

    Raises:
        RuntimeError: the group did not form or the plans differ.
    """
    from clawray.weight_sync import WeightSyncController

    plan = ray.get(actors.engines[0].weight_specs.remote())
    names = [f"rollout-{i}" for i in range(len(actors.engines))]
    actors.weight_sync = WeightSyncController.from_config(cfg.sync, actors.learner_workers, actors.engines, names, plan)
    actors.weight_sync.connect(check_plan=True)


def placement_line(actors: RunActors) -> str:
    """One line saying where the learners and engines run (Ray node addresses), the learner
    group's and the sync group's rendezvous (bound on learner rank 0's node) and the transport."""
    from clawray.placement import actor_node_ips

    ips = actor_node_ips(
        {
            **{f"learner-{i}": w for i, w in enumerate(actors.learner_workers)},
            **{f"rollout-{i}": e for i, e in enumerate(actors.engines)},
        }
    )

    def hosts(prefix: str) -> str:
        return ", ".join(f"{ip} x{n}" for ip, n in Counter(v for k, v in ips.items() if k.startswith(prefix)).items())

    host, port = actors.learners.rendezvous
    sync = actors.weight_sync
    where = sync.transport + (f" at {sync.rendezvous[0]}:{sync.rendezvous[1]}" if sync.rendezvous else "")
    where += f" ({sync.note})" if sync.note else ""
    return (
        f"[clawray] placement: learners on {hosts('learner-')} (rendezvous {host}:{port}), engines on "
        f"{hosts('rollout-')}; weight sync {where}"
    )


def ready_line(cfg: DictConfig, actors: RunActors, seconds: float, base_url: str) -> str:
    """The line that says the run is up: its engines (and frozen judge/teacher engines), learners,
    judge backend and server address, after ``seconds`` of setup."""
    aux = {id(e) for e in (actors.judge_engine, actors.teacher_engine) if e is not None}
    aux -= {id(e) for e in actors.engines}
    extra = f" + {len(aux)} frozen judge/teacher engine(s)" if aux else ""
    return (
        f"[clawray] ready in {seconds:.1f}s: {len(actors.engines)} engine(s) ({cfg.rollout.backend}){extra}, "
        f"{cfg.learner.num_workers} learner(s), judge={cfg.judge.backend}, serving {base_url}"
    )


def check_premise(cfg: DictConfig, path: str, actors: RunActors) -> Any:
    """Probe whether the teacher does better at the user's check with the user's hint than
    without (:func:`clawray.premise.probe_actors`) and say it. Returns the
    :class:`~clawray.premise.PremiseResult`, or None when the probe failed (said; the run goes on).

    Raises:
        PremiseRefused: the premise is not shown and ``opd.premise_check`` is ``refuse``.
    """
    from clawray.premise import PremiseRefused, premise_action, probe_actors, teacher_name

    # the teacher's own replies: a frozen or live teacher is the initial policy before step 1, which
    # rollout engine 0 samples fastest; a path teacher has its own engine; an endpoint only scores
    sampler = actors.engines[0] if cfg.opd.teacher in ("frozen", "live") else actors.teacher_engine
    try:
        premise = probe_actors(cfg, path, actors.engines[0], actors.judges[0], actors.teachers[0], sampler)
    except Exception as e:  # the probe is advice: it never ends a run by failing
        print(f"[clawray] OPD premise check failed: {type(e).__name__}: {e}", flush=True)
        return None
    level, text = premise_action(premise, cfg.opd.premise_check, teacher_name(cfg.opd.teacher, path))
    if level == "refuse":
        raise PremiseRefused(text)
    print(f"[clawray] {'WARNING ' if level == 'warn' else ''}{text}", flush=True)
    return premise
