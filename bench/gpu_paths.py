"""clawray's GPU-only code paths, run for real in one process: what a short GPU window can answer.

The learner's CUDA branch (NCCL group, FSDP2 with bf16 compute over fp32 master weights), the hf
engine on CUDA in bf16 and float32, the engine/learner log-prob gap that the job logs as
``inv/logprob_mismatch_kl`` (:meth:`LearnerWorker.probe_invariants`, clawray's own k3 estimate),
three PPO updates, and the learner's full weights loaded into the engine bit-exact. No Ray and no
vLLM are needed (a machine lent for minutes has neither): without Ray, a stub stands in for the three
calls the learner makes outside an actor (``ray.remote``, ``ray.get`` of plain samples, the node
address), so the code that runs is clawray's own.

    python bench/gpu_paths.py --model FOLDER --out runs/gpu-paths.json     # on a CUDA machine
    python bench/gpu_paths.py --device cpu --stub-ray                      # the same checks on a CPU

``FOLDER`` is an HF model folder (SmolLM2-135M-Instruct: ``clawray.model_folders.convert_smollm2``);
without ``--model`` the tests' tiny random model is built. Prints one table (check, ok/FAIL,
figures) and writes every figure as JSON; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def stub_ray() -> None:
    """A ``ray`` module holding only what the learner and hf engine touch outside an actor."""
    ray = types.ModuleType("ray")
    exceptions = types.ModuleType("ray.exceptions")
    util = types.ModuleType("ray.util")

    class RayError(Exception):
        pass

    exceptions.RayError, exceptions.GetTimeoutError = RayError, TimeoutError
    util.get_node_ip_address = lambda: "127.0.0.1"
    ray.remote = lambda *a, **k: a[0] if len(a) == 1 and not k else (lambda cls: cls)
    ray.get = lambda refs, timeout=None: refs  # the samples are passed as themselves, not as ObjectRefs
    ray.wait = lambda refs, timeout=None, **_: (list(refs), [])
    ray.is_initialized = lambda: False
    ray.exceptions, ray.util = exceptions, util
    sys.modules.update({"ray": ray, "ray.exceptions": exceptions, "ray.util": util})


def prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` chat prompts (the brief task's kind of question) as token ids."""
    msgs = [
        [{"role": "user", "content": f"What is {7 + i} + {3 * i % 11}? Reply with just the number."}] for i in range(n)
    ]
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def sample_replies(backend, prompt_ids: list[list[int]], max_tokens: int, temperature: float) -> tuple[list, float]:
    """Sample one reply per prompt through the backend's step loop; ``([(ids, logprobs)], tokens/s)``."""
    from clawray.engines.base import GenerateRequest

    for key, p in enumerate(prompt_ids):
        backend.add(key, GenerateRequest(p, max_tokens=max_tokens, temperature=temperature, seed=key))
    out, t0 = {}, time.perf_counter()
    while len(out) < len(prompt_ids):
        out.update(backend.step().finished)
    secs = time.perf_counter() - t0
    replies = [(out[k].response_ids, out[k].logprobs) for k in range(len(prompt_ids))]
    return replies, sum(len(r[0]) for r in replies) / secs


def as_samples(prompt_ids, replies, temperature: float, version: int, rewards=None) -> list:
    from clawray.types import Sample

    return [
        Sample(
            tokens=list(p) + list(ids),
            prompt_len=len(p),
            loss_mask=[1] * len(ids),
            rollout_logprobs=[float(x) for x in lps],
            reward=None if rewards is None else rewards[i],
            policy_version=version,
            temperature=temperature,
        )
        for i, (p, (ids, lps)) in enumerate(zip(prompt_ids, replies))
        if ids
    ]


def mismatch_per_token(samples: list, backend) -> float:
    """clawray's k3 ``KL(rollout || scorer)`` per token (:func:`~clawray.algos.invariants.mismatch_kl_sum`)
    of the samples' rollout log-probs against ``backend``'s scoring of the same ids."""
    import torch

    from clawray.algos.invariants import mismatch_kl_sum

    kl = tokens = 0.0
    for s in samples:
        rollout = torch.tensor(s.rollout_logprobs, dtype=torch.float64)
        scored = torch.tensor(backend.logprobs(s.tokens[: s.prompt_len], s.tokens[s.prompt_len :]), dtype=torch.float64)
        kl += float(mismatch_kl_sum(rollout, scored, torch.ones_like(rollout)))
        tokens += len(rollout)
    return kl / tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF model folder (default: build the tiny model)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--stub-ray", action="store_true", help="use the ray stub even where Ray is installed")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="runs/gpu-paths.json")
    args = ap.parse_args()
    try:
        if args.stub_ray:
            raise ImportError
        import ray  # noqa: F401
    except ImportError:
        stub_ray()
    import torch
    from transformers import AutoTokenizer

    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the learner picks CUDA whenever torch sees it
    elif not torch.cuda.is_available():
        print("torch sees no CUDA device: use --device cpu", file=sys.stderr)
        return 2
    from clawray.actors.learner import LearnerWorker
    from clawray.engines.hf import HFBackend

    figures: dict = {}
    rows: list[tuple[str, bool, str]] = []

    def check(name: str, fn) -> None:
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            ok, text, data = fn()
        except Exception:  # one failure must not hide the other checks
            traceback.print_exc()
            ok, text, data = False, "raised (traceback above)", {}
        data["seconds"] = round(time.perf_counter() - t0, 2)
        figures[name] = data
        rows.append((name, ok, f"{text} ({data['seconds']} s)"))
        print(f"   {'ok' if ok else 'FAIL'}: {text}", flush=True)

    tmp = tempfile.mkdtemp(prefix="gpu-paths-")
    model = args.model
    if not model:
        from clawray.model_folders import build_tiny_model

        model = build_tiny_model(os.path.join(tmp, "tiny"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_ids = prompts(tokenizer, args.prompts)
    state: dict = {}

    def machine():
        d = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": args.device, "model": model}
        if args.device == "cuda":
            p = torch.cuda.get_device_properties(0)
            d |= {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)}
        import transformers

        d["transformers"] = transformers.__version__
        return True, " | ".join(f"{k} {v}" for k, v in d.items()), d

    def learner():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = {"num_workers": 1, "lr": 1e-5, "torch_threads": max(1, (os.cpu_count() or 2) // 2)}
        worker = LearnerWorker(0, 1, port, model, cfg)
        worker.join(*worker.rendezvous_address())
        import torch.distributed as dist

        param = next(worker.model.parameters())
        mp = getattr(worker.model, "_get_fsdp_state", None)
        d = {
            "backend": dist.get_backend(),
            "param_dtype": str(param.dtype),
            "param_device": str(param.device),
            "mixed_precision": str(mp()._mp_policy) if mp else "",
        }
        state["learner"] = worker
        want = ("nccl", "cuda") if args.device == "cuda" else ("gloo", "cpu")
        ok = d["backend"] == want[0] and want[1] in d["param_device"] and d["param_dtype"] == "torch.float32"
        if args.device == "cuda":
            ok = ok and "bfloat16" in d["mixed_precision"]
        return ok, f"{d['backend']}, master {d['param_dtype']} on {d['param_device']}, {d['mixed_precision']}", d

    def gap(dtype: str):
        def run():
            backend = HFBackend(model, dtype=dtype, device=args.device, seed=0)
            replies, tps = sample_replies(backend, prompt_ids, args.max_tokens, 1.0)
            samples = as_samples(prompt_ids, replies, 1.0, state["learner"].version)
            # the engine scoring its own samples: its sampling and its scoring forward agree
            scored = [backend.logprobs(s.tokens[: s.prompt_len], s.tokens[s.prompt_len :]) for s in samples]
            self_gap = max(abs(a - b) for s, sc in zip(samples, scored) for a, b in zip(s.rollout_logprobs, sc))
            probe = state["learner"].probe_invariants(samples)
            d = {"tokens_per_s": round(tps, 1), "engine_self_gap_max": self_gap} | probe
            text = ""
            if "samples" in state and dtype == "float32":  # an fp32 learner scoring the bf16 engine's replies
                fp32_kl = mismatch_per_token(state["samples"], backend)
                d["bf16_engine_vs_fp32_scorer_kl"] = fp32_kl
                text = f"; bf16 engine's replies vs fp32 scoring k3 KL {fp32_kl:.2e}/token"
            state.setdefault("samples", samples)
            state.setdefault("backend", backend)
            ok = math.isfinite(probe["mismatch_kl"]) and probe["tokens"] > 0
            return (
                ok,
                (
                    f"engine {dtype}: {tps:.0f} tokens/s; learner vs engine k3 KL {probe['mismatch_kl']:.2e}/token over "
                    f"{probe['tokens']} tokens, entropy {probe['entropy']:.3f}; sampled vs scored max |d| {self_gap:.1e}{text}"
                ),
                d,
            )

        return run

    def updates():
        worker, samples = state["learner"], state["samples"]
        for i, s in enumerate(samples):
            s.reward = 1.0 if i % 2 == 0 else -1.0
        before = {k: v.detach().float().cpu().clone() for k, v in worker.state_dict().items()}
        steps = []
        for v in (1, 2, 3):
            t0 = time.perf_counter()
            m = worker.train_step(samples, v, advantages=[s.reward for s in samples])
            steps.append(
                {k: float(x) for k, x in m.items() if isinstance(x, (int, float))} | {"s": time.perf_counter() - t0}
            )
        after = worker.state_dict()
        moved = sum(not torch.equal(before[k], after[k].detach().float().cpu()) for k in before)
        tokens = sum(s.response_len for s in samples)
        finite = all(math.isfinite(st.get("loss", math.nan)) for st in steps)
        d = {"steps": steps, "tensors_moved": moved, "tensors": len(before), "response_tokens": tokens}
        if args.device == "cuda":
            d["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        losses = ", ".join(f"{st.get('loss', math.nan):.4f}" for st in steps)
        text = (
            f"loss {losses}; {moved}/{len(before)} tensors moved; "
            f"{tokens / steps[-1]['s']:.0f} response tokens/s (step 3)"
        )
        return finite and moved > 0, text, d

    def load_into_engine():
        worker, backend = state["learner"], state["backend"]
        t0 = time.perf_counter()
        full = worker.state_dict()
        gather_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        backend.load_weights(full.items())
        load_s = time.perf_counter() - t0
        engine = backend.model.state_dict()
        dtype = next(iter(engine.values())).dtype
        bad = [k for k, v in full.items() if not torch.equal(engine[k], v.to(engine[k].device, dtype))]
        gb = sum(v.numel() * v.element_size() for v in full.values()) / 1e9
        d = {"gather_s": gather_s, "load_s": load_s, "gb": gb, "mismatched": bad[:5], "tensors": len(full)}
        return (
            not bad,
            f"{len(full)} tensors, {gb:.2f} GB: gather {gather_s:.2f} s, load {load_s:.2f} s; {len(bad)} differ",
            d,
        )

    check("1 machine", machine)
    check("2 learner group", learner)
    if "learner" in state:
        check("3 engine bfloat16 vs learner", gap("bfloat16"))
        check("4 engine float32 vs learner", gap("float32"))
    if "samples" in state:
        check("5 three PPO updates", updates)
        check("6 learner weights into the engine", load_into_engine)

    width = max(len(r[0]) for r in rows)
    print("\n| check | ok | figures |\n|---|---|---|")
    for name, ok, text in rows:
        print(f"| {name:<{width}} | {'ok' if ok else 'FAIL'} | {text} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(figures, indent=1, default=str))
    print(f"figures: {args.out}")
    return 0 if rows and all(ok for _, ok, _ in rows) and len(rows) == 6 else 1


if __name__ == "__main__":
    sys.exit(main())
