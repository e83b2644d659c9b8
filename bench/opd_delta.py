"""Does the hinted teacher move the right tokens? OPD's token advantage on real SmolLM2 turns.

For a few prompts that draw markdown from SmolLM2-135M-Instruct, sample a reply (rollout log-probs at
T = 1), then score the *same* reply ids under the prompt with a corrective hint appended (the frozen
initial policy as teacher, as in ``conf/opd.yaml``), with the hint in the last user message
(``opd.hint_placement=user``, OpenClaw-RL) and in the system message (``system``). Prints, per turn,
placement and overall, the mean
``Δ = teacher_logprob - rollout_logprob`` on markdown tokens (the offending ones: list markers,
``*``, ``#``) and on the other tokens, and the fraction of tokens with Δ > 0.

    python bench/opd_delta.py [--model ~/.cache/clawray/models/smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import os

import torch

from clawray.actors.teacher import DEFAULT_HINT_TEMPLATE, hinted_messages
from clawray.engines.base import GenerateRequest
from clawray.engines.hf import HFBackend

PROMPTS = [
    "List three fruits and one fact about each.",
    "Give me the steps to make a cup of tea.",
    "What are the main parts of a computer?",
    "Summarize the benefits of exercise.",
    "Name four planets and describe them briefly.",
    "How do I prepare for a job interview?",
    "What should I pack for a weekend hiking trip?",
    "Compare cats and dogs as pets.",
    "Explain how to start learning to code.",
    "What are good habits for better sleep?",
    "Give tips for saving money each month.",
    "Describe the water cycle.",
]
HINT = "No markdown please: answer in plain sentences, without lists, bullets, numbering, bold or headings."
_MARKS = {"**", "*", "#", "##", "###", "-", "•"}


def offending(pieces: list[str]) -> list[bool]:
    """Markdown tokens: bold/heading markers anywhere, and list markers (``-``, ``*``, digits) that
    open a line (a mid-word hyphen is not markdown)."""
    out = []
    for i, p in enumerate(pieces):
        line_start = i == 0 or pieces[i - 1].endswith("\n")
        s = p.strip()
        out.append(s in ("**", "#", "##", "###") or (line_start and (s in _MARKS or s.isdigit())))
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=os.path.expanduser("~/.cache/clawray/models/smollm2-135m-instruct"))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--placement", default="both", choices=["user", "system", "both"],
                        help="where the teacher sees the hint (opd.hint_placement)")
    args = parser.parse_args()
    placements = ["user", "system"] if args.placement == "both" else [args.placement]
    torch.set_num_threads(2)
    engine = HFBackend(args.model, seed=0)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(args.model)
    stop = [tok.convert_tokens_to_ids(tok.eos_token)]
    stats = {p: {"md": [], "other": [], "positive": 0, "total": 0} for p in placements}
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    print("| turn | placement | tokens | markdown tokens | mean Δ markdown | mean Δ other | frac Δ>0 |")
    print("|---|---|---|---|---|---|---|")
    for i, prompt in enumerate(PROMPTS):
        messages = [{"role": "user", "content": prompt}]
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)
        out = engine.generate([GenerateRequest(ids, max_tokens=args.max_tokens, temperature=1.0, seed=i,
                                               stop_token_ids=stop)])[0]
        flags = offending([tok.decode([t]) for t in out.response_ids])
        for placement in placements:
            hinted = hinted_messages(messages, HINT, DEFAULT_HINT_TEMPLATE, placement)
            teacher_ids = tok.encode(tok.apply_chat_template(hinted, add_generation_prompt=True, tokenize=False),
                                     add_special_tokens=False)
            teacher = engine.score(teacher_ids, out.response_ids, 1.0)
            delta = [t - r for t, r in zip(teacher, out.logprobs)]
            md = [d for d, f in zip(delta, flags) if f]
            other = [d for d, f in zip(delta, flags) if not f]
            st = stats[placement]
            st["md"] += md
            st["other"] += other
            st["positive"] += sum(d > 0 for d in delta)
            st["total"] += len(delta)
            print(f"| {i} | {placement} | {len(delta)} | {len(md)} | {mean(md):+.3f} | {mean(other):+.3f} | "
                  f"{sum(d > 0 for d in delta) / len(delta):.2f} |", flush=True)
    print()
    for placement, st in stats.items():
        print(f"overall ({placement}): {st['total']} tokens, {len(st['md'])} markdown; mean Δ markdown "
              f"{mean(st['md']):+.3f}, mean Δ other {mean(st['other']):+.3f}, mean Δ all "
              f"{mean(st['md'] + st['other']):+.3f}, fraction Δ>0 {st['positive'] / max(st['total'], 1):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
