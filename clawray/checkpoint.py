"""Checkpoint folders: atomic commit, the ``latest`` pointer and pruning.

Owns: the folder names (``ckpt-NNNNNN``, ``.tmp-ckpt-*``, ``latest``), the atomic commit, pruning, the
manifest and its check, the policy card (``model/clawray.json``) and the precision and prefix-cache
warnings. Must not: write the learners' files (:mod:`clawray.actors.learner_checkpoint`) or
``driver.json`` (:mod:`clawray.resume`), or import Ray or torch.

A checkpoint is written into a hidden temporary folder (``.tmp-ckpt-NNNNNN-PID``) and renamed to
``ckpt-NNNNNN`` only once every part is on disk, :data:`MANIFEST` (every file's size and CRC-32) last;
then the ``latest`` file (replaced atomically) names it. A crash mid-write leaves a temporary folder
that is ignored (and removed when the next checkpoint starts), never a broken ``latest``. The learners'
files, and what a model-only checkpoint (``checkpoint.save_optimizer=false``) can do, are listed in
:mod:`clawray.actors.learner_checkpoint`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib

from clawray.file_modes import open_private, private_dir
from clawray.records import DamagedFileError  # noqa: F401 - raised here, and imported from here by callers

_NAME = re.compile(r"^ckpt-(\d{6})$")


def list_checkpoints(root: str) -> list[str]:
    """Committed checkpoint folders under ``root``, oldest first (absolute paths)."""
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if _NAME.match(n) and os.path.isdir(os.path.join(root, n)))
    return [os.path.join(root, n) for n in names]


def set_aside(root: str) -> str | None:
    """Rename a checkpoint folder that holds anything to ``{root}.earlier-{UTC date-time}`` (a free
    name), so that a fresh run in the same place neither resumes nor prunes an earlier run's
    checkpoints, and loses none of them. Returns the new path, or None when there was nothing."""
    import time

    if not os.path.isdir(root) or not os.listdir(root):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target, k = f"{root}.earlier-{stamp}", 1
    while os.path.exists(target):
        k += 1
        target = f"{root}.earlier-{stamp}-{k}"
    os.rename(root, target)
    return target


def new_checkpoint_dirs(root: str) -> tuple[str, str]:
    """``(tmp, final)`` folder paths for the next checkpoint; ``tmp`` is created empty.

    Left-over temporary folders of earlier crashed writes are removed first.
    """
    private_dir(root)
    for name in os.listdir(root):
        if name.startswith(".tmp-ckpt-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    existing = list_checkpoints(root)
    seq = int(_NAME.match(os.path.basename(existing[-1])).group(1)) + 1 if existing else 1
    final = os.path.join(root, f"ckpt-{seq:06d}")
    tmp = os.path.join(root, f".tmp-ckpt-{seq:06d}-{os.getpid()}")
    os.makedirs(tmp, mode=0o700)
    return tmp, final


def commit_checkpoint(tmp: str, final: str, keep_last: int = 0) -> str:
    """Rename ``tmp`` to ``final``, point ``latest`` at it, then delete all but the ``keep_last``
    newest checkpoints (0 keeps all). Returns ``final``."""
    root = os.path.dirname(final)
    os.rename(tmp, final)
    pointer = os.path.join(root, "latest")
    with open_private(pointer + ".tmp") as f:
        f.write(os.path.basename(final) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer + ".tmp", pointer)
    if keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            # renamed out of the checkpoints first: one half-deleted (a crash in the rmtree) is never
            # taken for a checkpoint, nor passed by verification on its driver.json alone
            doomed = os.path.join(root, f".tmp-ckpt-pruned-{os.path.basename(old)}-{os.getpid()}")
            try:
                os.rename(old, doomed)
            except OSError:  # the committed checkpoint stands; the old one is deleted in place, as before
                doomed = old
            shutil.rmtree(doomed, ignore_errors=True)
    return final


#: Each checkpoint's list of its files with their sizes and CRC-32s, written last before the commit.
MANIFEST = "manifest.json"


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(folder: str) -> None:
    """Write ``folder/manifest.json``: ``{relative path: {"size", "crc32"}}`` of every file under
    ``folder`` (CRC-32 of the bytes; about 1 s per GB). Call it after every other file is written
    and before :func:`commit_checkpoint`."""
    files = {}
    for d, _, names in os.walk(folder):
        for name in sorted(names):
            full = os.path.join(d, name)
            rel = os.path.relpath(full, folder)
            if rel != MANIFEST:
                files[rel] = {"size": os.path.getsize(full), "crc32": _crc32(full)}
    with open_private(os.path.join(folder, MANIFEST)) as f:
        json.dump({"files": files}, f, indent=1)


def verify_checkpoint(path: str) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed (one line), or None when it is intact: every
    file of its manifest present with the same size and CRC-32, and ``driver.json`` readable. A
    checkpoint without a manifest (written before manifests existed) is checked for a readable
    ``driver.json`` only."""
    manifest = os.path.join(path, MANIFEST)
    if os.path.exists(manifest):
        try:
            with open(manifest) as f:
                files = json.load(f)["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"{MANIFEST} is unreadable"
        for rel, want in files.items():
            full = os.path.join(path, rel)
            if not os.path.isfile(full):
                return f"{rel} is missing"
            if os.path.getsize(full) != want.get("size"):
                return f"{rel} is {os.path.getsize(full)} bytes, {want.get('size')} were written"
            if _crc32(full) != want.get("crc32"):
                return f"{rel} does not match its CRC-32"
    try:
        with open(os.path.join(path, "driver.json")) as f:
            state = json.load(f)
        int(state["steps_done"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"driver.json is unreadable ({type(e).__name__})"
    return None


def latest_intact_checkpoint(root: str, report=print) -> str | None:
    """The newest checkpoint under ``root`` that :func:`verify_checkpoint` passes: the one ``latest``
    names first, then the others newest first (``checkpoint.keep_last`` keeps older ones for this).
    Each damaged one is reported (``report(line)``) with why, and which one is used instead.

    Returns:
        the checkpoint folder, or None when there is none.

    Raises:
        DamagedFileError: checkpoints exist but every one is damaged (each is named).
    """
    first = latest_checkpoint(root)
    if first is None:
        return None
    candidates = [first] + [p for p in reversed(list_checkpoints(root)) if p != first]
    damaged = []
    for path in candidates:
        why = verify_checkpoint(path)
        if why is None:
            if damaged:
                report(f"[clawray] resume falls back to {path}, the newest intact checkpoint")
            return path
        damaged.append(f"{os.path.basename(path)}: {why}")
        report(f"[clawray] checkpoint {path} is damaged ({why}): not resumed from")
    raise DamagedFileError(f"every checkpoint in {root} is damaged: " + "; ".join(damaged))


def latest_checkpoint(root: str) -> str | None:
    """The folder ``latest`` names, else the newest committed ``ckpt-*`` folder, else None."""
    pointer = os.path.join(root, "latest")
    if os.path.exists(pointer):
        with open(pointer) as f:
            path = os.path.join(root, f.read().strip())
        if os.path.isdir(path):
            return path
    found = list_checkpoints(root)
    return found[-1] if found else None


#: The policy card: a checkpoint's ``model/clawray.json`` (travels with the model folder).
POLICY_CARD = "clawray.json"


def engine_dtype(backend: str, dtype: str) -> str:
    """The dtype a rollout engine actually runs in: ``rollout.dtype`` on vLLM; the hf backend always
    runs float32 (the learners' master-weight precision; their compute dtype is
    ``learner.compute_dtype``)."""
    return dtype if backend == "vllm" else "float32"


#: vLLM's dtype names, as one name per precision ("auto" follows the model folder: unknown here).
_DTYPE_NAMES = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "float32": "float32",
    "float": "float32",
}


def learner_compute_dtype(num_gpus: float, compute_dtype: str = "auto") -> str:
    """The precision learners with ``num_gpus`` GPUs each compute log-probs in: ``learner.compute_dtype``,
    whose ``auto`` is bfloat16 on CUDA and float32 on CPU (FSDP2 mixed precision over fp32 master
    weights, :func:`clawray.actors.learner.mixed_precision`)."""
    if compute_dtype != "auto":
        return compute_dtype
    return "bfloat16" if num_gpus > 0 else "float32"


def precision_mismatch(cfg) -> str | None:
    """A line saying that the rollout engine samples in another precision than the learners compute
    in, or None when they agree (or the engine's is ``auto``: the model folder's), ending with the
    setting that makes them agree (``rollout.dtype``; ``learner.compute_dtype`` on the hf backend,
    which always samples in float32).

    Measured (README "Learner options"). CPU demo (``conf/rl.yaml conf/cpu.yaml``, seed 0): a bfloat16
    vLLM engine against float32 learners solved 22.7% -> 32.4% (CIs overlap) where the float32 engine
    reached 22.2% -> 92.1%; over 16 steps its ``inv/logprob_mismatch_kl`` had median 0.019 (against
    3e-11), ``inv/ratio_max`` median 2.9 (against 1.5). One H100 (``launch/gpu_check_offline.sh``,
    SmolLM2-135M, hf engine, lr 1e-5, 6 steps): engine/learner bf16/bf16 KL <= 1.0e-3 and flat, fp32/fp32
    <= 4.8e-11, while bf16/fp32 grew to 1.1e-2 and fp32/bf16 to 1.5e-2 (ratios up to 1.5 and 1.9) as
    the updates the engine's copy rounds differently accumulate. The matched bf16 pair on the CPU demo
    (``rollout.dtype=bfloat16 learner.compute_dtype=bfloat16``): 22.2% -> 53.2%, KL median 0.0028."""
    engine = _DTYPE_NAMES.get(engine_dtype(str(cfg.rollout.backend), str(cfg.rollout.dtype)))
    learner = learner_compute_dtype(float(cfg.learner.num_gpus), str(cfg.learner.compute_dtype))
    if engine is None or engine == learner:
        return None
    # the evidence for this pair: the CPU demo measured a low-precision engine against fp32 learners;
    # the H100 matrix measured both mixed pairs
    where = (
        "the CPU demo with a bfloat16 engine: logprob_mismatch_kl ~0.02, ratios up to 8, "
        "+9.7 points solved instead of +69.9"
        if float(cfg.learner.num_gpus) == 0 and learner == "float32"
        else "on one H100: logprob_mismatch_kl up to 0.015 in 6 steps, against 0.001 when both are bf16"
    )
    # the hf backend ignores rollout.dtype (always float32): only the learners' side can move there
    fix = "learner.compute_dtype=float32" if str(cfg.rollout.backend) == "hf" else f"rollout.dtype={learner}"
    return (
        f"precision: the rollout engine samples in {engine} and the learners compute in {learner}, so the "
        f"rollout log-probs are off-policy for the learner ({where}); {fix} makes them agree"
    )


def policy_card(cfg, version: int, steps_done: int) -> dict:
    """What a model folder needs to be served and evaluated as the job did: its policy version, the
    precision it was trained in (the learners' fp32 master weights) and sampled/judged in (the
    engine), and the job's evaluation settings (``clawray eval``'s flags, so its figures reproduce
    the job's ``eval/*``).

    Args:
        cfg: the run's config (``rollout``, ``env``, ``eval``, ``model`` sections).
        version: the policy version of the saved weights; ``steps_done``: driver steps.
    """
    ro, env, ev = cfg.rollout, cfg.env, cfg.eval
    return {
        "policy_version": int(version),
        "steps_done": int(steps_done),
        "base_model": str(cfg.model.path),
        "learner_dtype": "float32",
        "engine": {"backend": str(ro.backend), "dtype": engine_dtype(str(ro.backend), str(ro.dtype))},
        "eval": {
            "env": str(env.name),
            "level": int(env.level),
            "data_path": str(env.data_path),
            "n": int(ev.n),
            "num_prompts": int(ev.num_prompts),
            "temperature": float(ev.temperature),
            "seed": int(ev.seed),
            "max_tokens": int(env.max_tokens),
        },
    }


def write_policy_card(model_dir: str, card: dict) -> None:
    """Write :func:`policy_card`'s dict as ``model_dir/clawray.json`` (mode 0600)."""
    with open_private(os.path.join(model_dir, POLICY_CARD), "w") as f:
        json.dump(card, f, indent=2)


def read_policy_card(model_dir: str) -> dict | None:
    """The policy card of a model folder, or None when it has none (a plain HF folder) or it is not
    a JSON object."""
    try:
        with open(os.path.join(model_dir, POLICY_CARD)) as f:
            card = json.load(f)
    except (OSError, ValueError):
        return None
    return card if isinstance(card, dict) else None
