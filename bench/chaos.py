"""Kill matrix: kill -9 one actor of each kind during a run, then resume; nothing acknowledged is lost.

For each kind (``engine``, ``judge``, ``teacher``, ``queue``, ``tracker``, ``learner`` with
``learner.max_restarts=0``, ``learner-rebuild`` with ``learner.max_restarts=1``, and ``driver``) on the
tiny model with the hf engine and simulated users: start a run, wait for its first step, SIGKILL the
actor's process, then measure

* outcome: ``recovered`` (Ray restarted it, or the driver rebuilt the learner group; another step
  completed and ``/health`` is 200 again) or ``stopped`` (the run ended with one line naming the
  actor: :class:`clawray.recovery.ActorLost`; for ``driver``: ``clawray run`` in a subprocess with its
  own local Ray, killed with its process tree once a checkpoint exists and samples are queued);
  ``/health`` 1 s after the kill (503 expected while degraded) is printed;
* seconds from the kill to that outcome;
* after stopping the run and resuming it (``resume=true``, no new traffic, steps until the queue is
  empty): samples acknowledged (journal ``ack`` lines of both runs) vs trained (steps covered by the
  checkpoint + steps after the resume), lost (acknowledged, never trained) and trained twice; both
  must be 0.

Usage: ``python bench/chaos.py [--kinds engine,judge,...] [--model DIR] [--out DIR]`` (about 3-4
minutes per kind on 2 CPU cores). The last lines are the table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import ray  # noqa: E402

from clawray.config import load_config  # noqa: E402
from clawray.journal import read_records  # noqa: E402
from clawray.ray_env import free_port  # noqa: E402

KINDS = ["engine", "judge", "teacher", "queue", "tracker", "learner", "learner-rebuild", "driver"]
# what each kind must end in: Ray restarts it (or the driver rebuilds the learners), or the run stops
# with one line and resume=true continues
EXPECTED = {"learner": "stopped", "driver": "stopped"}


def passed(row: dict) -> bool:
    """The kind ended as :data:`EXPECTED` (default ``recovered``), and nothing acknowledged was lost
    or trained twice."""
    return (
        row.get("outcome") == EXPECTED.get(row["kind"], "recovered")
        and row.get("lost") == 0
        and row.get("trained_twice") == 0
    )


def config(model: str, run_dir: str, kind: str, overrides: list[str]):
    algo = ["trainer.algo=opd", "opd.teacher=frozen"] if kind == "teacher" else []
    return load_config(
        ["conf/rl.yaml", "conf/cpu.yaml"],
        [
            f"model.path={model}",
            "model.build=none",
            "rollout.backend=hf",
            "rollout.num_cpus=0.25",
            "rollout.torch_threads=1",
            "judge.backend=feedback",
            f"run_dir={run_dir}",
            f"serve.port={free_port()}",
            "eval.enabled=false",
            "wandb.mode=disabled",
            "queue.max_staleness=50",
            "checkpoint.every_steps=1",
            "env.max_tokens=16",
            "env.concurrency=2",
            "trainer.batch_timeout_s=600",
            *algo,
            *overrides,
        ],
    )


def target(d, kind: str):
    return {
        "engine": lambda: d.engines[0],
        "judge": lambda: d.judges[0],
        "queue": lambda: d.queue,
        "tracker": lambda: d.tracker,
        "learner": lambda: d.learners.workers[1],
        "teacher": lambda: d.teachers[0],
        "learner-rebuild": lambda: d.learners.workers[1],
    }[kind]()


def health(d) -> tuple[int, dict]:
    try:
        r = httpx.get(d.base_url.removesuffix("/v1") + "/health", timeout=15)
        return r.status_code, r.json()
    except Exception as e:  # noqa: BLE001 - reported
        return -1, {"error": type(e).__name__}


def acked(run_dir: str) -> set:
    path = os.path.join(run_dir, "journal", "samples.jsonl")
    return {(r["sample"]["session_id"], r["sample"]["turn_index"]) for r in read_records(path) if r["op"] == "ack"}


def trained_until(run_dir: str, step: int) -> list:
    recs = read_records(os.path.join(run_dir, "journal", "samples.jsonl"))
    by_seq = {r["seq"]: (r["sample"]["session_id"], r["sample"]["turn_index"]) for r in recs if r["op"] == "ack"}
    return [by_seq[q] for r in recs if r["op"] == "consume" and r["trained"] and r["step"] <= step for q in r["seqs"]]


def one(kind: str, model: str, root: str) -> dict:
    from clawray.driver import Driver
    from clawray.recovery import ActorLost

    run_dir = os.path.join(root, kind)
    if kind == "driver":
        return audit(kind, model, run_dir, kill_driver(model, run_dir))
    restarts = ["learner.max_restarts=1"] if kind == "learner-rebuild" else []
    d = Driver(
        config(
            model,
            run_dir,
            kind,
            ["trainer.batch_size=2", "trainer.max_batch_size=4", "trainer.num_steps=-1", *restarts],
        )
    )
    d.setup()
    result: dict = {"kind": kind}
    errors: list = []

    def loop():
        try:
            d.run()
        except BaseException as e:  # noqa: BLE001 - inspected below
            errors.append(e)

    runner = threading.Thread(target=loop, daemon=True)
    try:
        runner.start()
        while d.steps_done < 1 and runner.is_alive():
            time.sleep(0.2)
        actor = target(d, kind)
        pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
        steps_at_kill = d.steps_done
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        time.sleep(1.0)
        result["health_after_kill"] = health(d)[0]
        outcome = None
        while time.monotonic() - t_kill < 300:
            if not runner.is_alive():
                err = errors[0] if errors else None
                outcome = ("stopped", str(err)) if isinstance(err, ActorLost) else ("failed", repr(err))
                break
            if d.steps_done > steps_at_kill and health(d)[0] == 200:
                outcome = ("recovered", "")
                break
            time.sleep(0.5)
        result["outcome"], result["detail"] = outcome or ("stalled", "no step and no stop in 300 s")
        result["seconds"] = round(time.monotonic() - t_kill, 1)
        if runner.is_alive():  # end the run after the step in progress
            from omegaconf import read_write

            with read_write(d.cfg):
                d.cfg.trainer.num_steps = d.steps_done + 1
            runner.join(300)
    finally:
        d.close()
    return audit(kind, model, run_dir, result)


def kill_driver(model: str, run_dir: str) -> dict:
    """``clawray run`` in a subprocess (its own local Ray, which dies with it); SIGKILL its process tree
    once a checkpoint exists and fewer samples than one batch are queued."""
    import subprocess

    import psutil
    from omegaconf import OmegaConf

    from clawray.journal import SampleState

    cfg = config(
        model,
        run_dir,
        "driver",
        ["trainer.batch_size=4", "trainer.max_batch_size=64", "trainer.num_steps=-1", "ray.num_cpus=2"],
    )
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "..", "driver.yaml")
    OmegaConf.save(cfg, path)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    log = open(os.path.join(run_dir, "..", "driver.log"), "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "clawray.cli", "run", path], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    t0 = time.monotonic()
    result: dict = {"kind": "driver", "health_after_kill": "-"}
    try:
        while time.monotonic() - t0 < 600 and proc.poll() is None:
            ckpt = _latest(run_dir)
            if ckpt is not None:
                state = SampleState.from_records(read_records(os.path.join(run_dir, "journal", "samples.jsonl")))
                if 1 <= len(state.live) < 4:
                    break
            time.sleep(0.2)
    finally:
        children = psutil.Process(proc.pid).children(recursive=True)
        t_kill = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        psutil.wait_procs(children, timeout=30)
        proc.wait(30)
        log.close()
    result.update(
        outcome="stopped",
        detail="killed with its local Ray; resume=true continues",
        seconds=round(time.monotonic() - t_kill, 1),
    )
    return result


def _latest(run_dir: str):
    from clawray.checkpoint import latest_checkpoint

    return latest_checkpoint(os.path.join(run_dir, "checkpoints"))


def audit(kind: str, model: str, run_dir: str, result: dict) -> dict:
    """Resume the run (no traffic) until its queue is empty; add acknowledged / trained / lost /
    trained twice (audit by ``(session_id, turn_index)``) and the seconds of the resume to ``result``."""
    from clawray.checkpoint import latest_checkpoint
    from clawray.driver import Driver

    ckpt = latest_checkpoint(os.path.join(run_dir, "checkpoints"))  # None: died before its first checkpoint
    steps = json.load(open(os.path.join(ckpt, "driver.json")))["steps_done"] if ckpt else 0
    before_acked, before_trained = acked(run_dir), trained_until(run_dir, steps)

    t_resume = time.monotonic()
    d2 = Driver(
        config(
            model,
            run_dir,
            kind,
            [
                "resume=true",
                "env.enabled=false",
                "trainer.batch_size=1",
                "trainer.max_batch_size=64",
                "trainer.batch_timeout_s=30",
            ],
        )
    )
    d2.setup()
    result["resume_s"] = round(time.monotonic() - t_resume, 1)
    try:
        ray.get(d2.tracker.drain.remote(120))
        while ray.get(d2.queue.stats.remote())["size"] > 0:
            d2.step()
        after = list(d2.trained_samples)
        stale = ray.get(d2.queue.stats.remote())["dropped"].get("stale", 0)
    finally:
        d2.close()
    all_acked = before_acked | acked(run_dir)
    trained = Counter(before_trained + after)
    result.update(
        acknowledged=len(all_acked),
        trained=len(set(trained)),
        lost=len(all_acked - set(trained)),
        trained_twice=sum(1 for n in trained.values() if n > 1),
        stale_dropped=stale,
    )
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--model", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    root = args.out or tempfile.mkdtemp(prefix="clawray-chaos-")
    model = args.model
    if not model:
        from clawray.models import build_tiny_model

        model = build_tiny_model(os.path.join(root, "tiny"))
    from clawray.ray_env import init_ray

    init_ray("", 2)
    rows = []
    for kind in args.kinds.split(","):
        try:
            rows.append(one(kind, model, root))
        except Exception as e:  # noqa: BLE001 - one kind's failure is a row, not the end of the matrix
            rows.append({"kind": kind, "outcome": "error", "detail": repr(e)[:200]})
        print(f"[chaos] {json.dumps(rows[-1])}", flush=True)
    print("\nkind             outcome    seconds  /health  acked  trained  lost  twice  ok  detail")
    for r in rows:
        print(
            f"{r['kind']:<16} {r.get('outcome', ''):<10} {r.get('seconds', ''):>7}  {r.get('health_after_kill', ''):>7}  "
            f"{r.get('acknowledged', ''):>5}  {r.get('trained', ''):>7}  {r.get('lost', ''):>4}  "
            f"{r.get('trained_twice', ''):>5}  {'yes' if passed(r) else 'NO':>3}  {r.get('detail', '')[:90]}"
        )
    return 0 if all(passed(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
