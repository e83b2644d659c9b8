"""splice_suffix: the template text that follows reply t's sampled ids in turn t+1's prompt, from reply
t's own end tag on; a template that does not close reply t (or renders earlier turns differently once
later ones follow) is a SpliceError, and the server renders the prompt afresh."""

import pytest

from clawray.serve.splice import SpliceError, splice_suffix

MESSAGES = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "It is 5."},
    {"role": "user", "content": "ok"},
]


def chatml(open_last: bool = False, system: str = ""):
    def render(msgs, generation_prompt):
        out = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
        for i, m in enumerate(msgs):
            left_open = open_last and m["role"] == "assistant" and i == len(msgs) - 1 and not generation_prompt
            out += f"<|im_start|>{m['role']}\n{m['content']}" + ("" if left_open else "<|im_end|>\n")
        return out + ("<|im_start|>assistant\n" if generation_prompt else "")

    return render


def test_the_suffix_starts_at_reply_ts_own_end_tag():
    suffix = splice_suffix(chatml(), MESSAGES, 1, "<|im_end|>")
    assert suffix == "<|im_end|>\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_leaves_reply_t_open_is_a_splice_error_not_a_repeated_reply():
    """rfind found the user turn's end tag before reply t: the suffix repeated "It is 5." after the
    sampled ids, and the model was given (and trained on) the reply twice."""
    with pytest.raises(SpliceError, match="does not end with the stop text"):
        splice_suffix(chatml(open_last=True), MESSAGES, 1, "<|im_end|>")


def test_a_template_that_rewrites_earlier_turns_is_a_splice_error():
    def dated(msgs, generation_prompt):  # the system line counts the turns: earlier text changes
        return chatml(system=f"{len(msgs)} messages")(msgs, generation_prompt)

    with pytest.raises(SpliceError, match="renders the earlier turns differently"):
        splice_suffix(dated, MESSAGES, 1, "<|im_end|>")
