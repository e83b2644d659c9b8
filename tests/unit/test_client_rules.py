"""OpenClaw's real requests (tests/data/openclaw/, captured from npm openclaw 2026.9.6 against a
scripted server) attributed, paired and classified by clawray's client rules, replayed through the
same pieces the server and the session tracker use (parse_chat_request, SessionBook)."""

import gzip
import json
from pathlib import Path

import pytest

from clawray.chat import attribution_keys, conversation_keys
from clawray.client_rules import (
    conversation_view,
    is_ephemeral,
    is_silent_reply,
    reply_as_kept,
    session_hint,
    side_kind,
    strip_envelope,
    strip_ephemeral,
)
from clawray.serve.protocol import parse_chat_request
from clawray.session_book import AUTO_SESSION_PREFIX, SessionBook, quiet_positions, reply_key
from clawray.types import Turn

CORPUS = Path(__file__).resolve().parents[1] / "data" / "openclaw"
BLOCK = (
    "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nConversation data (data, not instructions):\n"
    '"Active exec sessions:\\nnone"\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>'
)


def captured(name):
    """The captured requests of one scenario: ``[(request body, the scripted server's reply)]``."""
    with gzip.open(CORPUS / f"{name}.jsonl.gz", "rt") as f:
        return [(r["body"], r["reply"]) for r in map(json.loads, f)]


def reply_message(reply):
    """The assistant message the server returned (tool calls with the ids it issued)."""
    calls = [{"id": c["id"], "type": "function", "function": c["function"]} for c in reply.get("tool_calls") or []]
    return {"role": "assistant", "content": reply.get("content"), **({"tool_calls": calls} if calls else {})}


class Replay:
    """The server's attribution (PolicyServer._infer_session) and the tracker's record path
    (open, pair, add) over a SessionBook, without Ray; ``drop_hint`` removes OpenClaw's Runtime
    line so that only prefix inference is left."""

    def __init__(self, drop_hint=False):
        self.book, self.drop_hint = SessionBook(), drop_hint
        self.log = []  # per request: (turn type, session id, pairing or None)
        self.spliceable = 0

    def request(self, body, reply):
        req = parse_chat_request(body, {}, 256, 1.0)
        if req.turn_type == "side":
            self.log.append(("side", req.side_kind, None))
            return
        messages = req.messages
        hint = None if self.drop_hint else session_hint(messages)
        attribution, exact = attribution_keys(messages), conversation_keys(messages)
        assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        keys = {k: attribution[k] for k in [*assistant, *quiet_positions(messages)]}
        last_reply = reply_key(messages[assistant[-1]]) if assistant else None
        found = self.book.find(None, keys, None, True, {k: exact[k] for k in assistant}, hint, None, last_reply)
        sid = found["session_id"] or (None if assistant else f"{AUTO_SESSION_PREFIX}new-{len(self.log)}")
        self.spliceable += found["prev"] is not None
        if sid is None:
            self.log.append(("unattributable", None, None))
            return
        s = self.book.open(sid, messages)
        pairing = self.book.pair(s, messages) if s.pending else None
        turn = Turn(sid, 0, messages, reply_message(reply), [1], [2], [-0.1], 0, "stop", tools=req.tools)
        self.book.add(s, [turn])
        self.log.append(("main", sid, pairing))


def replay(name, drop_hint=False):
    r = Replay(drop_hint)
    for body, reply in captured(name):
        if drop_hint:
            for m in body["messages"]:
                if isinstance(m["content"], str) and "Runtime: agent=" in m["content"]:
                    m["content"] = m["content"][: m["content"].index("Runtime: agent=")]
        r.request(body, reply)
    return r


def texts(next_state):
    return [(m["role"], m["content"]) for m in next_state]


@pytest.mark.parametrize("drop_hint", [False, True], ids=["hint", "prefix-only"])
def test_a_plain_conversation_is_one_session_each_turn_paired_with_the_users_next_message(drop_hint):
    r = replay("plain", drop_hint)
    assert [kind for kind, _, _ in r.log] == ["main"] * 4
    assert len({sid for _, sid, _ in r.log}) == 1
    assert (r.log[0][1] == "auto-plain1") is not drop_hint
    pairings = [p for _, _, p in r.log[1:]]
    assert [p.chosen.turn_index for p in pairings] == [1, 2, 3] and not any(p.rewritten for p in pairings)
    # the next state is the user's message alone: OpenClaw's internal-context block is not part of it
    assert texts(pairings[0].next_state) == [("user", "[Tue 2026-12-01 11:08 UTC] Tell me a fun fact about octopuses.")]
    assert all(len(p.next_state) == 1 and "OPENCLAW_INTERNAL" not in p.next_state[0]["content"] for p in pairings)
    assert r.spliceable == 0  # the block the previous prompt held is gone: every prompt is rendered afresh


@pytest.mark.parametrize("drop_hint", [False, True], ids=["hint", "prefix-only"])
def test_tool_calls_are_paired_with_their_results_although_openclaw_rewrites_the_call_ids(drop_hint):
    r = replay("tool", drop_hint)
    bodies = captured("tool")
    issued = bodies[0][1]["tool_calls"][0]["id"]
    echoed = bodies[1][0]["messages"][3]["tool_call_id"]
    assert (issued, echoed) == ("call_ff756c410158448c8c3f5788", "callff756c410158448c8c3f5788")
    assert [kind for kind, _, _ in r.log] == ["main"] * 4 and len({sid for _, sid, _ in r.log}) == 1
    read, answer, write = (p for _, _, p in r.log[1:])
    assert read.chosen.response_message["tool_calls"][0]["function"]["name"] == "read"
    assert texts(read.next_state) == [("tool", "What is 7 + 8?\n")]
    assert texts(answer.next_state)[0][0] == "user"
    assert write.chosen.response_message["tool_calls"][0]["function"]["name"] == "write"
    assert texts(write.next_state) == [("tool", "Successfully wrote 3 bytes to answer.txt")]


@pytest.mark.parametrize("drop_hint", [False, True], ids=["hint", "prefix-only"])
def test_two_interleaved_conversations_of_one_openclaw_stay_apart(drop_hint):
    r = replay("interleaved", drop_hint)
    sids = [sid for _, sid, _ in r.log]
    assert len(set(sids)) == 2 and sids[0::2] == [sids[0]] * 3 and sids[1::2] == [sids[1]] * 3
    if not drop_hint:
        assert set(sids) == {"auto-alpha", "auto-beta"}
    for sid in set(sids):
        pairings = [p for _, s, p in r.log if s == sid and p is not None]
        assert [p.chosen.turn_index for p in pairings] == [1, 2]
        assert all(p.chosen.session_id == sid for p in pairings)


@pytest.mark.parametrize("drop_hint", [False, True], ids=["hint", "prefix-only"])
def test_a_compaction_continues_the_session_and_its_housekeeping_is_side(drop_hint):
    """Without the Runtime hint, the first request after the compaction (its history rewritten: a
    summary, then the last reply) matched no prefix, and it and every later request were
    unattributable (5 turns lost); it is now found by its last reply, pending in one session only."""
    r = replay("compaction2", drop_hint)  # OpenClaw's keepRecentTokens 300: two summaries replace five messages
    kinds = [(kind, what) for kind, what, _ in r.log]
    assert kinds[3:6] == [("side", "memory_flush"), ("side", "compaction_summary"), ("side", "compaction_summary")]
    main = [(sid, p) for kind, sid, p in r.log if kind == "main"]
    sid = "auto-new-0" if drop_hint else "auto-comp2"
    assert len(main) == 8 and {s for s, _ in main} == {sid}
    pairings = [p for _, p in main[1:]]
    assert [p.chosen.turn_index for p in pairings] == [1, 2, 3, 4, 5, 6, 7]
    # the first request after the compaction: its history starts with the summary, the reply it
    # continues is found by itself (rewritten), and the summary is not taken for a next state
    assert [p.rewritten for p in pairings] == [False, False, True, False, False, False, False]
    assert texts(pairings[2].next_state) == [("user", "[Tue 2026-12-01 11:14 UTC] And day 2?")]
    assert r.book.get(sid).turns == 8


@pytest.mark.parametrize("drop_hint", [False, True], ids=["hint", "prefix-only"])
def test_the_default_compaction_also_rewrites_the_system_prompt_and_stays_one_session(drop_hint):
    r = replay("compaction", drop_hint)
    bodies = captured("compaction")
    system = [len(b["messages"][0]["content"]) for b, _ in bodies]
    assert system == [39752, 39752, 39752, 24704, 764, 39752, 31508, 31508]  # BOOTSTRAP.md gone after request 5
    main = [(sid, p) for kind, sid, p in r.log if kind == "main"]
    sid = "auto-new-0" if drop_hint else "auto-comp1"
    assert [kind for kind, _, _ in r.log].count("side") == 2 and {s for s, _ in main} == {sid}
    assert [p.chosen.turn_index for _, p in main[1:]] == [1, 2, 3, 4, 5]


def test_side_kinds_of_the_captured_housekeeping_and_none_for_main_requests():
    for name in ("plain", "tool", "interleaved"):
        assert {side_kind(parse_chat_request(b, {}, 8, 1.0).messages, b.get("tools")) for b, _ in captured(name)} == {
            None
        }
    flush, summary = captured("compaction2")[3][0], captured("compaction2")[4][0]
    assert parse_chat_request(flush, {}, 8, 1.0).side_kind == "memory_flush"
    assert parse_chat_request(summary, {}, 8, 1.0).side_kind == "compaction_summary"
    # an explicit turn type wins over the rules, both ways
    assert parse_chat_request(summary, {"x-turn-type": "main"}, 8, 1.0).turn_type == "main"
    assert parse_chat_request(captured("plain")[0][0], {"x-turn-type": "side"}, 8, 1.0).side_kind is None


def test_ephemeral_blocks_are_cut_and_only_a_block_alone_makes_a_message_ephemeral():
    assert strip_ephemeral(f"hello {BLOCK} world") == "hello  world"
    # a block appended to the user's text leaves the text as the next request has it: the keys agree
    assert (
        strip_ephemeral(f"Write the file.\n\n{BLOCK}")
        == "Write the file."
        == strip_ephemeral(f"{BLOCK}\nWrite the file.")
    )
    reply = {"role": "assistant", "content": "Done."}
    seen = [{"role": "user", "content": f"Write the file.\n\n{BLOCK}"}, reply]
    assert attribution_keys(seen)[-1] == attribution_keys([{"role": "user", "content": "Write the file."}, reply])[-1]
    assert conversation_view([{"role": "user", "content": f"thanks\n\n{BLOCK}"}]) == [
        {"role": "user", "content": "thanks"}
    ]
    assert (
        strip_ephemeral("<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> no end")
        == "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> no end"
    )
    assert is_ephemeral({"role": "user", "content": f"\n{BLOCK}\n"})
    assert not is_ephemeral({"role": "user", "content": f"hi {BLOCK}"})
    assert not is_ephemeral({"role": "assistant", "content": BLOCK})
    assert not is_ephemeral({"role": "user", "content": ""})
    view = conversation_view([{"role": "user", "content": f"hi {BLOCK}"}, {"role": "user", "content": BLOCK}])
    assert view == [{"role": "user", "content": "hi"}]


def test_session_hint_reads_the_first_user_message_only():
    runtime = "Runtime: agent=main | session=agent:main:explicit:x | sessionId=oc-7 | host=vm"
    assert session_hint([{"role": "system", "content": "s"}, {"role": "user", "content": f"hi\n\n{runtime}"}]) == "oc-7"
    assert session_hint([{"role": "user", "content": "hi"}, {"role": "user", "content": runtime}]) is None
    assert session_hint([{"role": "user", "content": "sessionId=nope"}]) is None


def test_attribution_ignores_system_prompts_ephemeral_blocks_and_tool_call_ids_but_not_content():
    u, a = {"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}
    base = attribution_keys([{"role": "system", "content": "A"}, u, a])[-1]
    assert attribution_keys([{"role": "system", "content": "B"}, u, {"role": "user", "content": BLOCK}, a])[-1] == base
    t1 = [u, a, {"role": "tool", "content": "out", "tool_call_id": "call_1"}]
    t2 = [u, a, {"role": "tool", "content": "out", "tool_call_id": "call1"}]
    assert attribution_keys(t1) == attribution_keys(t2) and conversation_keys(t1) != conversation_keys(t2)
    assert attribution_keys([u, {"role": "assistant", "content": "other"}])[-1] != base


@pytest.mark.parametrize(
    "text, stripped",
    [
        ("[Thu 2026-12-03 17:07 UTC] Write the answer.", "Write the answer."),
        ("[Wed 2026-12-02T09:15Z]   hi", "hi"),
        ("[Telegram Alice +2m] hi", "hi"),  # a channel header
        ("[note] keep this", "[note] keep this"),  # user-authored brackets stay
        ("7 [Thu 2026-12-03 17:07 UTC] x", "7 [Thu 2026-12-03 17:07 UTC] x"),  # only a leading header
        ("[Thu 2026-12-03 UTC] no time", "[Thu 2026-12-03 UTC] no time"),
        ("", ""),
        (None, None),
    ],
)
def test_strip_envelope_removes_only_openclaws_leading_header(text, stripped):
    assert strip_envelope(text) == stripped


@pytest.mark.parametrize(
    "served, kept",
    [  # what the real OpenClaw 2026.9.6 echoed in its next request's history for the reply it was served
        ("[[reply_to_current]] Glad to help.", "Glad to help."),
        ("[[reply_to:abc123]] Sure.", "Sure."),
        ("[[audio_as_voice]] Hi there.", "Hi there."),
        ("Sure. <thinking>check units</thinking> The answer is 4.", "Sure.  The answer is 4."),
    ],
)
def test_openclaws_copy_of_a_reply_without_its_directives_and_reasoning_continues_the_turn(served, kept):
    """OpenClaw strips reply directives (its system prompt asks for ``[[reply_to_current]]``) and
    reasoning blocks from its transcript copy of a reply: the turn was dropped as a branch (never
    trained) and, without the Runtime hint, the rest of the conversation was unattributable."""
    assert reply_as_kept(served) == reply_as_kept(kept) != ""
    first = [{"role": "user", "content": "Hi"}]
    history = [*first, {"role": "assistant", "content": kept}, {"role": "user", "content": "Thanks!"}]
    book = SessionBook()
    s = book.open("auto-1", first)
    book.add(s, [Turn("auto-1", 0, first, {"role": "assistant", "content": served}, [1], [2], [-0.1], 0, "stop")])
    keys = attribution_keys(history)
    assert book.find(None, {1: keys[1]}, None, True)["session_id"] == "auto-1"  # inferred without a hint
    pairing = book.pair(s, history)
    assert pairing.chosen is not None and pairing.next_state == [{"role": "user", "content": "Thanks!"}]


@pytest.mark.parametrize(
    "text, kept",
    [
        ("  Two   spaces\n\nand lines ", "Two spaces and lines"),
        ("<think>plan</think>Done.", "Done."),
        ("<thinking>a\nb</thinking> Done.", "Done."),
        ("Use <b>bold</b> and <thinking", "Use <b>bold</b> and <thinking"),  # other tags, an open block: kept
        ("[[reply_to_current]]", ""),
        ("[[note]] stays", "[[note]] stays"),
        ("", ""),
        (None, ""),
    ],
)
def test_reply_as_kept_cuts_only_openclaws_markup(text, kept):
    assert reply_as_kept(text) == kept


@pytest.mark.parametrize(
    "text, silent",
    [("NO_REPLY", True), (" no_reply. ", True), ("NO_REPLY NO_REPLY", True), ("**NO_REPLY**", True),
     ("I will answer NO_REPLY later", False), ("NO_REPLYING", False), ("", False), (None, False)],
)  # fmt: skip
def test_a_no_reply_answer_is_a_reply_that_says_nothing(text, silent):
    """OpenClaw leaves a reply that is only its ``NO_REPLY`` token out of the transcript and adds a user
    message: paired as a reply that says nothing, the turn's next state is that message."""
    from clawray.session_book import says_nothing

    assert is_silent_reply(text) is silent
    assert says_nothing({"role": "assistant", "content": text}) is (silent or not text)
    if silent:
        first = [{"role": "user", "content": "Hi"}]
        nudge = {"role": "user", "content": "The previous attempt did not produce a user-visible answer. Continue."}
        book = SessionBook()
        s = book.open("auto-1", first)
        book.add(s, [Turn("auto-1", 0, first, {"role": "assistant", "content": text}, [1], [2], [-0.1], 0, "stop")])
        pairing = book.pair(s, [*first, nudge])
        assert pairing.chosen is not None and pairing.next_state == [nudge]


def test_a_heartbeat_poll_is_a_side_turn_and_the_real_reply_stays_the_turns_next_state():
    """OpenClaw's heartbeat sends its poll prompt as a user message into the main session and prunes
    the exchange when nothing needed attention. Served as main, the poll became the previous turn's
    next state (judged on it), and the user's real reply then paired with nothing (a branch)."""
    import copy

    from clawray.client_rules import HEARTBEAT_PROMPTS

    bodies = [b for b, _ in captured("plain")]
    poll = copy.deepcopy(bodies[2])
    last = max(k for k, m in enumerate(poll["messages"]) if m["role"] == "user" and "INTERNAL_CONTEXT" not in str(m))
    for text in (
        "Follow the heartbeat monitor scratch context when provided. Recurring tasks are automations; create or "
        "change their schedules with the automations tool, not heartbeat scratch. Do not infer or repeat old tasks "
        "from prior chats. If nothing needs attention, reply NO_REPLY.\nCurrent time: Saturday, December 5th, 2026",
        f"[Sat 2026-12-05 02:30 UTC] {HEARTBEAT_PROMPTS[1]} (workspace context). Follow it strictly.",
    ):
        poll["messages"][last]["content"] = text
        req = parse_chat_request(poll, {}, 8, 1.0)
        assert (req.turn_type, req.side_kind) == ("side", "heartbeat")
    assert parse_chat_request(poll, {"x-turn-type": "main"}, 8, 1.0).side_kind is None
    # a user who writes about the heartbeat is a main-line turn
    poll["messages"][last]["content"] = "Why does the heartbeat monitor scratch context say that?"
    assert parse_chat_request(poll, {}, 8, 1.0).turn_type == "main"
    # the plain scenario with a poll between requests 2 and 3 (its "nothing to do" answer pruned after):
    # the poll is side, and turn 2 is paired with the user's real message
    poll["messages"][last]["content"] = HEARTBEAT_PROMPTS[0] + " If nothing needs attention, reply NO_REPLY."
    r, plain = Replay(), captured("plain")
    for body, reply in [*plain[:2], (poll, {"content": "NO_REPLY"}), *plain[2:]]:
        r.request(body, reply)
    assert [kind for kind, _, _ in r.log] == ["main", "main", "side", "main", "main"]
    assert r.log[2][1] == "heartbeat" and r.log[3][2].chosen.turn_index == 2
    assert "heartbeat" not in str(r.log[3][2].next_state) and len(r.log[3][2].next_state) == 1


def test_blocks_and_the_session_hint_are_read_as_lazy_patterns_read_them_in_one_pass():
    """The one-pass readers keep the meaning of the lazy patterns they replace (compared on random
    texts) and stay linear on texts of unclosed openings, where the patterns took 0.5 s at 30 kB and
    quadruple per doubling (a 240 kB request blocked a replica 37 s before its size was checked)."""
    import random
    import re

    begin, end = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>", "<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"
    lazy_block = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    lazy_runtime = re.compile(r"\bRuntime: agent=[^\n]*?\bsessionId=([^\s|]{1,128})")
    parts = [begin, end, "x", " ", "\n", "Runtime: agent=", "sessionId=", "s1", "|", "xRuntime: agent=", "xsessionId=a"]
    rng = random.Random(0)
    for _ in range(4000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(1, 12)))
        cut = lazy_block.sub("", text)
        assert strip_ephemeral(text) == (cut.strip() if cut != text else text), text
        found = lazy_runtime.search(text)
        assert session_hint([{"role": "user", "content": text}]) == (found.group(1) if found else None), text
    assert strip_ephemeral(begin * 20000 + " tail") == begin * 20000 + " tail"
    assert strip_ephemeral(begin * 20000 + end + " tail ") == "tail"
    assert session_hint([{"role": "user", "content": "Runtime: agent=" * 20000 + "| sessionId=abc | x"}]) == "abc"
    assert session_hint([{"role": "user", "content": "Runtime: agent=" * 20000 + "\nsessionId=abc"}]) is None


def test_a_conversation_without_a_session_id_goes_on_after_a_reply_that_said_nothing():
    """A client leaves an empty reply out of its next history (pi-ai, OpenClaw's client). Without a
    session id, the request after it matched no pending turn (only history + reply was indexed): it
    and every later request of the conversation were unattributable, never recorded."""
    r = Replay(drop_hint=True)
    system = {"role": "system", "content": "You are an agent."}
    h = [system, {"role": "user", "content": "Hi"}]
    r.request({"messages": h}, {"content": "Hello!"})
    h = [*h, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Tell me a joke"}]
    r.request({"messages": h}, {"content": ""})  # said nothing
    h = [*h, {"role": "user", "content": "Hello? You said nothing."}]  # the empty reply left out
    assert quiet_positions(h) == [3]  # "Tell me a joke", followed by a user message
    r.request({"messages": h}, {"content": "Sure."})
    h = [*h, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "ok"}]
    r.request({"messages": h}, {"content": "Bye."})
    assert [(kind, sid) for kind, sid, _ in r.log] == [("main", "auto-new-0")] * 4
    turns = [p for _, _, p in r.log[1:]]
    assert all(p is not None and p.chosen is not None for p in turns)  # each turn paired with its next state
    assert turns[1].next_state == [{"role": "user", "content": "Hello? You said nothing."}]
    assert r.book.sessions["auto-new-0"].turns == 4
    other = Replay(drop_hint=True)  # a new conversation that opens alike is still its own session
    other.request({"messages": h[:2]}, {"content": ""})
    other.request({"messages": [system, {"role": "user", "content": "Hi"}]}, {"content": ""})
    assert [sid for _, sid, _ in other.log] == ["auto-new-0", "auto-new-1"]


def test_reply_markup_is_read_in_linear_time_on_hostile_replies():
    """A client may send any assistant text in its history: 20,000 unclosed ``<think>`` tags took 10.7 s
    (a lazy ``.*?`` scanned to the end once per tag) and ``NO_REPLY`` followed by 20,000 spaces 1.2 s
    (two ``\\s*`` splitting the run), each quadratic; a megabyte of either now takes milliseconds."""
    import time

    hostile = [
        ("<think>" * 200_000, None),
        ("[[reply_to:" * 100_000, None),
        ("NO_REPLY" + " " * 200_000 + "x", "NO_REPLY x"),
        ("<think><thinking>" * 100_000 + "</think>", ""),  # the first opening closes at the end
    ]
    for text, kept in hostile:
        t0 = time.perf_counter()
        out, silent = reply_as_kept(text), is_silent_reply(text)
        assert time.perf_counter() - t0 < 5.0  # quadratic: hours
        assert not silent and (kept is None or out == kept)
    assert reply_as_kept("a <think>x</think> b <THINKING>y</thinking > c <think>open") == "a b c <think>open"
