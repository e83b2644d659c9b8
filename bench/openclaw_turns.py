"""One real OpenClaw conversation through `clawray serve`: per-turn latency and where the requests went.

Starts ``clawray serve MODEL conf/cpu.yaml conf/openclaw.yaml`` (vLLM, 32k context, prefix caching
as asked), installs and configures the real OpenClaw against it (clawray.openclaw), sends TURNS user
messages of one session through ``openclaw agent --local``, and prints per turn the wall seconds of
the whole agent turn (OpenClaw's own work included) and the requests it made, then ``/health``'s
traffic (served, main, side, unattributable, paired). ``clawray serve`` trains nothing, so nothing is
judged here. ``--train`` starts the training job instead (``clawray run`` with the job's feedback
judge or, ``--judge engine``, the frozen policy as PRM judge; no simulated users, Qwen's CPU LoRA
preset and the memory settings that fit 24 GiB: one learner, batches of ``--batch-size``): the same
conversation is then also judged and trained, and the bench waits up to ``--train-wait`` seconds
after the last turn for the learners to take the queued samples.

    PYTHONPATH=. .venv/bin/python bench/openclaw_turns.py --turns 10
    PYTHONPATH=. .venv/bin/python bench/openclaw_turns.py --turns 3 --no-prefix-caching
    PYTHONPATH=. .venv/bin/python bench/openclaw_turns.py --turns 10 --tags-only   # serve.untagged_tool_calls off
    PYTHONPATH=. .venv/bin/python bench/openclaw_turns.py --turns 10 --lean --train  # judged and trained too
    PYTHONPATH=. .venv/bin/python bench/openclaw_turns.py --turns 10 --lean --train --judge engine --batch-size 1

It also prints the tool calls the policy made (from the served turns' records) and what OpenClaw
left in ``answer.txt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from clawray import openclaw
from clawray.ray_env import free_port

MESSAGES = [
    "Read homework.txt and tell me what it asks.",
    "Solve it. Reply with just the number.",
    "Write the answer into answer.txt.",
    "What is in answer.txt now?",
    "Now 9 + 6: just the number.",
    "Add that to answer.txt on a new line.",
    "How many lines does answer.txt have?",
    "What was the first question I asked you?",
    "Say thanks in one word.",
    "Summarise what we did in one sentence.",
]


def _wait_healthy(root: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"clawray serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{root}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(3)
    raise TimeoutError(f"clawray serve not healthy after {timeout_s} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.expanduser("~/.cache/clawray/models/qwen2.5-coder-0.5b-instruct"))
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--tags-only", action="store_true", help="serve.untagged_tool_calls=false")
    p.add_argument("--lean", action="store_true", help="OpenClaw's lean config (clawray.openclaw.write_config)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per reply OpenClaw asks for")
    p.add_argument("--train", action="store_true", help="run the training job (clawray run), not clawray serve")
    p.add_argument("--train-wait", type=float, default=900.0, help="--train: seconds to wait for the learners")
    p.add_argument("--batch-size", type=int, default=2, help="--train: samples per update (trainer.batch_size)")
    p.add_argument(
        "--judge",
        choices=("feedback", "engine"),
        default="feedback",
        help="--train: the job's judge; engine = the frozen policy as PRM judge on vLLM, one vote (judge.m=1)",
    )
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    ns = p.parse_args()

    port = free_port()
    root, url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/v1"
    run_dir = tempfile.mkdtemp(prefix="openclaw-bench-")
    cmd = [
        str(Path(sys.executable).parent / "clawray"),
        *(
            [
                "run",
                "conf/rl.yaml",
                "conf/cpu.yaml",
                "conf/openclaw.yaml",
                "conf/qwen-cpu.yaml",
                f"model.path={ns.model}",
                "env.enabled=false",
                "eval.enabled=false",
                "trainer.num_steps=-1",
                f"trainer.batch_size={ns.batch_size}",
                "checkpoint.save_at_exit=false",
                "learner.activation_checkpointing=true",
                "learner.max_tokens_per_micro_batch=4096",
                "rollout.kv_cache_gib=1.0",
                "learner.num_workers=1",  # two ranks and the engine outgrow 24 GiB at the first weight sync
                f"judge.backend={ns.judge}",
                *(["judge.engine_backend=vllm", "judge.m=1"] if ns.judge == "engine" else []),
            ]
            if ns.train
            else ["serve", ns.model, "conf/cpu.yaml", "conf/openclaw.yaml"]
        ),
        f"serve.port={port}",
        f"run_dir={run_dir}",
        f"rollout.prefix_caching={str(not ns.no_prefix_caching).lower()}",
        f"serve.untagged_tool_calls={str(not ns.tags_only).lower()}",
        f"serve.model_name={Path(ns.model).name}",
    ]
    server = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        _wait_healthy(root, server, 900)
        print(
            f"[bench] clawray {'run' if ns.train else 'serve'} healthy after {time.monotonic() - t0:.0f} s ({run_dir})",
            flush=True,
        )
        claw = dataclasses.replace(openclaw.install(), home_dir=Path(run_dir) / "openclaw-home")  # a fresh state
        workspace = Path(run_dir) / "workspace"
        served = openclaw.served_model(url, "x")
        openclaw.write_config(
            claw, url, served["id"], "x", served["max_model_len"], ns.max_tokens, workspace, lean=ns.lean
        )
        (workspace / "homework.txt").write_text("What is 7 + 8?\n")
        # OpenClaw keeps its sessions in its home (shared by every run): a fresh id starts a fresh
        # conversation instead of continuing the previous bench's
        session = f"bench-{uuid.uuid4().hex[:8]}"
        rows = []
        for k, message in enumerate(MESSAGES[: ns.turns]):
            before = httpx.get(f"{root}/health", timeout=30).json()["traffic"]["requests"]
            t = time.monotonic()
            argv = claw.command(
                ["agent", "--local", "--session-id", session, "-m", message, "--json", "--timeout", "900"]
            )
            done = subprocess.run(argv, env=claw.environment(), capture_output=True, text=True, timeout=1200)
            wall = time.monotonic() - t
            after = httpx.get(f"{root}/health", timeout=30).json()["traffic"]["requests"]
            rows.append({"turn": k + 1, "wall_s": round(wall, 1), "requests": after - before, "rc": done.returncode})
            print(
                f"[bench] turn {k + 1}: {wall:6.1f} s, {after - before} request(s), exit {done.returncode}", flush=True
            )
        traffic = httpx.get(f"{root}/health", timeout=30).json()["traffic"]
        trained = 0
        if ns.train:  # the learners take the queued samples in batches of --batch-size
            deadline = time.monotonic() + ns.train_wait
            while True:
                metrics = Path(run_dir) / "metrics.jsonl"
                rows_m = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
                trained = sum(m.get("samples", 0) for m in rows_m)
                traffic = httpx.get(f"{root}/health", timeout=30).json()["traffic"]
                if traffic["samples"] - trained < ns.batch_size or time.monotonic() > deadline:
                    break
                time.sleep(10)
            print(f"[bench] trained {trained} of {traffic['samples']} samples", flush=True)
        walls = [r["wall_s"] for r in rows]
        records = Path(run_dir) / "records" / "turns.jsonl"
        turns = [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []
        calls = [
            [c["function"]["name"] for c in t["response_message"].get("tool_calls") or []]
            for t in turns
            if t.get("kind", "main") == "main"
        ]
        answer = workspace / "answer.txt"
        result = {
            "prefix_caching": not ns.no_prefix_caching,
            "untagged_tool_calls": not ns.tags_only,
            "lean": ns.lean,
            "prompt_tokens": [len(t["prompt_ids"]) for t in turns if "prompt_ids" in t],
            "tool_calls": {
                "requests_with_calls": sum(bool(c) for c in calls),
                "recorded_turns": len(calls),
                "names": sorted({n for c in calls for n in c}),
            },
            "answer_txt": answer.read_text() if answer.exists() else None,
            "turns": rows,
            "first_turn_s": walls[0],
            "later_turns_mean_s": round(sum(walls[1:]) / max(1, len(walls) - 1), 1),
            "traffic": traffic,
            "trained_samples": trained if ns.train else None,
        }
        print(json.dumps(result, indent=1))
        if ns.out:
            Path(ns.out).write_text(json.dumps(result, indent=1))
        return 0
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
