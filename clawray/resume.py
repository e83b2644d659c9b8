"""Checkpoints of a run, resuming from one, and rebuilding the learner group from one.

Owns: what a checkpoint holds beside the learners' files (``driver.json``: the :class:`LoopState`),
when the sample journal may forget, and the order of a resume (journals replayed, learners loaded,
engines synced), and what the queue and the session tracker are told of it (a batch an aborted step
gives back, the learners' version). Must not: take batches, train or build actors other than a replacement learner
group (:mod:`clawray.driver`, :mod:`clawray.build`). Folder layout and atomic commits:
:mod:`clawray.checkpoint`; the journals: :mod:`clawray.journal`.

A checkpoint (``checkpoint.every_steps`` and at exit) holds the learner state and the loop's counters;
the samples and the session state live in the durable journal: each step journals the samples it
consumed, and ``resume=true`` continues from the latest checkpoint with the same policy-version
numbering and queues every acknowledged sample its weights did not train again, exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from collections import deque
from typing import Any, Callable

import ray
from omegaconf import DictConfig

from clawray.algos.invariants import DegenerateBatchGuard, EntropyController
from clawray.checkpoint import (
    commit_checkpoint,
    latest_checkpoint,
    latest_intact_checkpoint,
    list_checkpoints,
    new_checkpoint_dirs,
    policy_card,
    write_manifest,
    write_policy_card,
)
from clawray.config import checkpoint_dir
from clawray.file_modes import private_tree
from clawray.recovery import ActorLost
from clawray.run_actors import RunActors
from clawray.serve.instance import APP_NAME

#: Seconds between two tries of a sample-journal mark the disk refused.
JOURNAL_RETRY_S = 5.0


@dataclasses.dataclass
class LoopState:
    """The training loop's state. The fields up to ``metrics_row`` are saved in a checkpoint's
    ``driver.json``; the rest live only as long as the driver.

    Attributes:
        guard: the degenerate-batch guard (:class:`~clawray.algos.invariants.DegenerateBatchGuard`).
        entropy: the entropy-bonus controller.
        behaviour: the behaviour-floor controller (``learner.behaviour_floor``), fed
            ``inv/behaviour_entropy``; its coefficient adds to the entropy bonus.
        version: the learners' policy version.
        steps_done: driver steps, continued across a resume.
        samples_trained: samples that reached an optimizer step (all-masked and skipped ones not).
        all_masked_dropped: samples without a trainable token, dropped before training.
        zero_variance_dropped: samples rejected by dynamic sampling (``trainer.dynamic_sampling``).
        skipped_steps: ``{reason: steps}`` not trained (``degenerate``, ``nonfinite``, ``no_gradient``).
        wandb_run_id: the wandb run a resume continues.
        metrics_row: the last step's ``metrics.jsonl`` row (:meth:`~clawray.metrics_log.MetricsLog.row`),
            stored before its checkpoint commits; a resume writes it back if a kill lost it.
        in_flight: the batch taken from the queue and not yet decided on (``next_version``,
            ``metas``, ``seqs``; ``counted``/``marked`` once trained/journaled), else None.
        trained_samples: ``(session_id, turn_index)`` of the most recently trained samples.
        trained_since_ckpt: entries of ``trained_samples`` after the last checkpoint (a learner
            rebuild drops them: they are trained again, once).
        learner_restarts: learner-group rebuilds so far (``learner.max_restarts``).
    """

    guard: DegenerateBatchGuard
    entropy: EntropyController
    behaviour: EntropyController
    version: int = 0
    steps_done: int = 0
    samples_trained: int = 0
    all_masked_dropped: int = 0
    zero_variance_dropped: int = 0
    skipped_steps: dict[str, int] = dataclasses.field(default_factory=dict)
    wandb_run_id: str | None = None
    metrics_row: dict | None = None
    in_flight: dict | None = None
    trained_samples: deque = dataclasses.field(default_factory=lambda: deque(maxlen=1 << 16))
    trained_since_ckpt: int = 0
    learner_restarts: int = 0

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "LoopState":
        """A fresh state with the controllers of ``trainer.*`` and ``learner.*``."""
        lr = cfg.learner
        return cls(
            guard=DegenerateBatchGuard(cfg.trainer.degenerate_batches, cfg.trainer.baseline_momentum),
            entropy=EntropyController(lr.entropy_coef, lr.entropy_floor, lr.entropy_coef_lr, lr.entropy_coef_max),
            behaviour=EntropyController(0.0, lr.behaviour_floor, lr.entropy_coef_lr, lr.entropy_coef_max),
        )

    def entropy_coef(self, coef_max: float) -> float:
        """The entropy-bonus coefficient of the next update: the entropy controller's plus the
        behaviour controller's, at most ``coef_max`` when the behaviour floor is on."""
        if self.behaviour.floor <= 0:
            return self.entropy.coef
        return min(self.entropy.coef + self.behaviour.coef, coef_max)

    def record_trained(self, metas: list) -> None:
        """Count the samples (:class:`~clawray.types.SampleMeta`) that an optimizer step trained."""
        self.trained_samples.extend((m.session_id, m.turn_index) for m in metas)
        self.trained_since_ckpt += len(metas)
        self.samples_trained += len(metas)

    def marker(self) -> tuple:
        """What a checkpoint would capture: the same marker twice means nothing changed in between
        (the queue is not part of a checkpoint: the journal holds it)."""
        return (self.version, self.steps_done, self.in_flight is None)


def exit_checkpoint_needed(last: dict[str, Any] | None, marker: tuple) -> bool:
    """Whether the at-exit checkpoint must be written: no checkpoint yet, or the policy changed since
    the last one (``marker``: :meth:`LoopState.marker`; its first three fields are the policy
    version, the steps done and whether no trained batch is in flight). Queue traffic alone after the
    last checkpoint does not rewrite the same policy (hundreds of MB to GB each)."""
    return last is None or tuple(last["marker"][:3]) != tuple(marker[:3])


class Checkpoints:
    """The run's checkpoints: save (periodic, at exit), resume, rebuild the learners from one.

    Args:
        cfg: the run's config (``checkpoint.*``, ``queue.journal_*``, ``resume``).
        state: the loop's state, saved and restored in place.
        actors: the run's actors (learners, queue, weight sync).

    Attributes:
        last: the last checkpoint written (``path``, ``seconds``, ``bytes``, ``version``,
            ``marker``), or None.
        failures: periodic checkpoints the disk refused (the run goes on).
        journal_waits: sample-journal marks that waited for the disk (ENOSPC).
    """

    def __init__(self, cfg: DictConfig, state: LoopState, actors: RunActors):
        self.cfg, self.state, self.actors = cfg, state, actors
        self.dir = checkpoint_dir(cfg)
        self.run_dir = os.path.abspath(cfg.run_dir)
        self.last: dict[str, Any] | None = None
        self.failures = 0
        self.journal_waits = 0
        self._resume_path: str | None = None  # the verified checkpoint a resume continues
        self._resume_from_start = False  # resume=true before the first checkpoint: the journal only
        self._due = False  # a periodic checkpoint's step came while the policy was unsettled (the gate)

    # ------------------------------------------------------------------ journals and resume
    def check_resumable(self) -> None:
        """With ``resume=true``, fail before anything is built or created when there is nothing to
        resume: no checkpoint (``latest``) and no sample journal (a mistyped ``run_dir``), or no
        checkpoint while the journal says one covered its steps (:meth:`_check_journal_alone`).
        Verifying the checkpoint is left to :meth:`prepare_journals`.

        Raises:
            FileNotFoundError: ``resume=true`` with neither, or with the journal alone after a checkpoint.
        """
        if self.cfg.resume and latest_checkpoint(self.dir) is None:
            if not self._has_journal():
                raise self._nothing_to_resume()
            self._check_journal_alone()

    def _check_journal_alone(self) -> None:
        """A resume without a checkpoint retrains the journal's samples from the initial policy; once a
        checkpoint covered a step, the journal has forgotten that step's samples, so starting over
        would lose them (a ``checkpoint.dir`` that is not this run's, or a relative one read from
        another working folder).

        Raises:
            FileNotFoundError: the journal's samples were covered by a checkpoint.
        """
        from clawray.journal import SAMPLES_FILE, SampleState, journal_dir, read_records

        covered = SampleState.from_records(read_records(os.path.join(journal_dir(self.run_dir), SAMPLES_FILE))).covered
        if covered > 0:
            raise FileNotFoundError(
                f"resume=true but there is no checkpoint in {self.dir}, while the journal in "
                f"{journal_dir(self.run_dir)} was covered by a checkpoint of step {covered}: starting over from "
                "the initial policy would lose the samples trained before it (is checkpoint.dir this run's? "
                "a relative one is read from the working folder)"
            )

    def _has_journal(self) -> bool:
        from clawray.journal import SAMPLES_FILE, journal_dir

        return os.path.exists(os.path.join(journal_dir(self.run_dir), SAMPLES_FILE))

    def _nothing_to_resume(self) -> FileNotFoundError:
        from clawray.journal import journal_dir

        return FileNotFoundError(
            f"resume=true but there is no checkpoint in {self.dir} and no journal in {journal_dir(self.run_dir)}"
        )

    def prepare_journals(self) -> dict[str, dict]:
        """Ready the run's journals (:func:`clawray.journal.prepare_journals`): a fresh run starts
        them empty; a resume voids the samples consumed after the checkpoint it resumes. Returns the
        queue's and the tracker's ``journal`` arguments.

        Raises:
            FileNotFoundError: ``resume=true`` with neither a checkpoint nor a journal.
        """
        from clawray.checkpoint import set_aside
        from clawray.journal import prepare_journals

        resume_step = None
        if not self.cfg.resume:
            kept = set_aside(self.dir)
            if kept is not None:
                print(
                    f"[clawray] a fresh run (resume=false): the checkpoints in {self.dir} are an earlier run's, "
                    f"kept as {kept} (resume=true continues a run)",
                    flush=True,
                )
        else:
            # verified (manifest sizes and CRC-32s); a damaged newest one falls back to an older one, said
            path = self._resume_path = latest_intact_checkpoint(self.dir)
            if path is not None:
                _check_resumable(path)  # before the journal is rewritten for it
                resume_step = _steps_done(path)
                if path != latest_checkpoint(self.dir):
                    print(
                        f"[clawray] resume from step {resume_step}: the samples trained after it are queued "
                        "again (the journal keeps them until a newer checkpoint is not the only one kept)",
                        flush=True,
                    )
            elif self._has_journal():
                # died before its first checkpoint: the initial policy trains every journaled sample again
                self._check_journal_alone()
                resume_step, self._resume_from_start = 0, True
            else:
                raise self._nothing_to_resume()
        paths = prepare_journals(self.run_dir, resume_step, report=lambda line: print(line, flush=True))
        opts = {"fsync": self.cfg.queue.journal_fsync, "compact_bytes": int(self.cfg.queue.journal_compact_mb * 2**20)}
        return {kind: {"path": p, **opts} for kind, p in paths.items()}

    def restore(self, senders: list | None = None) -> None:
        """Load the latest checkpoint into the learners and :attr:`state`, then sync the engines to
        its weights at its version. The queue and the session tracker have already replayed the
        journal (:meth:`prepare_journals`). A run that died before its first checkpoint resumes from
        the initial policy at step 0 with its whole journal. ``senders``: a rebuilt learner group's
        workers (:meth:`rebuild_learners`): the sync group is rebuilt with them first.

        Raises:
            FileNotFoundError: no committed checkpoint, or one saved without its optimizer state.
            RuntimeError: syncing the checkpoint's weights to the engines failed.
        """
        path = self._resume_path if senders is None else None
        path = path or latest_intact_checkpoint(self.dir)
        if path is None and senders is None and self._resume_from_start:
            print(
                "[clawray] resume: no checkpoint yet; the initial policy (v0) trains every journaled, "
                "acknowledged sample",
                flush=True,
            )
            return
        if path is None:
            raise FileNotFoundError(f"resume=true but there is no checkpoint in {self.dir}")
        saved = _check_resumable(path)
        loaded = ray.get([w.load_checkpoint.remote(path) for w in self.actors.learner_workers])[0]
        base_lr = loaded.get("base_lr") if isinstance(loaded, dict) else None
        if base_lr is not None and not math.isclose(base_lr, self.cfg.learner.lr, rel_tol=1e-6):
            print(
                f"[clawray] resume: the learning rate goes on from the checkpoint's schedule (base {base_lr:g}, "
                f"back-offs included); learner.lr={self.cfg.learner.lr:g} applies to a new run",
                flush=True,
            )
        queue_state = ray.get(self.actors.queue.stats.remote())  # the journal's samples are queued again already
        st = self.state
        st.version, st.steps_done = saved["version"], saved["steps_done"]
        for controller, key in ((st.guard, "guard"), (st.entropy, "entropy"), (st.behaviour, "behaviour")):
            controller.restore(saved.get(key, {}))  # state only: "behaviour" is absent in older checkpoints
        st.all_masked_dropped, st.skipped_steps = saved["all_masked_dropped"], saved["skipped_steps"]
        st.zero_variance_dropped = saved.get("zero_variance_dropped", 0)
        st.wandb_run_id = saved.get("wandb_run_id")  # absent in checkpoints of older versions
        st.metrics_row = saved.get("metrics_row")
        st.samples_trained = saved.get("samples_trained", 0)
        # the engines serve the checkpoint's weights, stamped with its version
        sync = self.actors.weight_sync
        result = sync.sync(st.version) if senders is None else sync.resync(st.version, senders)
        if not result["ok"]:
            raise RuntimeError(f"resume: syncing the checkpoint's weights to the engines failed: {result['error']}")
        print(
            f"[clawray] resumed from {path}: policy v{st.version}, step {st.steps_done}, "
            f"{queue_state['size']} queued sample(s) from the journal",
            flush=True,
        )

    def rebuild_learners(self, lost: ActorLost, new_group: Callable[[], Any]) -> None:
        """Replace the whole learner group after ``lost`` (a learner rank died) and continue from the
        latest checkpoint: shut the old group down (its placement group too), have the queue re-queue
        from its journal every sample that checkpoint did not train (the batch in flight, and those
        of later steps), start ``new_group()``, restore the checkpoint into it and :attr:`state`, and
        re-sync its weights through a rebuilt sync group. The samples trained after the checkpoint
        leave ``trained_samples`` (they will be trained again, once). Prints a line before and after.

        Raises:
            ActorLost: ``lost`` itself when no checkpoint exists yet or the rebuild failed.
        """
        t0 = time.monotonic()
        path = latest_checkpoint(self.dir)
        if path is None:
            raise ActorLost(
                lost.role, lost.kind, "killed or crashed; no checkpoint to rebuild the learners from"
            ) from None
        print(f"[clawray] the {lost.role} actor died: rebuilding the learner group from {path}", flush=True)
        try:
            self._rebuild_learners(new_group)
        except Exception as e:  # noqa: BLE001 - reported as the loss it could not repair
            raise ActorLost(
                lost.role, lost.kind, f"killed or crashed; rebuilding the learners failed: {type(e).__name__}"
            ) from None
        st = self.state
        print(
            f"[clawray] learner group rebuilt in {time.monotonic() - t0:.1f}s: policy v{st.version}, "
            f"step {st.steps_done}, {ray.get(self.actors.queue.stats.remote())['size']} queued sample(s); "
            "training goes on",
            flush=True,
        )

    def _rebuild_learners(self, new_group: Callable[[], Any]) -> None:
        path = latest_intact_checkpoint(self.dir)
        if path is None:
            raise FileNotFoundError(f"no checkpoint in {self.dir}")
        steps, st = _steps_done(path), self.state
        self.actors.learners.shutdown()
        # the in-flight batch and later steps' samples are queued again
        self.mark(lambda: self.actors.queue.rewind.remote(steps), "the learners' rewind")
        st.in_flight = None
        for _ in range(min(st.trained_since_ckpt, len(st.trained_samples))):
            st.trained_samples.pop()
        st.trained_since_ckpt = 0
        self.actors.learners = new_group()
        self.restore(senders=self.actors.learner_workers)
        try:  # /health reports the new ranks: every replica answers /health, each gets the new list
            from ray import serve

            handle = serve.get_app_handle(APP_NAME)
            handle.broadcast("set_actors", "learners", self.actors.learner_workers).results(timeout_s=30)
        except Exception as e:  # noqa: BLE001 - /health then shows the old ranks as dead: degraded, not wrong
            print(f"[clawray] /health keeps the old learner list ({type(e).__name__})", flush=True)

    # ------------------------------------------------------------------ saving
    def periodic(self, settled: bool = True) -> float:
        """Save a checkpoint every ``checkpoint.every_steps`` steps; returns its seconds (0 if none).
        Only a ``settled`` policy is saved (with ``deploy.gate``, a promoted version: a resume never
        serves an unprobed one); a checkpoint whose step came while it was not is saved at the first
        settled step after (the gate's promotions and the checkpoint steps need not coincide). A disk
        that refuses it is counted in :attr:`failures` and said; the previous checkpoint and the
        journal stand.

        Raises:
            Exception: any failure that is not the disk's (``OSError``).
        """
        every = self.cfg.checkpoint.every_steps
        if every <= 0:
            return 0.0
        self._due = self._due or self.state.steps_done % every == 0
        if not (self._due and settled):
            return 0.0
        self._due = False
        try:
            self.save()
        except Exception as e:  # a full disk: the previous checkpoint and the journal stand
            cause = getattr(e, "cause", None) or e  # a learner's OSError comes wrapped by Ray
            if not isinstance(cause, OSError):
                raise
            self.failures += 1
            print(
                f"[clawray] checkpoint at step {self.state.steps_done} failed "
                f"({cause.strerror or type(cause).__name__}): the previous one and the journal stand; "
                "the next one is tried at its step",
                flush=True,
            )
            return 0.0
        return self.last["seconds"]

    def at_exit(self) -> None:
        """The at-exit checkpoint (``checkpoint.save_at_exit``), unless the last one already holds
        this policy; a failure to write it is said, not raised."""
        if not self.cfg.checkpoint.save_at_exit:
            return
        try:
            if exit_checkpoint_needed(self.last, self.state.marker()):
                self.save()
            else:  # the last periodic checkpoint already holds this policy: no second copy of it
                print(
                    f"[clawray] checkpoint at exit: policy v{self.last['version']} is already saved in {self.last['path']}",
                    flush=True,
                )
        except Exception as e:  # a dead learner cannot save; the last periodic checkpoint stands
            print(f"[clawray] checkpoint at exit failed: {type(e).__name__}: {e}", flush=True)

    def save(self) -> str:
        """Write a checkpoint atomically (:mod:`clawray.checkpoint`) and return its folder.

        Contents: the learners' part (HF ``model/``, sharded weights + AdamW state, scheduler,
        version, RNG states per rank) and ``driver.json`` (the saved fields of :class:`LoopState`,
        the queued samples, the learner world size). A batch taken but interrupted before its step
        ended counts as that step when the learners trained it (it is journaled as consumed), else it
        stays unconsumed and a resume queues it again. After the commit the journal may forget the
        samples consumed by the covered steps (:meth:`forget_covered`).
        """
        t0 = time.perf_counter()
        tmp, final = new_checkpoint_dirs(self.dir)
        try:
            return self._save(t0, tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a half-written checkpoint only takes space
            raise

    def _save(self, t0: float, tmp: str, final: str) -> str:
        st, save_optimizer = self.state, self.cfg.checkpoint.save_optimizer
        results = ray.get([w.save_checkpoint.remote(tmp, save_optimizer) for w in self.actors.learner_workers])
        learner_version = results[0]["version"]
        marker = st.marker()
        steps_done, samples_trained = st.steps_done, st.samples_trained
        queued = ray.get(self.actors.queue.stats.remote())["size"]
        flight = st.in_flight
        if flight is not None:
            if learner_version >= flight["next_version"]:  # trained, interrupted before the step ended
                steps_done += 1
                if not flight.get("counted"):
                    samples_trained += len(flight["metas"])
                    st.trained_samples.extend((m.session_id, m.turn_index) for m in flight["metas"])
                if not flight.get("marked"):
                    seqs = flight["seqs"]
                    self.mark(
                        lambda: self.actors.queue.consumed.remote(seqs, steps_done, True), f"step {steps_done}'s batch"
                    )
            else:  # not trained: unconsumed in the journal, so a resume queues it again
                queued += len(flight["metas"])
        saved = {
            "version": learner_version,
            "steps_done": steps_done,
            "guard": dataclasses.asdict(st.guard),
            "entropy": dataclasses.asdict(st.entropy),
            "behaviour": dataclasses.asdict(st.behaviour),
            "all_masked_dropped": st.all_masked_dropped,
            "zero_variance_dropped": st.zero_variance_dropped,
            "samples_trained": samples_trained,
            "skipped_steps": st.skipped_steps,
            "queued_samples": queued,
            "learner_world_size": len(self.actors.learner_workers),
            "time": time.time(),
            "resumable": save_optimizer,
            "wandb_run_id": st.wandb_run_id,
            # the row of the step this checkpoint covers (not of an in-flight one counted here)
            "metrics_row": st.metrics_row if (st.metrics_row or {}).get("step") == steps_done else None,
        }
        with open(os.path.join(tmp, "driver.json"), "w") as f:
            json.dump(saved, f, indent=2)
        if os.path.isdir(os.path.join(tmp, "model")):  # the model's precision and eval settings travel with it
            write_policy_card(os.path.join(tmp, "model"), policy_card(self.cfg, learner_version, steps_done))
        private_tree(tmp)  # the learners' files too, whatever their umask
        write_manifest(tmp)  # every file's size and CRC-32: a resume verifies them (about 1 s per GB)
        commit_checkpoint(tmp, final, self.cfg.checkpoint.keep_last)
        st.trained_since_ckpt = 0  # a learner rebuild starts from here
        self.forget_covered(steps_done)
        seconds = time.perf_counter() - t0
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(final) for f in files)
        self.last = {
            "path": final,
            "seconds": seconds,
            "bytes": size,
            "version": learner_version,
            "steps_done": steps_done,
            "marker": marker,
        }
        print(
            f"[clawray] checkpoint {final}: policy v{learner_version}, {queued} queued "
            f"sample(s), {size / 2**20:.1f} MiB in {seconds:.1f}s"
            f"{'' if save_optimizer else ' (model only: checkpoint.save_optimizer=false, not resumable)'}",
            flush=True,
        )
        return final

    # ------------------------------------------------------------------ the sample journal
    def forget_covered(self, steps_done: int) -> None:
        """Let the sample journal drop what no kept checkpoint can need: the samples consumed up to
        the previous kept checkpoint's step (``steps_done``, this one's, when
        ``checkpoint.keep_last`` is 1 or it is the only one). A resume that falls back from a damaged
        newest checkpoint to the previous one then still finds every sample trained after it. A disk
        that refuses the mark only leaves the journal longer (said)."""
        step = steps_done
        kept = list_checkpoints(self.dir)
        if self.cfg.checkpoint.keep_last != 1 and len(kept) >= 2:
            try:
                step = min(step, _steps_done(kept[-2]))
            except (OSError, ValueError, KeyError, TypeError):
                return  # the previous checkpoint is unreadable: forget nothing
        try:
            ray.get(self.actors.queue.forget.remote(step))
        except OSError as e:  # a RayTaskError(OSError) from the queue's journal write
            print(
                f"[clawray] sample journal: steps <= {step} not marked covered ({os_error_text(e)}); kept", flush=True
            )

    def give_back_batch(self) -> None:
        """A step that a restarted actor's death aborted before its batch was trained (e.g. the session
        tracker died while the serial loop held the users): the batch goes back to the queue (the
        journal holds it live: :meth:`~clawray.actors.queue.TrajectoryQueue.rewind` to the steps done
        voids nothing and queues it again), else the next step's take replaced it in flight and
        nobody trained it until a resume."""
        st = self.state
        if st.in_flight is not None and not st.in_flight.get("marked"):
            steps, queue = st.steps_done, self.actors.queue
            self.mark(lambda: queue.rewind.remote(steps), "the aborted step's batch")
            st.in_flight = None

    def tell_tracker(self) -> None:
        """Tell the session tracker the learners' version (a step's, or a rebuild's checkpoint's:
        ``trainer.credit`` discounted/outcome: turns waiting for their session's return that the next
        update is the last to accept go to the queue now,
        :meth:`~clawray.actors.session.SessionTracker.learned`). A tracker that does not answer within
        30 s is said, not raised: its deadline then follows the engines' version."""
        if self.cfg.trainer.credit == "turn":
            return
        try:
            ray.get(self.actors.tracker.learned.remote(self.state.version), timeout=30)
        except (ray.exceptions.RayError, TimeoutError) as e:
            print(f"[clawray] the session tracker was not told v{self.state.version}: {type(e).__name__}", flush=True)

    def mark(self, call: Callable[[], Any], what: str) -> None:
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
                        f"[clawray] sample journal: {what} cannot be recorded ({os_error_text(e)}); "
                        f"training waits for the disk, retrying every {JOURNAL_RETRY_S:g} s",
                        flush=True,
                    )
                time.sleep(JOURNAL_RETRY_S)
                waited += JOURNAL_RETRY_S
        if waited:
            self.journal_waits += 1
            print(f"[clawray] sample journal: {what} recorded after {waited:.0f} s", flush=True)


def _check_resumable(path: str) -> dict:
    """The ``driver.json`` of checkpoint ``path``, which a resume can continue.

    Raises:
        FileNotFoundError: it was saved without the optimizer state (``checkpoint.save_optimizer=false``).
    """
    with open(os.path.join(path, "driver.json")) as f:
        saved = json.load(f)
    if saved.get("resumable") is False:
        raise FileNotFoundError(
            f"resume=true but {path} was saved with checkpoint.save_optimizer=false "
            "(model only): serve or evaluate its model/, or train on with "
            f"model.path={os.path.join(path, 'model')}"
        )
    return saved


def _steps_done(path: str) -> int:
    """``steps_done`` of the checkpoint folder ``path``."""
    with open(os.path.join(path, "driver.json")) as f:
        return int(json.load(f)["steps_done"])


def os_error_text(e: OSError) -> str:
    """``"No space left on device"``: the OS's words for ``e``, also when ``e`` is a Ray task error
    wrapping the actor's OSError (whose own text is the remote traceback)."""
    cause = getattr(e, "cause", None) or e
    return getattr(cause, "strerror", None) or str(cause).splitlines()[0]
