"""Learner throughput: tokens/s of clawray's ``train_step`` (FSDP2, 1 and 2 ranks) against a plain
single-process PyTorch loop (forward + backward + AdamW) over the same samples.

Samples: ``--batch`` random-token samples with the demo's sequence lengths (prompt 40-120 tokens:
SmolLM2's chat template with its default system prompt, one or two turns of the ``brief`` task;
response 4-48 tokens: ``env.max_tokens: 48``), fixed seed. Tokens = prompt + response tokens of the
batch (padding not counted). Each measurement runs ``--steps`` steps after ``--warmup`` steps (5:
start-up; on this VM the first touch of memory that another process just freed can cost ten times
its usual system time: a 2-rank group's first two steps after the 1-rank group took 8-11 s of it per
rank, and a learner's heap keeps growing, with fewer page faults each step, until about the fifth
step; the steady step 0.3-0.4 s) and reports the median step's tokens/s:

* ``plain``: one process, ``--threads`` torch threads, the HF model in fp32, one padded forward of
  the whole batch, the token-mean policy-gradient loss ``-A * logprob`` over the response tokens
  (log-softmax on the response positions only, as clawray's loss does),
  backward, grad-norm clip 1.0, ``torch.optim.AdamW`` step (fused, as clawray's ``learner.optimizer_impl``). This machine's reference for the same
  arithmetic without Ray, FSDP2 or clawray's loss bookkeeping.
* ``clawray 1 rank`` / ``clawray 2 ranks``: :class:`clawray.actors.learner.LearnerGroup`
  ``train_step`` wall time seen by the driver (each rank ``--threads`` torch threads,
  ``fsdp_size`` and ``reshard_after_forward`` as ``conf/cpu.yaml`` sets them; 2 ranks share the machine's cores, so on 2
  cores their scaling is bounded by the cores, not by clawray), with the step's ``perf/padding_frac``.

The last line is the ratio clawray 1 rank / plain (target >= 0.9) and the 2-rank scaling; with
``--runs N`` (issue #29: the median of 5) the whole measurement repeats N times and the last line
gives each ratio's median over the runs with its spread (min-max).

    nice -n 19 env PYTHONPATH=. python bench/learner_throughput.py                      # tiny model
    nice -n 19 env PYTHONPATH=. python bench/learner_throughput.py --model ~/.cache/clawray/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch


def make_samples(n: int, vocab: int, seed: int = 0):
    """``n`` samples of random tokens with the demo's lengths (prompt 40-120, response 4-48 tokens)."""
    from clawray.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        p = int(torch.randint(40, 121, (1,), generator=g))
        r = int(torch.randint(4, 49, (1,), generator=g))
        tokens = torch.randint(10, vocab, (p + r,), generator=g).tolist()
        out.append(
            Sample(
                tokens=tokens,
                prompt_len=p,
                loss_mask=[1] * r,
                rollout_logprobs=[-7.0] * r,
                reward=1.0 if k % 2 else -1.0,
                policy_version=0,
            )
        )
    return out


def plain_loop(model_path: str, samples: list, steps: int, threads: int, lr: float, warmup: int) -> list[float]:
    """Seconds per step of the plain single-process loop (see the module doc), after ``warmup`` steps."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0, fused=True)
    longest = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    attn = torch.zeros(len(samples), longest, dtype=torch.long)
    rows, cols, adv = [], [], []  # the response positions (row b, column t predicts token t + 1)
    for b, s in enumerate(samples):
        ids[b, : len(s.tokens)] = torch.tensor(s.tokens)
        attn[b, : len(s.tokens)] = 1
        rows += [b] * s.response_len
        cols += list(range(s.prompt_len - 1, len(s.tokens) - 1))
        adv += [s.reward] * s.response_len
    rows, cols, adv = torch.tensor(rows), torch.tensor(cols), torch.tensor(adv)
    targets = ids[rows, cols + 1]
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=attn).logits[rows, cols].float()  # [N, V], response only
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
        loss = -(adv * logp).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    return times[warmup:]


def clawray_steps(
    model_path: str, refs: list, steps: int, ranks: int, threads: int, lr: float, warmup: int
) -> tuple[list, dict]:
    """Seconds per ``LearnerGroup.train_step`` (driver wall time) after ``warmup`` steps, and the last step's metrics."""
    from clawray.actors.learner import LearnerGroup
    from clawray.ray_env import free_port

    cfg = {
        "num_workers": ranks,
        "num_cpus": 0.25,
        "torch_threads": threads,
        "lr": lr,
        "reshard_after_forward": cpu_preset().learner.reshard_after_forward,
        "fsdp_size": cpu_preset().learner.fsdp_size,
    }
    group = LearnerGroup(model_path, cfg, free_port())
    try:
        times, metrics = [], {}
        for v in range(warmup + steps):
            t0 = time.perf_counter()
            metrics = group.train_step(refs, v + 1)
            times.append(time.perf_counter() - t0)
        return times[warmup:], metrics
    finally:
        group.shutdown()


def cpu_preset():
    """``conf/cpu.yaml``, the CPU preset whose learner settings the clawray rows use."""
    from omegaconf import OmegaConf

    return OmegaConf.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "conf", "cpu.yaml"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF folder (default: build the tiny model)")
    ap.add_argument("--batch", type=int, default=8, help="samples per step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before them (start-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (conf/cpu.yaml: 1)")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--runs", type=int, default=1, help="repeat the whole measurement; ratios are medians over runs")
    ap.add_argument("--json", default="", help="also write the figures as JSON here (bench/summary.py)")
    args = ap.parse_args()
    if args.runs < 1 or args.steps < 1 or args.warmup < 0:
        ap.error(
            f"--runs {args.runs}, --steps {args.steps}, --warmup {args.warmup}: need runs, steps >= 1, warmup >= 0"
        )

    import ray
    from transformers import AutoConfig

    from clawray.model_folders import build_tiny_model
    from clawray.ray_env import init_ray

    model = args.model and os.path.expanduser(args.model) or build_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"))
    samples = make_samples(args.batch, AutoConfig.from_pretrained(model).vocab_size)
    tokens = sum(len(s.tokens) for s in samples)
    print(
        f"model={model} batch={args.batch} tokens/step={tokens} steps={args.steps} warmup={args.warmup} "
        f"threads={args.threads} runs={args.runs}"
    )
    lr = 1e-5
    runs = []  # per run: {"plain": tokens/s, "ranks": {n: tokens/s}}
    for k in range(args.runs):  # plain first, without Ray running, as a lone training script would be
        tag = f"run {k + 1}/{args.runs} " if args.runs > 1 else ""
        plain = tokens / statistics.median(plain_loop(model, samples, args.steps, args.threads, lr, args.warmup))
        print(f"{tag}{'plain':>16}: {plain:9.1f} tokens/s", flush=True)
        init_ray("", 2)
        refs = [ray.put(s) for s in samples]
        rates = {}
        for n in [int(x) for x in args.ranks.split(",")]:
            times, m = clawray_steps(model, refs, args.steps, n, args.threads, lr, args.warmup)
            rates[n] = tokens / statistics.median(times)
            print(
                f"{tag}{f'clawray {n} rank(s)':>16}: {rates[n]:9.1f} tokens/s  perf/padding_frac "
                f"{m['perf/padding_frac']:.3f}  micro_batches {m['micro_batches']:.0f}",
                flush=True,
            )
        runs.append({"plain": plain, "ranks": rates})
        ray.shutdown()
    ratios = run_ratios(runs)
    print(
        "; ".join(
            f"{name} = {statistics.median(v):.2f}"
            + (f" ({min(v):.2f}-{max(v):.2f}, {len(v)} runs)" if len(v) > 1 else "")
            for name, v in (("clawray 1 rank / plain", ratios["1_vs_plain"]), ("2 ranks / 1 rank", ratios["2_vs_1"]))
            if v
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "tokens_per_step": tokens,
                    "plain_tokens_per_s": statistics.median(r["plain"] for r in runs),
                    "ranks_tokens_per_s": {n: statistics.median(r["ranks"][n] for r in runs) for n in runs[0]["ranks"]},
                    "ratios": ratios,
                    "runs": runs,
                },
                f,
            )


def run_ratios(runs: list[dict]) -> dict[str, list[float]]:
    """Per run, clawray 1 rank / plain and 2 ranks / 1 rank (each list empty when a rank count was not run)."""
    return {
        "1_vs_plain": [r["ranks"][1] / r["plain"] for r in runs if 1 in r["ranks"]],
        "2_vs_1": [r["ranks"][2] / r["ranks"][1] for r in runs if 1 in r["ranks"] and 2 in r["ranks"]],
    }


if __name__ == "__main__":
    sys.exit(main())
