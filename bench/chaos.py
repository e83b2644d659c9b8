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

Faults other than a kill (issue #27), audited the same way:

* ``second-run``: a fresh run started in the live run's folder must be ``refused`` (one line naming
  the owner) with nothing of the live run's journal or checkpoints gone, and the live run must go
  on (a step, ``/health`` 200);
* ``disk-full``: for 20 s every append under the run folder (sample and session journals, turn
  records, metrics) fails with ENOSPC in the queue, the tracker and the driver; ``/health`` while
  it lasts (503 expected), then ``recovered`` = a step and ``/health`` 200 once the disk has room;
* ``damaged-files``: a 3-step run, then its newest checkpoint's weights cut in half and a torn last
  line in the sample journal; the resume must fall back to the older checkpoint;
* ``slow-judge``: ``clawray run`` in a subprocess with a PRM judge endpoint answering in 20 s
  (timeout 5 s, 1 retry, m = 3) for 60 s, then in 0.2 s: ``/health`` while slow (503 naming the
  judge expected), seconds from the fast endpoint to the next update, then SIGINT: ``stopped`` =
  exit code 130 with the at-exit checkpoint, in ``sigint_s`` seconds.

Usage: ``python bench/chaos.py [--kinds engine,judge,...] [--model DIR] [--out DIR]`` (about 3-4
minutes per kind on 2 CPU cores). Kill kinds joined by ``+`` (``teacher+queue+tracker``, as
``tests/system/test_chaos.py`` runs them) are killed one after another in one run, each once the
previous one recovered, and audited once. The last lines are the table.
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

KILLS = ["engine", "judge", "teacher", "queue", "tracker", "learner", "learner-rebuild", "driver"]
# faults other than a kill (issue #27): a second run started in a live run's folder, the run
# folder's disk refusing every write for a while, damaged files at resume, a slow judge endpoint
# (and Ctrl-C while it is slow)
FAULTS = ["second-run", "disk-full", "damaged-files", "slow-judge"]
KINDS = KILLS + FAULTS
# what each kind must end in: Ray restarts it (or the driver rebuilds the learners), or the run stops
# with one line and resume=true continues; a second run is refused and the live one goes on
EXPECTED = {"learner": "stopped", "driver": "stopped", "second-run": "refused", "slow-judge": "stopped"}


def passed(row: dict) -> bool:
    """The kind ended as :data:`EXPECTED` (default ``recovered``), and nothing acknowledged was lost
    or trained twice."""
    return (
        row.get("outcome") == EXPECTED.get(row["kind"], "recovered")
        and row.get("lost") == 0
        and row.get("trained_twice") == 0
    )


def config(model: str, run_dir: str, kind: str, overrides: list[str]):
    algo = ["trainer.algo=opd", "opd.teacher=frozen", "opd.premise_check=none"] if "teacher" in kind.split("+") else []
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
        "engine": lambda: d.actors.engines[0],
        "judge": lambda: d.actors.judges[0],
        "queue": lambda: d.actors.queue,
        "tracker": lambda: d.actors.tracker,
        "learner": lambda: d.actors.learners.workers[1],
        "teacher": lambda: d.actors.teachers[0],
        "learner-rebuild": lambda: d.actors.learners.workers[1],
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
    # a sequence number twice (an exit checkpoint re-marking the batch its step had marked) is one training
    seqs = {q for r in recs if r["op"] == "consume" and r["trained"] and r["step"] <= step for q in r["seqs"]}
    return [by_seq[q] for q in sorted(seqs)]


def one(kind: str, model: str, root: str, overrides: tuple[str, ...] = ()) -> dict:
    """Run ``kind`` (one of :data:`KINDS`, or kill kinds joined by ``+``: killed one after another in
    one run, each after the previous one recovered) and audit it; returns its table row. ``overrides``
    (``key=value``) apply to the run and its resume (an actor kill's kinds only; the tests run one
    learner rank where the kill is not a learner's)."""
    from clawray.driver import Driver

    run_dir = os.path.join(root, kind)
    if kind == "driver":
        return audit(kind, model, run_dir, kill_driver(model, run_dir))
    if kind == "slow-judge":
        return audit(kind, model, run_dir, slow_judge(model, run_dir))
    if kind == "damaged-files":
        return audit(kind, model, run_dir, damaged_files(model, run_dir))
    restarts = ["learner.max_restarts=1"] if kind == "learner-rebuild" else []
    d = Driver(
        config(
            model,
            run_dir,
            kind,
            ["trainer.batch_size=2", "trainer.max_batch_size=4", "trainer.num_steps=-1", *restarts, *overrides],
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
        steps_at_kill = d.steps_done
        if kind == "second-run":
            result.update(second_run(d, model, run_dir))
            t_kill = time.monotonic()
        elif kind == "disk-full":
            result.update(disk_full(d, run_dir))
            t_kill = time.monotonic()  # the disk has room again: recovered counts from here
            steps_at_kill = d.steps_done
        outcome = None
        if kind not in ("second-run", "disk-full"):  # "a+b": kill a, await a step and /health 200, kill b
            names = kind.split("+")
            for k, killed in enumerate(names):
                actor = target(d, killed)
                pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
                t_kill = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                time.sleep(1.0)
                result["health_after_kill"] = health(d)[0]
                if k + 1 < len(names):
                    outcome = wait_outcome(d, runner, errors, steps_at_kill, t_kill)
                    result[f"{killed}_outcome"] = outcome[0]
                    result[f"{killed}_seconds"] = round(time.monotonic() - t_kill, 1)
                    if outcome[0] != "recovered":
                        break
                    steps_at_kill = d.steps_done
        if outcome is None or outcome[0] == "recovered":
            outcome = wait_outcome(d, runner, errors, steps_at_kill, t_kill)
        result["outcome"], result["detail"] = outcome
        if kind == "second-run" and result["outcome"] == "recovered" and result.pop("refused", False):
            result["outcome"] = "refused"  # refused, and the live run went on with a step and /health 200
        result["seconds"] = round(time.monotonic() - t_kill, 1)
        if runner.is_alive():  # end the run after the step in progress
            from omegaconf import read_write

            with read_write(d.cfg):
                d.cfg.trainer.num_steps = d.steps_done + 1
            runner.join(300)
    finally:
        d.close()
    return audit(kind, model, run_dir, result, overrides)


def wait_outcome(d, runner, errors: list, steps_at_kill: int, t_kill: float) -> tuple[str, str]:
    """``("recovered", "")`` once a step after ``steps_at_kill`` completed and ``/health`` is 200,
    ``("stopped", line)`` when the run ended with :class:`~clawray.recovery.ActorLost`, ``("failed",
    repr)`` on any other end, ``("stalled", ...)`` after 300 s of neither."""
    from clawray.recovery import ActorLost

    while time.monotonic() - t_kill < 300:
        if not runner.is_alive():
            err = errors[0] if errors else None
            return ("stopped", str(err)) if isinstance(err, ActorLost) else ("failed", repr(err))
        if d.steps_done > steps_at_kill and health(d)[0] == 200:
            return "recovered", ""
        time.sleep(0.5)
    return "stalled", "no step and no stop in 300 s"


def start_job(cfg, run_dir: str, name: str):
    """``clawray run`` of ``cfg`` in a subprocess with its own local Ray (``RAY_ADDRESS`` unset), its
    config and output beside ``run_dir`` (``NAME.yaml``, ``NAME.log``); returns ``(process, log file)``."""
    import subprocess

    from omegaconf import OmegaConf

    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "..", f"{name}.yaml")
    OmegaConf.save(cfg, path)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    log = open(os.path.join(run_dir, "..", f"{name}.log"), "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "clawray.cli", "run", path], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    return proc, log


def kill_driver(model: str, run_dir: str) -> dict:
    """``clawray run`` in a subprocess (its own local Ray, which dies with it); SIGKILL its process tree
    once a checkpoint exists and fewer samples than one batch are queued."""

    import psutil

    from clawray.journal import SampleState

    cfg = config(
        model,
        run_dir,
        "driver",
        ["trainer.batch_size=4", "trainer.max_batch_size=64", "trainer.num_steps=-1", "ray.num_cpus=2"],
    )
    proc, log = start_job(cfg, run_dir, "driver")
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


def second_run(d, model: str, run_dir: str) -> dict:
    """Start a fresh run (a new Driver's setup) in the live run's folder: it must be refused with
    one line naming the owner, and change nothing there (journal, checkpoints)."""
    from clawray.driver import Driver
    from clawray.run_lock import RunFolderInUse

    def snapshot() -> dict:
        out = {}
        for sub in ("journal", "checkpoints"):
            for dirpath, _, files in os.walk(os.path.join(run_dir, sub)):
                for name in files:
                    out[os.path.join(dirpath, name)] = os.path.getsize(os.path.join(dirpath, name))
        return out

    before = snapshot()
    second = Driver(config(model, run_dir, "second-run", ["trainer.num_steps=-1"]))
    t0 = time.monotonic()
    try:
        second.setup()
        second.close()
        return {"refused": False, "health_after_kill": health(d)[0], "detail_second": "the second run started"}
    except RunFolderInUse as e:
        after = snapshot()
        # the live run only appends (and adds checkpoints): nothing it had may be gone or shorter
        kept = all(after.get(p, -1) >= n for p, n in before.items())
        print(f"[chaos] second run refused in {time.monotonic() - t0:.1f}s: {e}", flush=True)
        return {"refused": kept, "health_after_kill": health(d)[0]}


def _enospc(root: str, on: bool) -> None:
    """In this process: every ``os.write`` to a file under ``root`` fails with ENOSPC (``on``), or
    writes again. clawray's journals, records and metrics append through ``os.write``
    (:func:`clawray.records.append_whole`); checkpoint files are written by torch/safetensors and
    are not refused here."""
    import errno

    real = getattr(os, "_chaos_real_write", None) or os.write
    os._chaos_real_write = real
    if not on:
        os.write = real
        return

    def write(fd, data):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if path.startswith(root):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    os.write = write


def disk_full(d, run_dir: str, seconds: float = 20.0) -> dict:
    """The run folder's disk refuses every append of the tracker (records, session journal), the
    queue (sample journal) and the driver (metrics) for ``seconds``; ``/health`` is read while it
    lasts (503 with ``failing`` expected once the tracker met it)."""
    root = os.path.realpath(run_dir)
    actors = [d.actors.tracker, d.actors.queue]
    ray.get([a.__ray_call__.remote(lambda self: _enospc(root, True)) for a in actors])
    _enospc(root, True)
    codes, failing = [], []
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            code, body = health(d)
            codes.append(code)
            failing = body.get("failing") or failing
            time.sleep(2.0)
    finally:
        _enospc(root, False)
        ray.get([a.__ray_call__.remote(lambda self: _enospc(root, False)) for a in actors])
    print(f"[chaos] disk full for {seconds:.0f}s: /health {sorted(set(codes))}, failing {failing}", flush=True)
    return {"health_after_kill": max(codes) if codes else -1, "steps_while_full": d.steps_done}


def damaged_files(model: str, run_dir: str) -> dict:
    """A run with a checkpoint per step stops after 3 steps; then its newest checkpoint's
    ``model.safetensors`` is cut in half and the sample journal gets a torn last line (a write a
    crash cut short: never acknowledged). The resume (:func:`audit`) must fall back to the older
    checkpoint and say so, and lose nothing acknowledged."""
    from clawray.checkpoint import latest_checkpoint
    from clawray.driver import Driver

    d = Driver(config(model, run_dir, "damaged-files", ["trainer.batch_size=2", "trainer.num_steps=3"]))
    try:
        d.run()
    finally:
        d.close()
    newest = latest_checkpoint(os.path.join(run_dir, "checkpoints"))
    weights = os.path.join(newest, "model", "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with open(os.path.join(run_dir, "journal", "samples.jsonl"), "ab") as f:
        f.write(b'{"op":"ack","seq":99999,"sample":{"session_id":"torn"')
    return {
        "kind": "damaged-files",
        "outcome": "recovered",
        "detail": f"cut {os.path.relpath(weights, run_dir)} in half; torn last journal line",
        "seconds": "-",
        "health_after_kill": "-",
    }


class SlowJudge:
    """An OpenAI-compatible judge endpoint on loopback that answers ``\\boxed{1}`` after ``delay``
    seconds (a thread per request); ``delay`` can be changed while it serves."""

    def __init__(self, delay: float):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.delay = delay
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                time.sleep(judge.delay)
                body = json.dumps(
                    {
                        "id": "j",
                        "object": "chat.completion",
                        "created": 0,
                        "model": "judge",
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": "\\boxed{1}"},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    }
                ).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the judge gave up on this call (its timeout)
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def slow_judge(model: str, run_dir: str, slow_s: float = 60.0) -> dict:
    """``clawray run`` in a subprocess whose PRM judge (``judge.backend=openai``, timeout 5 s, 1 retry,
    m = 3) answers in 20 s: every vote times out. ``/health`` is read while it is slow (503 naming
    the judge expected); after ``slow_s`` the endpoint answers in 0.2 s and the seconds to the next
    update are ``seconds`` (recovered). Then SIGINT: the seconds to the process's exit, its code
    (130) and whether the at-exit checkpoint was written are ``sigint_s``, ``exit_code``, ``at_exit_ckpt``."""
    import subprocess

    judge = SlowJudge(delay=20.0)
    port = free_port()
    cfg = config(
        model,
        run_dir,
        "slow-judge",
        [
            "trainer.batch_size=2",
            "trainer.num_steps=-1",
            "ray.num_cpus=2",
            f"serve.port={port}",
            "judge.backend=openai",
            f"judge.base_url={judge.url}",
            "judge.model=judge",
            "judge.api_key=x",
            "judge.timeout_s=5",
            "judge.retries=1",
            "judge.m=3",
            "checkpoint.every_steps=0",
        ],
    )
    proc, log = start_job(cfg, run_dir, "slow-judge")
    url = f"http://127.0.0.1:{port}/health"
    result: dict = {"kind": "slow-judge"}

    def steps() -> int:
        try:
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                return sum(1 for line in f if line.strip())
        except OSError:
            return 0

    try:
        states = Counter()
        t0 = None
        while proc.poll() is None and (t0 is None or time.monotonic() - t0 < slow_s):
            try:
                r = httpx.get(url, timeout=10)
            except httpx.HTTPError:
                time.sleep(1.0)
                continue
            t0 = t0 or time.monotonic()
            judges = r.json().get("judges") or [{}]
            states[f"{r.status_code} {judges[0].get('state')}"] += 1
            result["judge_reason"] = judges[0].get("reason") or result.get("judge_reason")
            time.sleep(2.0)
        result["health_after_kill"] = "/".join(sorted(states))
        result["steps_while_slow"] = steps()
        judge.delay = 0.2
        t_fast, before = time.monotonic(), steps()
        while proc.poll() is None and steps() == before and time.monotonic() - t_fast < 300:
            time.sleep(0.5)
        result["seconds"] = round(time.monotonic() - t_fast, 1) if steps() > before else "-"
        result["recovered"] = steps() > before
        t_int = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            result["exit_code"] = proc.wait(600)
        except subprocess.TimeoutExpired:
            proc.kill()
            result["exit_code"] = "killed"
        result["sigint_s"] = round(time.monotonic() - t_int, 1)
        result["at_exit_ckpt"] = _latest(run_dir) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        judge.close()
    ok = result["recovered"] and result["exit_code"] == 130 and result["at_exit_ckpt"]
    result.update(
        outcome="stopped" if ok else "failed",
        detail=f"SIGINT: exit {result['exit_code']} in {result['sigint_s']}s, at-exit checkpoint "
        f"{result['at_exit_ckpt']}; judge: {result.get('judge_reason')}",
    )
    return result


def _latest(run_dir: str):
    from clawray.checkpoint import latest_checkpoint

    return latest_checkpoint(os.path.join(run_dir, "checkpoints"))


def audit(kind: str, model: str, run_dir: str, result: dict, overrides: tuple[str, ...] = ()) -> dict:
    """Resume the run (no traffic, with ``overrides``) until its queue is empty; add acknowledged /
    trained / lost / trained twice (audit by ``(session_id, turn_index)``) and the seconds of the
    resume to ``result``."""
    from clawray.checkpoint import latest_intact_checkpoint
    from clawray.driver import Driver

    # None: died before its first checkpoint; a damaged newest one is passed over, as the resume does
    ckpt = latest_intact_checkpoint(os.path.join(run_dir, "checkpoints"), report=lambda line: None)
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
                *overrides,
            ],
        )
    )
    d2.setup()
    result["resume_s"] = round(time.monotonic() - t_resume, 1)
    try:
        ray.get(d2.actors.tracker.drain.remote(120))
        while ray.get(d2.actors.queue.stats.remote())["size"] > 0:
            d2.step()
        after = list(d2.state.trained_samples)
        stale = ray.get(d2.actors.queue.stats.remote())["dropped"].get("stale", 0)
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
        from clawray.model_folders import build_tiny_model

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
