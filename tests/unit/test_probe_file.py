"""A deployment's own probe set for the promotion gate (deploy.probe_file, clawray.envs.probe_file):
the file's rules score the reply after each conversation, the gate runs on it without an
environment, and a malformed line is a clear error naming the file and line."""

from __future__ import annotations

import json

import pytest

from clawray.config import ConfigError, DeployConfig, load_config, section
from clawray.envs.probe_file import ProbeFileEnv, load_probe_items
from clawray.evaluation import Evaluator
from clawray.gate import PromotionGate

HISTORY = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "4"},  # an earlier turn that would pass: not the judged reply
    {"role": "user", "content": "2+2? Just the number."},
]
ITEMS = [
    {"messages": HISTORY, "answer": " 4 "},
    {"messages": [{"role": "user", "content": "Yes or no: is 7 prime?"}], "regex": r"^\s*(?i:yes)\b"},
]


def write(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n\n")
    return str(path)


def test_the_rules_score_the_reply_after_the_conversation(tmp_path):
    env = ProbeFileEnv(write(tmp_path / "probe.jsonl", ITEMS))
    exact, regex = env.items
    assert exact.question == "2+2? Just the number." and exact.answer == " 4 " and regex.regex is not None
    assert env.prompts("train") == [] and sorted(i.question for i in env.prompts("eval", seed=3)) == sorted(
        i.question for i in env.items
    )
    assert env.opening(exact) == HISTORY and env.opening(exact) is not exact.messages
    reply = lambda text: [*HISTORY, {"role": "assistant", "content": text}]  # noqa: E731
    assert [env.check(exact, reply(t))["passed"] for t in ("4", "\n4\n", "4.", "The answer is 4", "")] == [
        1.0,
        1.0,
        0.0,
        0.0,
        0.0,
    ]
    assert env.check(exact, HISTORY) == {"passed": 0.0}  # no reply appended: the history's "4" does not count
    assert [env.check(regex, [{"role": "assistant", "content": t}])["passed"] for t in ("Yes, it is", "no", "YES")] == [
        1.0,
        0.0,
        1.0,
    ]
    tool_call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}
    assert env.check(exact, [*HISTORY, tool_call]) == {"passed": 0.0}


@pytest.mark.parametrize(
    "line, why",
    [
        ("{not json", "probe.jsonl:2: not JSON"),
        (json.dumps({"answer": "4"}), 'probe.jsonl:2: expected {"messages"'),
        (json.dumps({"messages": [{"content": "x"}], "answer": "4"}), 'probe.jsonl:2: expected {"messages"'),
        (json.dumps({"messages": [{"role": "assistant", "content": "x"}], "answer": "4"}), "must be a user or tool"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "exactly one rule"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "answer": "4", "regex": "4"}), "exactly one rule"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "answer": 4}), "exactly one rule"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "regex": "(unclosed"}), "does not compile"),
    ],
)
def test_a_malformed_line_names_the_file_and_line(tmp_path, line, why):
    path = write(tmp_path / "probe.jsonl", [ITEMS[1], line])
    with pytest.raises(ValueError, match=f"^{tmp_path}/.*" + why.replace("{", r"\{").replace("(", r"\(")):
        load_probe_items(path)
    with pytest.raises(ConfigError, match="^deploy.probe_file: .*probe.jsonl:2"):
        PromotionGate(section(DeployConfig, {"gate": True, "probe_file": path}), None, str(tmp_path))


def test_the_gate_probes_a_file_without_an_environment(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    path = write(tmp_path / "probe.jsonl", ITEMS)
    with pytest.raises(ConfigError, match="needs a probe"):
        load_config(["conf/rl.yaml"], ["deploy.gate=true", "env.enabled=false"])
    cfg = load_config(["conf/rl.yaml"], ["deploy.gate=true", "env.enabled=false", f"deploy.probe_file={path}"])
    gate = PromotionGate(section(DeployConfig, {**cfg.deploy, "probe_n": 2}), cfg.env, str(tmp_path))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    eos = tok.convert_tokens_to_ids(tok.eos_token)

    def generate(requests):  # "4" to the arithmetic conversation, "no" to the other
        texts = {True: "4", False: "no"}
        out = []
        for r in requests:
            arithmetic = "2+2" in tok.decode(r.prompt_ids)
            out.append({"response_ids": tok.encode(texts[arithmetic], add_special_tokens=False) + [eos]})
        return out

    scores, _ = gate.probe(tiny_model, generate)
    assert isinstance(gate._evaluator, Evaluator) and len(gate.last_replies) == 4
    by_item = {t.question: scores[2 * i : 2 * i + 2] for i, t in enumerate(gate._evaluator.tasks)}
    assert by_item == {"2+2? Just the number.": [1.0, 1.0], "Yes or no: is 7 prime?": [0.0, 0.0]}
