"""The Ray-free session book (clawray/session_book.py): pairing, lookup index, closes, at-least-one pick."""

from clawray.chat import attribution_key, attribution_keys, conversation_key
from clawray.session_book import Session, SessionBook
from conftest import make_turn as turn

U1 = {"role": "user", "content": "2 + 2?"}
U2 = {"role": "user", "content": "shorter"}


def keys_of(messages, key=attribution_key):
    """The lookup keys a server computes: one per assistant message of the history."""
    return {k: key(messages[: k + 1]) for k, m in enumerate(messages) if m["role"] == "assistant"}


def exact_of(messages):
    """The exact keys (splicing) a server computes beside them."""
    return keys_of(messages, conversation_key)


def test_add_numbers_turns_and_indexes_each_choice():
    book = SessionBook()
    s = book.open("a", [U1])
    choices = [turn("a", [U1], "4"), turn("a", [U1], "four")]
    book.add(s, choices)
    assert [t.turn_index for t in choices] == [1, 2]
    assert s.turns == 2 and s.requests == 1 and len(book) == 1
    assert sorted(book.index.values()) == [["a"], ["a"]] and len(book.index) == 2


def test_pair_finds_the_continued_choice_and_its_next_state():
    book = SessionBook()
    s = book.open("a", [U1])
    book.add(s, [turn("a", [U1], "4"), turn("a", [U1], "four")])
    history = [U1, {"role": "assistant", "content": "four"}, U2]
    p = book.pair(s, history)
    assert p.chosen is s.pending[1] and p.next_state == [U2] and p.others == 1
    assert book.index == {}  # paired turns leave the index


def test_pair_of_a_history_that_continues_no_choice_is_a_branch():
    book = SessionBook()
    s = book.open("a", [U1])
    book.add(s, [turn("a", [U1], "4"), turn("a", [U1], "four")])
    p = book.pair(s, [U1, {"role": "assistant", "content": "5"}, U2])
    assert p.chosen is None and p.next_state == [] and p.others == 2
    # the reply alone, with nothing after it, is no next state either
    book.add(s, [turn("a", [U1], "4")])
    assert book.pair(s, [U1, {"role": "assistant", "content": "4"}]).chosen is None


def test_a_rewritten_history_never_pairs_a_turn_with_an_earlier_equal_reply_of_its_own_history():
    """The rewritten-history match (a compaction kept the last reply) took any last assistant message
    equal to the pending reply. A resent request (the agent called run_tests twice; the client never
    saw the second call) paired turn 2 with turn 1's tool result, and an edited last message paired
    an earlier "Done." with the edit: wrong rewards. Both are branches now; a compaction still pairs."""
    call = {"role": "assistant", "content": "run_tests()"}
    result = {"role": "tool", "content": "3 passed, 2 failed"}
    book = SessionBook()
    s = book.open("a", [U1])
    book.add(s, [turn("a", [U1, call, result], "run_tests()")])  # turn 2: the same call again
    p = book.pair(s, [U1, call, result])  # the client resends turn 2's request
    assert (p.chosen, p.next_state, p.rewritten) == (None, [], False)
    done = {"role": "assistant", "content": "Done."}
    book.add(s, [turn("a", [U1, done, U2], "Done.")])
    edited = {"role": "user", "content": "Thanks! Now delete old.txt"}
    assert book.pair(s, [U1, done, edited]).chosen is None  # U2 edited: turn 2's reply is gone
    book.add(s, [turn("a", [U1, done, U2], "Done.")])
    summary = {"role": "user", "content": "Summary of the conversation so far: ..."}
    p = book.pair(s, [summary, done, edited])  # compacted: the reply stays, after a summary
    assert p.chosen is s.pending[0] and p.next_state == [edited] and p.rewritten


def test_a_next_state_ends_before_a_heartbeat_poll_the_client_kept():
    """OpenClaw keeps a heartbeat exchange that had something to report: the poll, the heartbeat's
    reply and the user's reaction to it were turn 1's next state (a complaint about the heartbeat's
    alert trained turn 1 with -1). The next state ends before the poll; none left, no pairing."""
    from clawray.client_rules import HEARTBEAT_PROMPTS

    poll = {"role": "user", "content": HEARTBEAT_PROMPTS[0] + " If nothing needs attention, reply NO_REPLY."}
    alert = {"role": "assistant", "content": "Reminder: your disk is 98% full."}
    reaction = {"role": "user", "content": "That's wrong, the disk has plenty of space."}
    reply = {"role": "assistant", "content": "51"}
    book = SessionBook()
    s = book.open("a", [U1])
    book.add(s, [turn("a", [U1], "51")])
    assert book.pair(s, [U1, reply, poll, alert, reaction]).chosen is None
    book.add(s, [turn("a", [U1], "51")])
    p = book.pair(s, [U1, reply, U2, poll, alert, reaction])
    assert p.chosen is s.pending[0] and p.next_state == [U2]


def test_find_infers_the_session_and_offers_the_turn_for_splicing_unless_tools_changed():
    book = SessionBook()
    book.add(book.open("a", [U1]), [turn("a", [U1], "4")])
    book.add(book.open("b", [U2]), [turn("b", [U2], "ok")])
    history = [U1, {"role": "assistant", "content": "4"}, U2]
    found = book.find(None, keys_of(history), exact=exact_of(history))
    assert found["session_id"] == "a" and not found["context_changed"]
    assert found["prev"] == {"prompt_ids": [1, 2, 3], "response_ids": [7, 8], "ended": True, "n_messages": 1}
    changed = book.find(None, keys_of(history), render_key="other tools", exact=exact_of(history))
    assert changed == {"session_id": "a", "prev": None, "context_changed": True, "how": "inferred"}
    assert book.find(None, keys_of([U2])) == {"session_id": None, "prev": None, "context_changed": False, "how": None}
    assert book.find("b", keys_of(history), exact=exact_of(history))["prev"] is None  # b's turn is not in it
    assert book.find(None, keys_of(history))["prev"] is None  # without exact keys nothing is spliced


def test_close_remembers_the_last_index_and_forgets_the_oldest_id():
    book = SessionBook(max_closed=2)
    for sid, n in [("a", 3), ("b", 1), ("c", 2)]:
        s = book.open(sid, [U1])
        book.add(s, [turn(sid, [U1], str(k)) for k in range(n)])
        assert book.close(sid) is s
    assert list(book.closed_turns.items()) == [("b", 1), ("c", 2)] and book.index == {} and len(book) == 0
    assert book.close("c") is None
    assert book.open("c", [U1]).turns == 2 and book.open("a", [U1]).turns == 0  # "a" was forgotten


def test_idle_lists_sessions_silent_longer_than_the_timeout():
    book = SessionBook()
    book.open("old", [U1]).last_seen = 100.0
    book.open("new", [U1]).last_seen = 108.0
    assert book.idle(5.0, now=110.0) == ["old"]
    assert book.idle(1.0, now=110.0) == ["old", "new"]


def test_a_conversation_without_an_id_goes_on_in_its_session_after_an_idle_close():
    """A client without a session id whose user came back after ``idle_timeout_s``: the idle close
    unindexed the session, so the next request matched nothing and, holding assistant messages, was
    no first request either: unattributable, and every later turn of it was never recorded. Now it is
    inferred into the same id, numbering on; a session its client closed is not reopened so."""
    book = SessionBook()
    s = book.open("auto-1", [U1])
    book.add(s, [turn("auto-1", [U1], "4")])
    later = [U1, {"role": "assistant", "content": "4"}, U2]
    book.close("auto-1", idle=True)
    found = book.find(None, keys_of(later), None, auto_only=True)
    assert (found["session_id"], found["how"], found["prev"]) == ("auto-1", "inferred", None)
    assert book.open("auto-1", later).turns == 1  # the numbering goes on
    book.add(book.get("auto-1"), [turn("auto-1", later, "ok")])
    book.close("auto-1")  # closed by its client (session_done): not inferred again
    after = [*later, {"role": "assistant", "content": "ok"}, U1]
    assert book.find(None, keys_of(after), None, auto_only=True)["session_id"] is None


def test_a_request_in_flight_keeps_its_session_from_the_idle_close(monkeypatch):
    """Idle time counted from the last recorded reply: a request still generating (or held behind a
    sync or the gate) for longer than ``session.idle_timeout_s`` saw its session closed under it and
    the previous turn lost its next state. The lookup that starts a request counts as the session's
    latest request."""
    import time

    book = SessionBook()
    s = book.open("a", [U1])
    book.add(s, [turn("a", [U1], "4")])
    s.last_seen = 100.0
    monkeypatch.setattr(time, "monotonic", lambda: 160.0)
    history = [U1, {"role": "assistant", "content": "4"}, U2]
    assert book.find("a", keys_of(history))["session_id"] == "a"
    assert s.last_seen == 160.0 and book.idle(59.0, now=200.0) == []
    assert book.find("nobody", {})["session_id"] == "nobody" and book.get("nobody") is None  # opens nothing


def test_restore_reopens_a_session_with_its_pending_turns_indexed():
    book = SessionBook()
    book.restore(Session(turns=1, pending=[turn("a", [U1], "4")], sid="a"))
    history = [U1, {"role": "assistant", "content": "4"}, U2]
    assert book.find(None, keys_of(history))["session_id"] == "a"
    assert book.pair(book.get("a"), history).next_state == [U2]


def test_promote_best_takes_the_largest_leaning_vote_first_of_equals():
    s = Session(held=[("t0", 0.0), ("t1", -1 / 3), ("t2", 1 / 3)])
    assert s.promote_best() == ("t1", -1 / 3)
    assert [item for item, _ in s.held] == ["t0", "t2"]
    assert Session().promote_best() is None


def test_a_reply_that_starts_with_openclaws_envelope_pairs_with_openclaws_stripped_copy():
    """Seen through the job (bench/openclaw_turns.py --train): Qwen2.5-Coder-0.5B echoed the user's
    stamped message, and OpenClaw's next request carried the reply without the stamp. That turn was
    dropped as a branch; it is the session's turn and gets its next state."""
    u1 = {"role": "user", "content": "[Thu 2026-12-03 17:07 UTC] Write the answer into answer.txt."}
    u2 = {"role": "user", "content": "[Thu 2026-12-03 17:07 UTC] What is in answer.txt now?"}
    book = SessionBook()
    s = book.open("auto-b", [u1])
    book.add(s, [turn("auto-b", [u1], "[Thu 2026-12-03 17:07 UTC] Write the answer into answer.txt.")])
    history = [u1, {"role": "assistant", "content": "Write the answer into answer.txt."}, u2]
    found = book.find(None, keys_of(history), exact=exact_of(history))
    assert found["session_id"] == "auto-b" and found["how"] == "inferred"
    assert found["prev"] is None  # the ids differ from the served reply's: rendered afresh, not spliced
    p = book.pair(s, history)
    assert p.chosen is s.pending[0] and p.next_state == [u2] and p.others == 0 and not p.rewritten
    # a reply whose leading brackets are not an envelope counts as it is
    book.add(s, [turn("auto-b", history, "[note] see answer.txt")])
    stripped = [*history, {"role": "assistant", "content": "see answer.txt"}, U2]
    assert book.pair(s, stripped).chosen is None


def test_a_reply_that_says_nothing_pairs_with_the_history_openclaw_sends_without_it():
    """OpenClaw's client leaves an assistant message with no content and no tool call out of its next
    request (an immediate end of turn, or reasoning alone), so the user's complaint followed the turn's
    own history directly and the turn was dropped as a branch: the worst replies never got a -1."""
    ctx = {"role": "user", "content": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nx\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"}
    complaint = {"role": "user", "content": "Hello? You did not answer."}
    for reply in ["", "  ", None]:
        book = SessionBook()
        s = book.open("a", [U1])
        t = turn("a", [U1, ctx], reply)
        t.response_message = {"role": "assistant", "content": reply, "reasoning_content": "Let me"}
        book.add(s, [t])
        p = book.pair(s, [U1, complaint])  # the internal block is gone, as OpenClaw sends it
        assert p.chosen is t and p.next_state == [complaint] and p.others == 0, reply
    # a reply that said something is not continued by its history alone, nor a reply by another reply
    book = SessionBook()
    s = book.open("a", [U1])
    book.add(s, [turn("a", [U1], "4")])
    assert book.pair(s, [U1, complaint]).chosen is None
    book.add(s, [turn("a", [U1], "")])
    assert book.pair(s, [U1, {"role": "assistant", "content": "5"}, complaint]).chosen is None
    book.add(s, [turn("a", [U1], "")])
    assert book.pair(s, [U1]).chosen is None  # a retry of the same history: no next state


def test_two_conversations_that_open_alike_each_go_on_in_their_own_session():
    """Two users of a client without session ids open with the same history and get the same reply
    ("Hi" -> "Hello!"): the index kept one session per key, so A's next request went on in B's session
    (paired with A's message) and B's next request matched nothing (never recorded), A's turn 1 left
    unpaired. Now a key holds both sessions, oldest first, and each next request takes one."""
    from clawray.chat import attribution_keys

    system, hi, hello = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, "Hello!"
    book = SessionBook()

    def request(messages, reply, new_sid=None):
        keys = {k: key for k, key in enumerate(attribution_keys(messages)) if messages[k]["role"] == "assistant"}
        sid = book.find(None, keys, None, True)["session_id"] or (new_sid if not keys else None)
        s = book.open(sid, messages)
        paired = book.pair(s, messages) if s.pending else None
        book.add(s, [turn(sid, messages, reply)])
        return sid, paired

    assert request([system, hi], hello, "auto-A")[0] == "auto-A"
    assert request([system, hi], hello, "auto-B")[0] == "auto-B"
    sum_q = {"role": "user", "content": "What is 7 + 8?"}
    haiku = {"role": "user", "content": "Write a haiku."}
    sid_a, paired_a = request([system, hi, {"role": "assistant", "content": hello}, sum_q], "15")
    sid_b, paired_b = request([system, hi, {"role": "assistant", "content": hello}, haiku], "Snow falls.")
    assert (sid_a, sid_b) == ("auto-A", "auto-B")
    assert (paired_a.chosen.turn_index, paired_a.next_state) == (1, [sum_q])
    assert (paired_b.chosen.turn_index, paired_b.next_state) == (1, [haiku])
    assert [t.turn_index for t in book.sessions["auto-A"].pending] == [2]
    assert [t.turn_index for t in book.sessions["auto-B"].pending] == [2]


def test_a_users_conversations_are_inferred_among_that_users_sessions_only():
    """The OpenAI ``user`` field scopes the inference: alice's request finds alice's session holding its
    history, never bob's with the same history, nor a session a client named (bound to its client)."""
    from clawray.chat import attribution_keys
    from clawray.session_book import user_session_prefix

    book = SessionBook()
    hi, hello = {"role": "user", "content": "Hi"}, "Hello!"
    alice, bob = user_session_prefix("alice") + "1", user_session_prefix("bob") + "1"
    for sid in ("named-by-client", bob, alice):  # the oldest first: each would win an unscoped lookup
        book.add(book.open(sid, [hi]), [turn(sid, [hi], hello)])
    messages = [hi, {"role": "assistant", "content": hello}, {"role": "user", "content": "go on"}]
    keys = {k: key for k, key in enumerate(attribution_keys(messages)) if messages[k]["role"] == "assistant"}
    assert alice == "auto-user:5:alice/1"
    assert book.find(None, keys, user="alice")["session_id"] == alice
    assert book.find(None, keys, user="bob")["session_id"] == bob
    assert book.find(None, keys, user="carol")["session_id"] is None
    assert book.find(None, keys)["session_id"] == "named-by-client"  # no user: as before
    assert book.find(None, keys, auto_only=True)["session_id"] == bob
    # a user id that is a "/"-prefix of another's scopes its own sessions only
    org_alice = user_session_prefix("org/alice") + "1"
    book.add(book.open(org_alice, [hi]), [turn(org_alice, [hi], hello)])
    assert book.find(None, keys, user="org")["session_id"] is None
    assert book.find(None, keys, user="org/alice")["session_id"] == org_alice


def test_conversations_that_open_alike_and_ask_at_once_take_one_session_each():
    """Both next requests arrive before either is recorded: the first lookup claims the oldest session
    of the key, the second takes the other (both took the oldest: the second request then replaced
    the first one's pending turn in it, and the other session's turn was never paired)."""
    from clawray.chat import attribution_keys

    system, hi = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}
    book = SessionBook()
    for sid in ("auto-A", "auto-B"):
        book.add(book.open(sid, [system, hi]), [turn(sid, [system, hi], "Hello!")])
    history = [system, hi, {"role": "assistant", "content": "Hello!"}]
    ask = [history + [{"role": "user", "content": q}] for q in ("7 + 8?", "A haiku.")]
    keys = [{k: key for k, key in enumerate(attribution_keys(m)) if m[k]["role"] == "assistant"} for m in ask]
    sids = [book.find(None, k, None, True)["session_id"] for k in keys]  # both in flight
    assert sids == ["auto-A", "auto-B"]
    for sid, messages in zip(sids, ask):
        s = book.open(sid, messages)
        assert book.pair(s, messages).next_state == [messages[-1]]
        book.add(s, [turn(sid, messages, "ok")])
    assert book.sessions["auto-A"].claimed_until == 0.0  # recorded: the claim is over
    # a later request of A's conversation finds A, claimed or not
    later = ask[0] + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Thanks"}]
    k = {i: key for i, key in enumerate(attribution_keys(later)) if later[i]["role"] == "assistant"}
    assert book.find(None, k, None, True)["session_id"] == "auto-A" == book.find(None, k, None, True)["session_id"]


def test_a_rewritten_history_is_found_by_its_last_reply_only_when_one_session_holds_it():
    """A history its client rewrote (a compaction's summary before the last reply) matches no prefix;
    its last reply finds the session only when exactly one open session has it pending: a reply such
    as "OK." names no conversation. A paired turn leaves the reply index, and a restored session
    (from the journal) is indexed again."""
    from clawray.session_book import reply_key

    book = SessionBook()
    for sid, reply in (("auto-a", "Day 1: Belem Tower."), ("auto-b", "OK."), ("auto-c", "OK.")):
        history = [{"role": "user", "content": f"plan for {sid}"}]
        book.add(book.open(sid, history), [turn(sid, history, reply)])
    summary = {"role": "user", "content": "The conversation so far: a trip."}

    def find(reply):
        rewritten = [summary, {"role": "assistant", "content": reply}, {"role": "user", "content": "And day 2?"}]
        keys = attribution_keys(rewritten)
        return book.find(None, {1: keys[1]}, None, True, None, None, None, reply_key(rewritten[1]))["session_id"]

    assert find("Day 1:  Belem Tower.") == "auto-a"  # as the client kept it (whitespace runs)
    assert find("OK.") is None and find("Something else.") is None
    assert (
        book.find(
            None,
            {},
            None,
            True,
            None,
            None,
            "alice",
            reply_key({"role": "assistant", "content": "Day 1: Belem Tower."}),
        )["session_id"]
        is None
    )  # another user's
    s = book.get("auto-a")
    book.pair(s, [summary])  # unindexed
    assert find("Day 1: Belem Tower.") is None
    book.restore(s)
    assert find("Day 1: Belem Tower.") == "auto-a"


def test_a_request_asked_again_stays_in_its_conversation_and_never_joins_another_by_its_last_reply():
    """Session X's turn 1 replied "OK." (paired), its turn 2 is pending; session Z has "OK." pending.
    X's client asks turn 2 again (regenerate, or an edited last message): its history ends with X's
    "OK." and matches no pending prefix, and the last-reply fallback put it into Z, pairing Z's turn
    with X's message as its next state. It now goes to X (the pending turn it asks again is a branch)."""
    from clawray.session_book import reply_key

    book = SessionBook()
    x1 = [{"role": "user", "content": "Hi, I am X"}]
    book.add(book.open("auto-x", x1), [turn("auto-x", x1, "OK.")])
    x2 = [*x1, {"role": "assistant", "content": "OK."}, {"role": "user", "content": "Plan my morning."}]
    sx = book.get("auto-x")
    assert book.pair(sx, x2).chosen is not None
    book.add(sx, [turn("auto-x", x2, "Wake at 7.")])
    z1 = [{"role": "user", "content": "Note that the printer is broken."}]
    book.add(book.open("auto-z", z1), [turn("auto-z", z1, "OK.")])
    for last in ("Plan my morning.", "Plan my afternoon."):  # regenerate; an edited last message
        again = [*x1, {"role": "assistant", "content": "OK."}, {"role": "user", "content": last}]
        keys = attribution_keys(again)
        found = book.find(None, {1: keys[1]}, None, True, None, None, None, reply_key(again[1]))
        assert found["session_id"] == "auto-x"
    assert book.find(None, {1: keys[1]}, None, True, None, None, "bob", reply_key(again[1]))["session_id"] is None
    assert book.get("auto-z").pending[0].response_message["content"] == "OK."  # untouched
