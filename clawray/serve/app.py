"""PolicyServer: the OpenAI-compatible chat endpoint, a Ray Serve deployment with a FastAPI ingress.

Routes: ``POST /v1/chat/completions`` (non-streaming; ``tools`` in, ``tool_calls`` out),
``GET /v1/models``, ``GET /health``. Each request is rendered with the tokenizer's own chat template,
sent to a RolloutEngine as token ids, and every main-line turn is recorded with the exact prompt and
response token ids and the engine's log-probs (the response text is never re-tokenised).

Session protocol (as OpenClaw-RL's proxy): ``X-Session-Id`` header or body ``session_id``;
``X-Turn-Type: side`` (or body ``turn_type``) marks a turn that is served but never trained (default
``main``); ``X-Session-Done: true`` (or body ``session_done``) closes the session.

Every client error is an HTTP 4xx with an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}``; nothing is recorded for a rejected request.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
import zlib
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from clawray.chat import RequestError, parse_reply
from clawray.engines.base import GenerateRequest
from clawray.serve.protocol import ChatRequest, decode_body, parse_chat_request
from clawray.types import Turn

app = FastAPI(title="clawray policy server")
logger = logging.getLogger("ray.serve")



def error_response(status: int, message: str, param: str | None = None, code: str = "invalid_request",
                   err_type: str = "invalid_request_error") -> JSONResponse:
    """An OpenAI-style error body with ``status``."""
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": err_type, "param": param, "code": code}})


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and wrong methods answer in the OpenAI error shape too."""
    return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None,
                          "not_found" if exc.status_code == 404 else "invalid_request")


@serve.deployment(max_ongoing_requests=256)
@serve.ingress(app)
class PolicyServer:
    """The endpoint.

    Args:
        model_path: policy folder (its tokenizer and chat template are used).
        engines: RolloutEngine actor handles; a session sticks to one engine (prefix-cache locality).
        tracker: SessionTracker actor handle.
        cfg: ``{"model_name", "default_max_tokens", "default_temperature", "max_model_len",
            "generate_timeout_s", "max_body_bytes", "api_key"}`` (an empty key disables auth).
    """

    def __init__(self, model_path: str, engines: list, tracker: Any, cfg: dict):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.engines, self.tracker, self.cfg = engines, tracker, cfg
        eos = self.tokenizer.convert_tokens_to_ids(self.tokenizer.eos_token)
        self.stop_ids = [eos]
        self.counts = {"requests": 0, "rejected": 0, "main_turns": 0, "side_turns": 0, "unattributed": 0}

    @app.get("/v1/models")
    async def models(self) -> dict:
        """``GET /v1/models``: the one served policy."""
        return {"object": "list", "data": [{"id": self.cfg["model_name"], "object": "model", "created": 0,
                                            "owned_by": "clawray"}]}

    @app.get("/health")
    async def health(self) -> dict:
        """``GET /health``: each engine's policy version and the request counters."""
        versions = await asyncio.gather(*(e.get_version.remote() for e in self.engines))
        return {"status": "ok", "policy_versions": versions, "counts": self.counts}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> JSONResponse:
        """``POST /v1/chat/completions`` (non-streaming). 401 without the configured API key,
        400/413 for client errors, 503 when the engine does not answer within
        ``generate_timeout_s``, 500 only for a server-side fault. Ray Serve's proxy echoes the
        client's ``X-Request-Id`` (or returns the id it made)."""
        self.counts["requests"] += 1
        return await self._chat_completions(request)

    def _authorized(self, request: Request) -> bool:
        key = self.cfg.get("api_key") or ""
        if not key:
            return True
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        return hmac.compare_digest(token.encode(), key.encode())  # constant time

    async def _chat_completions(self, request: Request) -> JSONResponse:
        if not self._authorized(request):
            self.counts["unauthorized"] = self.counts.get("unauthorized", 0) + 1
            return error_response(401, "missing or invalid API key (Authorization: Bearer ...)", None,
                                  "invalid_api_key", "authentication_error")
        try:
            raw = await self._read_body(request)
            req = parse_chat_request(decode_body(raw), request.headers, self.cfg["default_max_tokens"],
                                     self.cfg["default_temperature"])
            return await self._complete(req)
        except RequestError as e:
            self.counts["rejected"] += 1
            status = 413 if e.code == "body_too_large" else 400
            return error_response(status, str(e), e.param, e.code)
        except asyncio.TimeoutError:
            return error_response(503, "the policy engine did not answer in time", None, "engine_timeout",
                                  "server_error")
        except Exception as e:  # a server-side fault: logged, reported in OpenAI form, replica stays up
            logger.exception("chat completion failed")
            return error_response(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error",
                                  "server_error")

    async def _read_body(self, request: Request) -> bytes:
        limit = self.cfg["max_body_bytes"]
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(f"request body is {declared} bytes; the limit is {limit}", None, "body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(f"request body exceeds the limit of {limit} bytes", None, "body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def _render(self, req: ChatRequest) -> list[int]:
        """Prompt token ids from the tokenizer's own chat template (CPU-bound: runs in a thread)."""
        try:
            text = self.tokenizer.apply_chat_template(req.messages, tools=req.tools, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as e:  # a template that cannot render this conversation is the client's input
            raise RequestError(f"the chat template cannot render these messages: {e}", "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _complete(self, req: ChatRequest) -> JSONResponse:
        prompt_ids = await asyncio.to_thread(self._render, req)
        limit = self.cfg["max_model_len"]
        if len(prompt_ids) >= limit:
            raise RequestError(f"prompt is {len(prompt_ids)} tokens; max_model_len is {limit}", "messages",
                               "context_length_exceeded")
        max_tokens = min(req.max_tokens, limit - len(prompt_ids))

        key = req.session_id or uuid.uuid4().hex
        engine = self.engines[zlib.crc32(key.encode()) % len(self.engines)]
        gen = GenerateRequest(prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=req.temperature,
                              top_p=req.top_p, stop_token_ids=self.stop_ids, seed=req.seed)
        out = await asyncio.wait_for(engine.generate.remote(gen), timeout=self.cfg["generate_timeout_s"])

        response_ids = out["response_ids"]
        body_ids = response_ids[:-1] if response_ids and response_ids[-1] in self.stop_ids else response_ids
        reply = self.tokenizer.decode(body_ids, skip_special_tokens=False)
        content, tool_calls, _parse_error = parse_reply(reply)
        finish = "tool_calls" if tool_calls else out["finish_reason"]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls

        turn_index = None
        if req.turn_type == "side":
            self.counts["side_turns"] += 1
            if req.done and req.session_id:
                await self.tracker.close_session.remote(req.session_id)
        elif req.session_id is None:
            self.counts["unattributed"] += 1
        else:
            self.counts["main_turns"] += 1
            turn = Turn(session_id=req.session_id, turn_index=0, messages=req.messages, response_message=message,
                        prompt_ids=prompt_ids, response_ids=response_ids, rollout_logprobs=out["logprobs"],
                        policy_version=out["policy_version"], finish_reason=finish, temperature=req.temperature,
                        tools=req.tools)
            turn_index = await self.tracker.record_turn.remote(turn, req.done)

        payload = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or self.cfg["model_name"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(response_ids),
                      "total_tokens": len(prompt_ids) + len(response_ids)},
            "session_id": req.session_id,
            "turn_index": turn_index,
            "policy_version": out["policy_version"],
        }
        return JSONResponse(payload, headers={"X-Policy-Version": str(out["policy_version"])})


def start_policy_server(model_path: str, engines: list, tracker: Any, cfg: dict, host: str, port: int,
                        num_cpus: float) -> str:
    """Start Serve on ``host:port`` and deploy the PolicyServer; returns the base URL (``.../v1``)."""
    # one access-log line per request floods a training console; errors are still logged
    serve.start(http_options={"host": host, "port": port}, logging_config={"enable_access_log": False})
    server = PolicyServer.options(ray_actor_options={"num_cpus": num_cpus},
                                  logging_config={"enable_access_log": False})
    serve.run(server.bind(model_path, engines, tracker, cfg), name="clawray", route_prefix="/", blocking=False)
    return f"http://{host}:{port}/v1"
