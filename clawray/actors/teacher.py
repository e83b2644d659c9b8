"""TeacherWorker (OPD): teacher log-probs of a turn's *own* response tokens under a hinted prompt.

Owns: the hinted teacher prompt ids, the checks on what a teacher returns, the tokenizer-identity check and
which teacher a run builds (:func:`build_teachers`). Must not: extract the hint (the judge's hint votes),
decide what a failed teacher does to a turn (:mod:`clawray.algos.algorithm`), or re-tokenise a response.

The teacher context is the turn's request messages with the hint appended to the last user message
(OpenClaw-RL, arXiv 2603.10165, §4), built on the exact prompt ids the policy sampled from (the hint's
tokens inserted, :meth:`TeacherWorker.teacher_prompt_ids`), and the engine scores exactly
``turn.response_ids`` after it (``prompt_logprobs`` in vLLM, a forward pass in ``hf``): neither the
history nor the response is ever re-tokenised from text. Log-probs are taken at the
turn's sampling temperature, so ``teacher - rollout`` compares the same distribution family.
"""

from __future__ import annotations

import copy
import os
import math
import time
from typing import Any

import ray

from clawray.actors.call_health import CallHealth
from clawray.chat import SpecialTokenStripper
from clawray.config import OPDConfig, is_endpoint, section
from clawray.ray_env import CONTROL_GROUP, CONTROL_GROUPS
from clawray.types import Turn

DEFAULT_HINT_TEMPLATE = OPDConfig.hint_template  # the schema's default (opd.hint_template)


def hinted_messages(
    messages: list[dict[str, Any]], hint: str, template: str = DEFAULT_HINT_TEMPLATE, placement: str = "user"
) -> list[dict]:
    """A copy of ``messages`` with ``template.format(hint=hint)`` added to the teacher context.

    ``placement="user"`` (OpenClaw-RL): appended to the last user message (to the last message when
    there is no user message; a new user message when there are no messages). ``"system"``: appended
    to the system message, or a new leading system message holding the hint. ``"last"``: appended to
    the last message whatever its role (used by :meth:`TeacherWorker.teacher_prompt_ids` when the
    last user message is followed by tool results).

    Raises:
        ValueError: an unknown ``placement``.
    """
    out = copy.deepcopy(messages)
    text = template.format(hint=hint)
    if placement == "system":
        if out and out[0].get("role") == "system":
            out[0]["content"] = (out[0].get("content") or "") + text
        else:
            out.insert(0, {"role": "system", "content": text.lstrip()})
        return out
    if placement == "last" and out:  # the last message, whatever its role (a tool result)
        out[-1]["content"] = (out[-1].get("content") or "") + text
        return out
    if placement not in ("user", "last"):
        raise ValueError(f"hint placement must be 'user', 'system' or 'last', got {placement!r}")
    users = [i for i, m in enumerate(out) if m.get("role") == "user"]
    if users:
        out[users[-1]]["content"] = (out[users[-1]].get("content") or "") + text
    elif out:
        out[-1]["content"] = (out[-1].get("content") or "") + text
    else:
        out.append({"role": "user", "content": text.lstrip()})
    return out


def check_same_tokenizer(policy_path: str, teacher_path: str) -> None:
    """Teacher log-probs are read at the policy's token ids, so both tokenizers must be identical.

    Raises:
        ValueError: naming the first difference (vocabulary size, a token whose id differs, or the
            eos token).
    """
    from transformers import AutoTokenizer

    a, b = AutoTokenizer.from_pretrained(policy_path), AutoTokenizer.from_pretrained(teacher_path)
    va, vb = a.get_vocab(), b.get_vocab()
    if len(va) != len(vb):
        raise ValueError(f"teacher tokenizer at {teacher_path} has {len(vb)} tokens, the policy's has {len(va)}")
    for token, idx in sorted(va.items(), key=lambda kv: kv[1]):
        if vb.get(token) != idx:
            raise ValueError(
                f"teacher tokenizer at {teacher_path} maps {token!r} to {vb.get(token)}, the policy's to {idx}"
            )
    if a.eos_token != b.eos_token:
        raise ValueError(f"teacher eos {b.eos_token!r} differs from the policy's {a.eos_token!r}")


class TeacherWorker:
    """Scores responses under hinted prompts with a teacher RolloutEngine or a vLLM endpoint.

    Args:
        engine: RolloutEngine actor handle of the teacher (frozen initial policy by default), or None
            for an endpoint teacher.
        tokenizer_path: the teacher's tokenizer folder; its vocabulary must equal the policy's.
        opd: the ``opd`` config section (:class:`~clawray.config.OPDConfig`, or a mapping of the keys
            that differ from its defaults): ``hint_template`` (``{hint}`` is replaced),
            ``hint_placement`` (``"user"``: the last user message; ``"system"``),
            ``teacher_timeout_s`` (a score waiting longer makes :meth:`health` say ``slow``) and, with
            no engine, the endpoint: ``teacher`` (an ``http(s)://`` base URL of a vLLM
            OpenAI-compatible server, :class:`clawray.engines.endpoint.EndpointTeacher`; T = 1 only),
            ``teacher_model`` and ``teacher_api_key``.

    Raises:
        ValueError: no engine and ``opd.teacher`` is not an http(s) URL.
    """

    def __init__(self, engine: Any, tokenizer_path: str, opd: Any = None):
        from transformers import AutoConfig, AutoTokenizer

        from clawray.engines.endpoint import EndpointTeacher

        opd = section(OPDConfig, opd or {})
        self.engine, self.endpoint = engine, None
        if engine is None:
            if not is_endpoint(opd.teacher):
                raise ValueError("a TeacherWorker needs an engine, or opd.teacher as an http(s):// endpoint")
            self.endpoint = EndpointTeacher(opd.teacher.strip(), opd.teacher_model, opd.teacher_api_key)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.template, self.placement = opd.hint_template, opd.hint_placement
        self.plain_hint = SpecialTokenStripper(self.tokenizer)  # a hint cannot forge turns in the prompt
        try:
            self.vocab_size = int(AutoConfig.from_pretrained(tokenizer_path).vocab_size)
        except (OSError, ValueError, AttributeError, TypeError):
            self.vocab_size = len(self.tokenizer)
        self.scored = 0
        self.seconds = 0.0
        self.rebuilt = 0  # teacher prompts re-rendered from messages (no insertion kept the sampled ids)
        self.calls = CallHealth("teacher scores", opd.teacher_timeout_s)

    def teacher_prompt_ids(self, turn: Turn, hint: str) -> list[int]:
        """Token ids of the hinted teacher prompt: the exact ids the policy sampled from
        (``turn.prompt_ids``: spliced earlier replies, reasoning blocks and tool calls as sampled) with
        the hint's tokens inserted, so ``teacher - rollout`` measures the hint and nothing else.

        The insertion point is where :func:`hinted_messages` puts the hint in the rendered prompt:
        the text after it (``placement="user"``: the end of the last user message, e.g.
        ``<|im_end|>\n<|im_start|>assistant\n``) is re-tokenised and must be the tail of
        ``turn.prompt_ids`` (or, for ``"system"``, the text before it their head). When the last user
        message is followed by other messages (tool results) whose rendering is not the sampled ids,
        the hint goes into the last message instead. An empty hint gives ``turn.prompt_ids`` as they
        are. Only when no insertion keeps the sampled ids (a turn recorded without them) is the
        prompt re-rendered from the messages (counted in ``rebuilt``). The hint's special-token
        strings are removed first (:class:`clawray.chat.SpecialTokenStripper`).
        """
        hint = self.plain_hint(hint)
        exact = list(turn.prompt_ids)
        if not hint.strip() and exact:
            return exact
        messages = self._context(turn)
        for placement in (self.placement, "last") if self.placement == "user" else (self.placement,):
            ids = self._inserted(turn, messages, exact, hint, placement) if exact else None
            if ids is not None:
                return ids
        self.rebuilt += 1
        return self.tokenizer.encode(
            self._render(hinted_messages(messages, hint, self.template, self.placement), turn),
            add_special_tokens=False,
        )

    def _context(self, turn: Turn) -> list[dict[str, Any]]:
        """``turn.messages``, with the system message the chat template renders by default made
        explicit under ``placement="system"`` when there is none (Qwen2.5's "You are Qwen, ..."): the
        hint joins that system prompt instead of replacing it."""
        messages = list(turn.messages)
        if self.placement != "system" or (messages and messages[0].get("role") == "system"):
            return messages
        marker = "\u2063clawray-system\u2063"
        plain = self._render(messages, turn)
        marked = self._render([{"role": "system", "content": marker}, *messages], turn)
        i = marked.find(marker)
        head, tail = marked[:i], marked[i + len(marker) :]
        if i < 0 or not plain.startswith(head) or not plain.endswith(tail) or len(head) + len(tail) >= len(plain):
            return messages  # no default system prompt (or one the template does not render as given)
        default = [{"role": "system", "content": plain[len(head) : len(plain) - len(tail)]}, *messages]
        return default if self._render(default, turn) == plain else messages

    def _render(self, messages: list[dict[str, Any]], turn: Turn) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=turn.tools, add_generation_prompt=True, tokenize=False
        )

    def _inserted(
        self, turn: Turn, messages: list[dict[str, Any]], exact: list[int], hint: str, placement: str
    ) -> list[int] | None:
        """``exact`` with the hint's text inserted where ``placement`` puts it in ``messages`` (the
        turn's, :meth:`_context`), or None when the rendered text around the insertion point does not
        re-tokenise to ``exact``'s tail or head."""
        plain = self._render(messages, turn)
        hinted = self._render(hinted_messages(messages, hint, self.template, placement), turn)
        p = 0
        while p < min(len(plain), len(hinted)) and plain[p] == hinted[p]:
            p += 1
        s = 0
        while s < len(plain) - p and plain[len(plain) - 1 - s] == hinted[len(hinted) - 1 - s]:
            s += 1
        if p + s != len(plain):  # not a pure insertion
            return None
        inserted = self.tokenizer.encode(hinted[p : len(hinted) - s], add_special_tokens=False)
        tail = self.tokenizer.encode(plain[p:], add_special_tokens=False)
        if tail and len(tail) < len(exact) and exact[-len(tail) :] == tail:
            return exact[: -len(tail)] + inserted + tail
        head = self.tokenizer.encode(plain[:p], add_special_tokens=False)
        if head and len(head) < len(exact) and exact[: len(head)] == head:
            return head + inserted + exact[len(head) :]
        return None

    async def teacher_logprobs(self, turn: Turn, hint: str) -> list[float]:
        """Teacher log-probs (length R) of ``turn.response_ids`` after the hinted prompt."""
        t0 = time.perf_counter()
        args = (self.teacher_prompt_ids(turn, hint), list(turn.response_ids), turn.temperature)
        logprobs = await self._call(
            self.endpoint.logprobs(*args) if self.endpoint else self.engine.logprobs.remote(*args)
        )
        self.seconds += time.perf_counter() - t0
        if len(logprobs) != len(turn.response_ids):
            raise RuntimeError(f"teacher returned {len(logprobs)} log-probs for {len(turn.response_ids)} tokens")
        logprobs = [_logprob(v, f"position {t}") for t, v in enumerate(logprobs)]
        self.scored += 1
        return logprobs

    async def teacher_topk(self, turn: Turn, hint: str, k: int) -> tuple[list[list[float]], list[list[int]]]:
        """The teacher's top-``k`` log-probs and ids (``[R][k]``) at each response position under the
        hinted prompt (top-k distillation, the SDFT/SDPO variant)."""
        t0 = time.perf_counter()
        args = (self.teacher_prompt_ids(turn, hint), list(turn.response_ids), k, turn.temperature)
        values, ids = await self._call(
            self.endpoint.topk_logprobs(*args) if self.endpoint else self.engine.topk_logprobs.remote(*args)
        )
        self.seconds += time.perf_counter() - t0
        if len(ids) != len(turn.response_ids) or len(values) != len(ids):
            raise RuntimeError(
                f"teacher returned {len(values)} top-k value rows and {len(ids)} id rows for "
                f"{len(turn.response_ids)} tokens"
            )
        width = len(ids[0]) if ids else 0
        for t, (row_values, row_ids) in enumerate(zip(values, ids)):
            if not 1 <= width <= k or len(row_values) != width or len(row_ids) != width:
                raise RuntimeError(
                    f"teacher top-k row {t} holds {len(row_values)} values and {len(row_ids)} ids; "
                    f"every row needs the same 1..{k}"
                )
            values[t] = [_logprob(v, f"position {t}") for v in row_values]
            if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size for i in row_ids):
                raise RuntimeError(f"teacher top-k row {t} holds an id outside [0, {self.vocab_size}): {row_ids}")
        self.scored += 1
        return values, ids

    async def _call(self, call: Any) -> Any:
        """``await call`` (the engine's or endpoint's scoring), its time and outcome kept for
        :meth:`health`."""
        with self.calls.work():
            try:
                out = await call
            except Exception as e:
                self.calls.call_ended(type(e).__name__)
                raise
        self.calls.call_ended()
        return out

    async def check_endpoint(self, policy_path: str, topk: int = 0) -> None:
        """Start-up check of an endpoint teacher: its tokenizer against the policy's and, for top-k
        distillation (``topk`` > 0), one top-``topk`` call (vLLM refuses more than its
        ``--max-logprobs``, 20 by default: every turn would have been a teacher error).

        Raises:
            ValueError: naming the first difference (see :func:`clawray.engines.endpoint.check_endpoint_tokenizer`),
                or the refused top-k call.
        """
        from clawray.engines.endpoint import check_endpoint_tokenizer

        if self.endpoint is None:
            return
        await check_endpoint_tokenizer(policy_path, self.endpoint)
        if topk > 0:
            ids = self.tokenizer.encode("Hello", add_special_tokens=False) or [0]
            try:
                await self.endpoint.topk_logprobs(ids, ids[:1], topk, 1.0)
            except Exception as e:  # noqa: BLE001 - named at start-up, not on every turn
                raise ValueError(
                    f"the teacher endpoint refused top-{topk} log-probs ({type(e).__name__}: {e}): start vLLM "
                    f"with --max-logprobs {topk} or more, or set opd.topk to at most its limit (vLLM's default: 20)"
                ) from None

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def get_stats(self) -> dict:
        """``{"scored": turns scored, "seconds": total teacher-scoring wall time}``; answered in the
        ``control`` concurrency group, never behind scoring calls."""
        return {"scored": self.scored, "seconds": self.seconds, "prompts_rebuilt": self.rebuilt}

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def health(self) -> dict:
        """Whether the teacher keeps up: :meth:`clawray.actors.call_health.CallHealth.report` (scores
        waiting longer than ``opd.teacher_timeout_s`` are ``slow``); in the ``control`` group."""
        return self.calls.report()


def _logprob(value: object, where: str) -> float:
    """``value`` as a log-prob: a finite number <= 0 (1e-3 of rounding allowed).

    Raises:
        RuntimeError: naming ``where`` and the value (NaN, inf, a positive number, not a number).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value > 1e-3:
        raise RuntimeError(f"teacher returned {value!r} at {where}; a log-prob is a finite number <= 0")
    return float(value)


TeacherWorkerActor = ray.remote(concurrency_groups=CONTROL_GROUPS)(TeacherWorker)


def build_teachers(
    opd: Any, policy_path: str, live_engine: Any, judge_engine: Any, frozen_engine: Any, topk: int = 0
) -> tuple[Any, list]:
    """The teacher of an algorithm that needs one (``Algorithm.needs_teacher``), from ``opd.teacher``:
    ``frozen`` (the initial policy on its own engine, or on ``judge_engine`` when that is given: the
    same frozen model on the same backend), ``live`` (rollout engine ``live_engine``), a model folder
    (same tokenizer, checked) or an ``http(s)://`` OpenAI endpoint (no engine; its tokenizer checked).

    Args:
        opd: the ``opd`` config section.
        policy_path: the policy's HF folder.
        live_engine: rollout engine 0's handle.
        judge_engine: the frozen judge engine to share, or None.
        frozen_engine: ``(backend, path, name) -> handle`` that starts a frozen engine.
        topk: the k of top-k distillation (0: token log-probs); an endpoint must serve it.

    Returns:
        ``(teacher engine or None, [TeacherWorkerActor])``.

    Raises:
        ValueError: a teacher folder or endpoint whose tokenizer differs from the policy's; an endpoint
            that refuses ``topk`` log-probs.
    """
    from clawray.recovery import RESTART_RETRY

    options = {"num_cpus": 0, **RESTART_RETRY}
    opd = section(OPDConfig, opd)  # the typed section the TeacherWorker receives
    if is_endpoint(opd.teacher):
        teacher = TeacherWorkerActor.options(**options).remote(None, policy_path, opd)
        ray.get(teacher.check_endpoint.remote(policy_path, topk))  # the same tokenizer, top-k served
        return None, [teacher]
    if opd.teacher == "live":
        engine = live_engine
    elif opd.teacher == "frozen":
        engine = judge_engine or frozen_engine(opd.teacher_backend, policy_path, "teacher-engine")
    else:
        teacher_path = os.path.abspath(os.path.expanduser(opd.teacher))
        check_same_tokenizer(policy_path, teacher_path)
        engine = frozen_engine(opd.teacher_backend, teacher_path, "teacher-engine")
    teacher = TeacherWorkerActor.options(**options).remote(engine, policy_path, opd)
    return engine, [teacher]
