"""Does the hinted teacher move the right tokens? OPD's token advantage on real SmolLM2 turns.

For each prompt, sample replies from SmolLM2-135M-Instruct at T = 1 (rollout log-probs) and keep the
first one a user would correct. The user's corrective next state goes through the production hint
path: the ``feedback`` hint judge (``JudgeWorker.hint``; the correction itself is the hint) and
``TeacherWorker.teacher_prompt_ids`` (the frozen initial policy as teacher, as in ``conf/opd.yaml``;
the hint in the last user message, ``opd.hint_placement=user`` as in OpenClaw-RL, or in the system
message). The teacher scores the *same* reply ids under that prompt. Per turn and
overall it prints ``Δ = teacher_logprob - rollout_logprob`` (OPD's advantage, OpenClaw-RL §4) on the
offending tokens and on the other tokens, Δ at the *decision token* (the first offending one), and
the fraction of tokens with Δ > 0. The expected direction is Δ(offending) < Δ(other). As a control,
Δ at the decision token is also taken under a neutral hint of the same form ("Be friendly and
polite."): it separates what the hint *says* from the shift any added text causes.

Two corrections:

- ``fact``: a short factual question ("... Answer in one sentence."); a wrong reply (it lacks the
  answer) meets the next state "No, that's wrong: the correct answer is <answer>." Offending tokens: the
  capitalised words or numbers of the reply that the question does not hold and that do not open a
  sentence (the wrong name or number it claims).
- ``markdown``: a how-to question; a reply with markdown meets "No markdown please: answer in plain
  sentences, without lists, bullets, numbering, bold or headings." Offending tokens:
  bold and heading markers, and list markers that open a line.

``--follow`` adds the premise check: how often the *teacher itself* avoids the offending behaviour
when it samples with the hint, against without. A teacher that does not follow its hint has nothing
to distil, whatever the plumbing.

    python bench/opd_delta.py [--case fact|markdown|both] [--placement user|system|both] [--follow]
                              [--engine vllm|hf] [--show]

The vLLM engine (the default; fp32, the ``vllm`` extra) also exercises the teacher's
``prompt_logprobs`` path; ``--engine hf`` needs only transformers. Figures: ``docs/opd.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from clawray.actors.judge import JudgeWorker
from clawray.actors.teacher import TeacherWorker
from clawray.engines.base import GenerateRequest
from clawray.types import Turn

FACTS = [  # (question, accepted answers); the first answer goes in the hint
    ("What is the capital of Australia?", ["Canberra"]),
    ("What is the capital of Canada?", ["Ottawa"]),
    ("What is the capital of Brazil?", ["Brasília", "Brasilia"]),
    ("What is the capital of Turkey?", ["Ankara"]),
    ("What is the capital of Switzerland?", ["Bern"]),
    ("What is the capital of Nigeria?", ["Abuja"]),
    ("What is the capital of New Zealand?", ["Wellington"]),
    ("What is the capital of Morocco?", ["Rabat"]),
    ("Who wrote the novel Frankenstein?", ["Mary Shelley"]),
    ("Who painted the Mona Lisa?", ["Leonardo da Vinci", "Leonardo"]),
    ("How many legs does a spider have?", ["8", "eight"]),
    ("How many players does a soccer team have on the field?", ["11", "eleven"]),
]
SHORT = " Answer in one sentence."
HOWTO = [
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
NO_MARKDOWN = "No markdown please: answer in plain sentences, without lists, bullets, numbering, bold or headings."
NEUTRAL = "Be friendly and polite."
_NUMBER_WORDS = {"one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"}


def markdown_tokens(pieces: list[str]) -> list[bool]:
    """Per token: a bold/heading marker anywhere, or a list marker (``-``, ``*``, ``•``, digits) that
    opens a line (a mid-word hyphen is not markdown)."""
    out = []
    for i, p in enumerate(pieces):
        line_start = i == 0 or pieces[i - 1].endswith("\n")
        s = p.strip()
        out.append(s in ("**", "#", "##", "###") or (line_start and (s in {"*", "-", "•"} or s.isdigit())))
    return out


def claim_tokens(pieces: list[str], question: str) -> list[bool]:
    """Per token: part of a word the reply claims, a capitalised word or a number that the question
    does not hold and that does not open a sentence (``I`` excluded)."""
    text = "".join(pieces)
    asked = {w.lower() for w in re.findall(r"\w+", question)}
    spans = []
    for m in re.finditer(r"\w+", text):
        word, before = m.group(), text[: m.start()].rstrip()
        opens_sentence = not before or before[-1] in ".!?:\n\"'("
        claimed = word[0].isupper() and not opens_sentence and word != "I"
        number = word.isdigit() or word.lower() in _NUMBER_WORDS
        if (claimed or number) and word.lower() not in asked:
            spans.append((m.start(), m.end()))
    out, pos = [], 0
    for p in pieces:
        start, pos = pos, pos + len(p)
        out.append(any(a < pos and start < b for a, b in spans))
    return out


@dataclass
class Case:
    """A correction: which replies a user corrects, the hint a judge would extract, the offending tokens."""

    name: str
    prompts: list[str]
    offending: Callable[[list[str], str], list[bool]]  # (token pieces, prompt) -> per-token flag
    correction: Callable[[str], str]  # prompt -> the user's corrective next message
    wrong: Callable[[str, str], bool] = lambda prompt, text: True  # beyond holding offending tokens


def _answers(prompt: str) -> list[str]:
    return dict((q + SHORT, a) for q, a in FACTS)[prompt]


CASES = {
    "fact": Case(
        "fact",
        [q + SHORT for q, _ in FACTS],
        offending=claim_tokens,
        correction=lambda p: f"No, that's wrong: the correct answer is {_answers(p)[0]}.",
        wrong=lambda p, text: not any(a.lower() in text.lower() for a in _answers(p)),
    ),
    "markdown": Case(
        "markdown", HOWTO, offending=lambda pieces, p: markdown_tokens(pieces), correction=lambda p: NO_MARKDOWN
    ),
}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


@dataclass
class Tally:
    """Δ statistics of one case and placement over its turns."""

    offending: list[float] = field(default_factory=list)
    other: list[float] = field(default_factory=list)
    decision: list[float] = field(default_factory=list)  # Δ at each turn's first offending token
    neutral: list[float] = field(default_factory=list)  # the same token under the neutral hint
    ordered: int = 0  # turns with mean Δ offending < mean Δ other

    def add(self, delta: list[float], flags: list[bool], neutral_first: float) -> str:
        """Count one turn; returns its table cells."""
        off = [d for d, f in zip(delta, flags) if f]
        other = [d for d, f in zip(delta, flags) if not f]
        self.offending += off
        self.other += other
        self.decision.append(off[0])
        self.neutral.append(neutral_first)
        self.ordered += _mean(off) < _mean(other)
        positive = sum(d > 0 for d in delta) / len(delta)
        return (
            f"{len(delta)} | {len(off)} | {_mean(off):+.3f} | {_mean(other):+.3f} | {off[0]:+.3f} | "
            f"{neutral_first:+.3f} | {positive:.2f}"
        )

    def summary(self) -> str:
        every = self.offending + self.other
        turns = len(self.decision)
        return (
            f"{turns} turns, {len(every)} tokens, {len(self.offending)} offending; mean Δ offending "
            f"{_mean(self.offending):+.3f}, other {_mean(self.other):+.3f}, all {_mean(every):+.3f}; mean Δ at "
            f"the decision token {_mean(self.decision):+.3f} ({sum(d < 0 for d in self.decision)}/{turns} "
            f"negative; neutral hint {_mean(self.neutral):+.3f}); fraction Δ>0 "
            f"{sum(d > 0 for d in every) / max(len(every), 1):.2f}; turns with Δ offending < Δ other "
            f"{self.ordered}/{turns}"
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=os.path.expanduser("~/.cache/clawray/models/smollm2-135m-instruct"))
    parser.add_argument("--case", default="both", choices=["fact", "markdown", "both"])
    parser.add_argument(
        "--placement",
        default="user",
        choices=["user", "system", "both"],
        help="where the teacher sees the hint (opd.hint_placement)",
    )
    parser.add_argument("--engine", default="vllm", choices=["hf", "vllm"], help="vllm (fp32) is ~4x faster on CPU")
    parser.add_argument("--tries", type=int, default=8, help="replies sampled per prompt to find one to correct")
    parser.add_argument("--follow", action="store_true", help="also sample from the hinted teacher context")
    parser.add_argument("--show", action="store_true", help="print each reply, offending tokens [bracketed], with Δ")
    args = parser.parse_args()
    cases = list(CASES.values()) if args.case == "both" else [CASES[args.case]]
    placements = ["user", "system"] if args.placement == "both" else [args.placement]
    torch.set_num_threads(2)
    if args.engine == "vllm":
        from clawray.engines.vllm import VLLMBackend

        engine = VLLMBackend(args.model, dtype="float32", max_model_len=1024, seed=0)
    else:
        from clawray.engines.hf import HFBackend

        engine = HFBackend(args.model, seed=0)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(args.model)
    teachers = {p: TeacherWorker(engine, args.model, {"hint_placement": p}) for p in placements}  # production prompts
    hint_judge = JudgeWorker({"backend": "feedback", "m": 1})
    stop = [tok.convert_tokens_to_ids(tok.eos_token)]
    max_tokens = {"fact": 32, "markdown": 96}

    def sample(prompt_ids: list[int], i: int, case: Case):
        return engine.generate(
            [
                GenerateRequest(
                    prompt_ids, max_tokens=max_tokens[case.name], temperature=1.0, seed=100 * i + s, stop_token_ids=stop
                )
                for s in range(args.tries)
            ]
        )

    for case in cases:

        def offending(out, prompt):
            return case.offending([tok.decode([t]) for t in out.response_ids], prompt)  # noqa: B023 - used in this iteration

        def corrected(out, prompt):  # a reply a user would correct: it holds offending tokens and is wrong
            return any(offending(out, prompt)) and case.wrong(prompt, tok.decode(out.response_ids))  # noqa: B023

        tallies = {p: Tally() for p in placements}
        follow = {k: [0, 0] for k in ["plain", *placements]}
        print(f"\n## {case.name}\n")
        print(
            "| turn | placement | tokens | offending | Δ offending | Δ other | Δ decision token "
            "| Δ decision, neutral hint | frac Δ>0 |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for i, prompt in enumerate(case.prompts):
            messages = [{"role": "user", "content": prompt}]
            ids = tok.encode(
                tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
            )
            outs = sample(ids, i, case)
            follow["plain"][0] += sum(corrected(o, prompt) for o in outs)
            follow["plain"][1] += len(outs)
            turn = next((o for o in outs if corrected(o, prompt)), None)
            asked = Turn("bench", 1, messages, {}, ids, [], [], 0, "stop")  # the teacher prompt reads messages only
            next_state = [{"role": "user", "content": case.correction(prompt)}]
            hint = asyncio.run(hint_judge.hint(asked, next_state, "any", 10)).hint
            assert hint, f"the feedback judge found no hint in {next_state}"
            for placement in placements:
                hinted = teachers[placement].teacher_prompt_ids(asked, hint)
                if args.follow:
                    taught = sample(hinted, i, case)
                    follow[placement][0] += sum(corrected(o, prompt) for o in taught)
                    follow[placement][1] += len(taught)
                if turn is None:
                    print(f"| {i} | {placement} | no reply to correct in {args.tries} | | | | | | |")
                    continue
                flags = offending(turn, prompt)
                delta = [t - r for t, r in zip(engine.logprobs(hinted, turn.response_ids, 1.0), turn.logprobs)]
                first = flags.index(True)
                neutral = teachers[placement].teacher_prompt_ids(asked, NEUTRAL)
                neutral_first = engine.logprobs(neutral, turn.response_ids, 1.0)[first] - turn.logprobs[first]
                print(f"| {i} | {placement} | {tallies[placement].add(delta, flags, neutral_first)} |", flush=True)
                if args.show:
                    pieces = [tok.decode([t]) for t in turn.response_ids]
                    shown = "".join(
                        f"[{p!r}{d:+.1f}]" if f else f"{p!r}{d:+.1f} " for p, f, d in zip(pieces, flags, delta)
                    )
                    print(f"|  | {shown.replace('|', '¦')} | | | | | | | |")
        print()
        for placement, tally in tallies.items():
            print(f"overall {case.name} ({placement}): {tally.summary()}")
        if args.follow:
            rates = ", ".join(f"{k} {n}/{total}" for k, (n, total) in follow.items())
            print(f"replies the user would correct, sampled without the hint and from the hinted teacher: {rates}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
