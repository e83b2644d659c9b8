"""One chat request on its way through the server: its session, prompt ids and stop ids, the engine
requests it makes and the :class:`~clawray.types.Turn` each reply becomes.

Owns: how an engine reply becomes a recorded turn (finish reason, truncation, per-token versions).
Must not: talk to an actor.
"""

from __future__ import annotations

from clawray.engines.base import GenerateRequest
from clawray.serve.protocol import ChatRequest
from clawray.serve.reply import ParsedReply
from clawray.types import Turn


def mixed_versions(out: dict) -> list[int] | None:
    """An engine reply's per-token policy versions when more than one version sampled it (a partial
    rollout), else None (every token is from ``out["policy_version"]``)."""
    versions = out.get("token_versions") or []
    return list(versions) if len(set(versions)) > 1 else None


class Call:
    """One request: the parsed request, its session and prompt.

    Attributes:
        req: the :class:`~clawray.serve.protocol.ChatRequest`.
        session_id: its session (explicit, inferred or new), or None (served, not recorded).
        locked: the session whose lock this request holds, or None.
        prompt_ids: the prompt's token ids; ``spliced``: built on the previous turn's exact ids.
        in_reasoning: the prompt ends inside an open ``<think>`` block.
        end_ids: the ids that end this request's replies (:func:`clawray.chat.end_of_turn_ids` and its
            ``stop_token_ids``).
        new_token: the session's binding token, on its first request only.
    """

    def __init__(self, req: ChatRequest, locked: str | None):
        self.req = req
        self.session_id = req.session_id
        self.locked = locked
        self.prompt_ids: list[int] = []
        self.spliced = False
        self.in_reasoning = False
        self.end_ids: list[int] = []
        self.new_token: str | None = None

    def token_header(self) -> dict:
        """``X-Session-Token`` for a session's first request, else nothing."""
        return {"X-Session-Token": self.new_token} if self.new_token else {}

    def generate_requests(self, max_model_len: int, canary: bool = False) -> list[GenerateRequest]:
        """One engine request per choice (seeds ``seed + i``), capped to what fits ``max_model_len``;
        ``canary``: the session is canary traffic (``GenerateRequest.canary``)."""
        req = self.req
        max_tokens = min(req.max_tokens, max_model_len - len(self.prompt_ids))
        return [
            GenerateRequest(
                prompt_ids=self.prompt_ids,
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                stop_token_ids=self.end_ids,
                seed=None if req.seed is None else req.seed + i,
                canary=canary,
            )
            for i in range(req.n)
        ]

    def ended(self, response_ids: list[int]) -> bool:
        """The reply ends with an end-of-turn id (the engine stopped on it), not cut at a length."""
        return bool(response_ids) and response_ids[-1] in self.end_ids

    def body_ids(self, response_ids: list[int]) -> list[int]:
        """The reply's ids the client sees: without the end-of-turn id that ended it."""
        return response_ids[:-1] if self.ended(response_ids) else response_ids

    def turn(self, out: dict, parsed: ParsedReply) -> Turn:
        """The turn of one engine reply ``out`` (``response_ids``, ``logprobs``, ``policy_version``,
        ``token_versions``, ``canary``) parsed as ``parsed``: finish ``tool_calls``, ``stop`` or ``length``
        (truncated)."""
        req, ended = self.req, self.ended(out["response_ids"])
        return Turn(
            session_id=self.session_id,
            turn_index=0,
            messages=req.messages,
            response_message=parsed.message(),
            prompt_ids=self.prompt_ids,
            response_ids=out["response_ids"],
            rollout_logprobs=out["logprobs"],
            policy_version=out["policy_version"],
            finish_reason="tool_calls" if parsed.tool_calls else "stop" if ended else "length",
            temperature=req.temperature,
            tools=req.tools,
            truncated=not ended,
            tool_parse_error=parsed.tool_parse_error,
            spliced=self.spliced,
            token_versions=mixed_versions(out),
            canary=bool(out.get("canary", False)),
        )
