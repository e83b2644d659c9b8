"""Token entropy is not behaviour diversity (the seed's §2.2.1), shown on the tiny model.

A policy-gradient run whose reward prefers ONE strategy, measured the way clawray measures it:
``inv/entropy`` (mean per-token entropy of the policy over the response tokens, nats, as the learner
logs it) and the behaviour monitor's ``inv/behaviour_entropy`` / ``inv/behaviour_distinct``
(:func:`clawray.algos.behaviour.behaviour_stats` over K replies at T = 1 for P fixed probe prompts).

The strategy: open the reply with an *empty first sentence* -- punctuation and a sentence end before
any word (``"):\\n..."``), behaviour signature ``"text:"``. On the tiny model's code-trained BPE vocab
some tokens do that on their own (``"):\\n"``, ``".\\n"``), so a random policy hits it now and then
and REINFORCE has a signal; the reward says nothing about the other tokens. Reward 1 for that
signature, else 0; GRPO advantages per prompt (:func:`clawray.algos.advantages.group_advantages`);
loss ``-mean_i A_i * mean_t log pi(y_t)`` (seq-mean-token-mean), Adam. Each step's K x P rollouts
are also the monitor's probe (same prompts, T = 1), measured before the update.

Two runs from the same initial weights: without a guard, then with clawray's token-entropy guard
(``learner.entropy_floor``: :class:`clawray.algos.invariants.EntropyController` raises an entropy
bonus ``coef * inv/entropy`` in the loss while ``inv/entropy`` is below the floor). What the seed
warns of: ``inv/behaviour_entropy`` falls from ln K towards 0 while ``inv/entropy`` stays up.
Measured on this tiny model (seed 0, defaults): without the guard the whole reply collapses, token
entropy with it (6.905 -> 0.003 nats by step 30, behaviour entropy 2.079 -> 0: the policy gradient
reinforces every token of the winning replies, and once the opening is fixed the rest sharpens
too). With the guard the two decouple only in phases: e.g. step 25, ``inv/entropy`` 4.619 (67% of
its start) while ``inv/behaviour_entropy`` is 0.462 (22% of ln K) -- the report's matrix would mark
token entropy ✓ (>= 0.5 x first) and behaviour ● -- but the run oscillates (the bonus also
re-widens the opening) rather than settling there. In-process (no Ray, one CPU thread), 1-2
minutes per run on a loaded 2-core machine.

    python bench/behaviour_collapse.py [--model DIR] [--steps 30] [--k 8] [--prompts 4] [--lr 1e-2]
        [--entropy-floor 6.5] [--coef-lr 0.05] [--coef-max 0.3] [--runs both|plain|guard]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time

import torch

from clawray.algos.advantages import group_advantages
from clawray.algos.behaviour import behaviour_stats, signature
from clawray.algos.invariants import EntropyController
from clawray.envs import make_env

TARGET = "text:"  # the rewarded behaviour: an empty first sentence


def rollouts(model, tok, prompt_ids: list[list[int]], k: int, max_tokens: int, seed: int):
    """K replies at T = 1 per prompt: ``[(prompt index, prompt ids, response ids, text)]``."""
    out = []
    for i, ids in enumerate(prompt_ids):
        torch.manual_seed(seed * 1_000_003 + i)
        gen = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_tokens,
            num_return_sequences=k,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        for row in gen[:, len(ids) :].tolist():
            resp = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
            resp = [t for t in resp if t != tok.pad_token_id] or [tok.eos_token_id]
            out.append((i, ids, resp, tok.decode(resp, skip_special_tokens=True)))
    return out


def loss_and_entropy(model, batch, advantages: torch.Tensor, coef: float):
    """REINFORCE loss (seq-mean-token-mean) minus ``coef`` x the mean per-token entropy, and that
    entropy (nats) over the batch's response tokens."""
    losses, ents = [], []
    for (_, ids, resp, _), a in zip(batch, advantages):
        x = torch.tensor([ids + resp])
        logits = model(x).logits[0, len(ids) - 1 : -1].float()  # [R, V]: the logits that sampled resp
        logp = torch.log_softmax(logits, -1)
        token_logp = logp.gather(-1, torch.tensor(resp)[:, None])[:, 0]
        ents.append(-(logp.exp() * logp).sum(-1))
        losses.append(-a * token_logp.mean())
    ent = torch.cat(ents).mean()
    return torch.stack(losses).mean() - coef * ent, ent.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="a model folder (default: build the tiny model)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--k", type=int, default=8, help="replies per probe prompt")
    ap.add_argument("--prompts", type=int, default=4, help="probe prompts (the brief env's train prompts)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--entropy-floor", type=float, default=6.5, help="nats, the guarded run's floor")
    ap.add_argument("--coef-lr", type=float, default=0.05, help="the controller's step per nat below the floor")
    ap.add_argument("--coef-max", type=float, default=0.3)
    ap.add_argument("--runs", choices=("both", "plain", "guard"), default="both")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    path = args.model
    if not path:
        from clawray.model_folders import build_tiny_model

        path = build_tiny_model(tempfile.mkdtemp(prefix="clawray-tiny-"), seed=args.seed)
    tok = AutoTokenizer.from_pretrained(path)
    env = make_env("brief")
    probes = [env.opening(p) for p in env.prompts("train", seed=args.seed)[: args.prompts]]
    prompt_ids = [
        list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)) for m in probes
    ]
    print(
        f"[collapse] model {path}, P={args.prompts} probe prompts x K={args.k} replies at T=1, reward 1 for {TARGET!r}"
    )
    floors = {"plain": [0.0], "guard": [args.entropy_floor], "both": [0.0, args.entropy_floor]}[args.runs]
    for floor in floors:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ctl = EntropyController(coef=0.0, floor=floor, lr=args.coef_lr, max_coef=args.coef_max)
        print(f"\n[collapse] run: {'no guard' if not floor else f'entropy floor {floor} nats'}, lr {args.lr}")
        run(model, tok, prompt_ids, ctl, args)


def run(model, tok, prompt_ids, ctl: EntropyController, args) -> None:
    """One policy-gradient run; prints one row per step (measured before the step's update)."""
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    print(
        "step | hit rate | inv/entropy | inv/entropy_coef | inv/behaviour_entropy | inv/behaviour_distinct | inv/self_similarity"
    )
    t0 = time.time()
    for step in range(args.steps + 1):
        model.eval()
        with torch.no_grad():
            batch = rollouts(model, tok, prompt_ids, args.k, args.max_tokens, args.seed + step)
        groups = [[{"role": "assistant", "content": b[3]} for b in batch if b[0] == i] for i in range(len(prompt_ids))]
        beh = behaviour_stats(groups)
        rewards = torch.tensor([1.0 if signature({"content": b[3]}) == TARGET else 0.0 for b in batch])
        adv = group_advantages(rewards, torch.tensor([b[0] for b in batch]))
        model.train()
        coef = ctl.coef
        loss, ent = loss_and_entropy(model, batch, adv, coef)
        print(
            f"{step:4d} | {rewards.mean().item():8.3f} | {ent:11.3f} | {coef:16.3f} | {beh['inv/behaviour_entropy']:21.3f} | "
            f"{beh['inv/behaviour_distinct']:22.3f} | {beh['inv/self_similarity']:.3f}",
            flush=True,
        )
        if step < args.steps:  # the last row is measured only
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctl.update(ent)
    print(f"[collapse] ln K = {math.log(args.k):.3f} nats (all K replies distinct); {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
