"""A remote teacher: scoring given token ids on a vLLM OpenAI-compatible server.

Owns: the HTTP exchange with the teacher's server and the check that its tokenizer is the policy's.
Must not: import Ray, build the hinted prompt (:mod:`clawray.actors.teacher`), or generate: it is not a
:class:`~clawray.engines.base.Backend`.

OPD's teacher must score the *exact* response token ids the rollout produced. The plain OpenAI API
cannot (it takes text, and returns log-probs only of what it samples), but vLLM's server can: a
``POST /v1/completions`` whose ``prompt`` is a list of token ids, with ``prompt_logprobs`` = k, returns
for every prompt position the log-prob of the token there and the top-k alternatives. So an endpoint
teacher is any vLLM server (``vllm serve <model>``) whose tokenizer is identical to the policy's --
checked at start-up through its ``/tokenize`` and ``/detokenize`` routes (:func:`check_endpoint_tokenizer`).

Temperature: vLLM computes ``prompt_logprobs`` from the raw logits, and a server offers no way to
rescale them, so an endpoint teacher scores at T = 1 only. A turn sampled at another temperature
raises (the teacher path counts it as a teacher error and the turn is not trained) rather than
comparing a T = 1 teacher with a T != 1 rollout.
"""

from __future__ import annotations

from typing import Any

import httpx


class EndpointError(RuntimeError):
    """The endpoint refused a request or answered in an unexpected shape."""


class EndpointTeacher:
    """Teacher scoring through a vLLM OpenAI-compatible server.

    Args:
        base_url: the server's OpenAI base URL, e.g. ``http://127.0.0.1:8001/v1``.
        model: the served model name; empty = the first model ``GET /v1/models`` lists.
        api_key: sent as ``Authorization: Bearer``.
        timeout_s: per-request timeout in seconds.
    """

    def __init__(self, base_url: str, model: str = "", api_key: str = "EMPTY", timeout_s: float = 120.0):
        self.base_url = base_url.rstrip("/")
        self.root = self.base_url.removesuffix("/v1")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.timeout_s = timeout_s

    async def _post(self, url: str, body: dict) -> dict:
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers) as client:
            r = await client.post(url, json=body)
        if r.status_code != 200:
            raise EndpointError(f"{url} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    async def model_name(self) -> str:
        """The model to address (``model``, or the first one the server lists)."""
        if not self.model:
            async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers) as client:
                r = await client.get(f"{self.base_url}/models")
            if r.status_code != 200 or not r.json().get("data"):
                raise EndpointError(f"{self.base_url}/models answered {r.status_code}: {r.text[:300]}")
            self.model = r.json()["data"][0]["id"]
        return self.model

    async def tokenize(self, text: str) -> list[int]:
        """The server's token ids of ``text`` (no special tokens added)."""
        out = await self._post(
            f"{self.root}/tokenize", {"model": await self.model_name(), "prompt": text, "add_special_tokens": False}
        )
        return list(out["tokens"])

    async def detokenize(self, ids: list[int]) -> str:
        """The server's text of token ``ids``."""
        out = await self._post(f"{self.root}/detokenize", {"model": await self.model_name(), "tokens": ids})
        return out["prompt"]

    async def _prompt_logprobs(
        self, prompt_ids: list[int], response_ids: list[int], k: int, temperature: float
    ) -> list[dict[str, Any]]:
        if not prompt_ids or not response_ids:
            raise ValueError("scoring needs a non-empty prompt and response")
        if temperature not in (0.0, 1.0):
            raise ValueError(
                f"an endpoint teacher scores at temperature 1 only (vLLM prompt_logprobs use raw "
                f"logits); this turn was sampled at T={temperature}"
            )
        out = await self._post(
            f"{self.base_url}/completions",
            {
                "model": await self.model_name(),
                "prompt": list(prompt_ids) + list(response_ids),
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": k,
            },
        )
        try:
            rows = out["choices"][0]["prompt_logprobs"][len(prompt_ids) :]
        except (KeyError, IndexError, TypeError):
            raise EndpointError(f"{self.base_url}/completions returned no prompt_logprobs") from None
        if len(rows) != len(response_ids) or any(row is None for row in rows):
            raise EndpointError(f"expected {len(response_ids)} prompt_logprobs rows, got {len(rows)}")
        return rows

    async def logprobs(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Log-probs (length R) of ``response_ids`` after ``prompt_ids`` (natural log, T = 1).

        Raises:
            ValueError: empty prompt/response, or ``temperature`` other than 0 or 1.
            EndpointError: the server refused or answered without ``prompt_logprobs``.
        """
        rows = await self._prompt_logprobs(prompt_ids, response_ids, 0, temperature)
        return [float(row[str(tok)]["logprob"]) for row, tok in zip(rows, response_ids)]

    async def topk_logprobs(
        self, prompt_ids: list[int], response_ids: list[int], k: int, temperature: float = 1.0
    ) -> tuple[list[list[float]], list[list[int]]]:
        """Top-``k`` log-probs and ids (``[R][k]``, descending) at each response position (T = 1).

        Raises:
            as :meth:`logprobs`.
        """
        rows = await self._prompt_logprobs(prompt_ids, response_ids, k, temperature)
        values, ids = [], []
        for row in rows:
            ranked = sorted((v["rank"], int(tok), float(v["logprob"])) for tok, v in row.items() if v["rank"] <= k)[:k]
            ids.append([tok for _, tok, _ in ranked])
            values.append([lp for _, _, lp in ranked])
        return values, ids


async def check_endpoint_tokenizer(policy_path: str, endpoint: EndpointTeacher) -> None:
    """The endpoint's tokenizer must equal the policy's: teacher log-probs are read at policy token ids.

    Compares the server's tokenisation of probe texts (a rendered chat with a tool call, Unicode,
    digits, every special token) and its text of the policy's last token id with the policy
    tokenizer's.

    Raises:
        ValueError: naming the first probe on which they differ.
        EndpointError: the server has no ``/tokenize`` route (it is not a vLLM server).
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy_path)
    chat = tok.apply_chat_template(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 12*7? Use the tool."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*7"}}}
                ],
            },
            {"role": "tool", "content": "84"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    probes = [chat, "héllo wörld ✓ 漢字 🙂", "0123456789 3.14159 -42", " ".join(tok.all_special_tokens)]
    for text in probes:
        ours, theirs = tok.encode(text, add_special_tokens=False), await endpoint.tokenize(text)
        if ours != theirs:
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise ValueError(
                f"the teacher endpoint's tokenizer differs from the policy's on {text[:40]!r}: token "
                f"{first} is {theirs[first : first + 1]} there, {ours[first : first + 1]} here"
            )
    last = len(tok) - 1
    if await endpoint.detokenize([last]) != tok.decode([last]):
        raise ValueError(f"the teacher endpoint decodes token {last} differently from the policy's tokenizer")
