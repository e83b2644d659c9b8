"""Checkpoint folders: atomic commit, the ``latest`` pointer and pruning.

A checkpoint is written into a hidden temporary folder (``.tmp-ckpt-NNNNNN-PID``) and renamed to
``ckpt-NNNNNN`` only once every part is on disk; then the ``latest`` file (replaced atomically) names
it. A crash mid-write leaves a temporary folder that is ignored (and removed by the next commit),
never a broken ``latest``. Contents (see ``Driver.save_checkpoint`` and
``LearnerWorker.save_checkpoint``): ``model/`` (HF folder), ``train_state/`` (sharded optimizer and
weights), ``learner.pkl``, ``rng/``, ``queue.pkl`` (queued, untrained samples) and ``driver.json``.
With ``checkpoint.save_optimizer=false`` there is no ``train_state/`` (``driver.json`` has
``"resumable": false``): the model folder serves and evaluates, a resume refuses it.
"""

from __future__ import annotations

import os
import re
import shutil

from clawray.private import open_private, private_dir

_NAME = re.compile(r"^ckpt-(\d{6})$")


def list_checkpoints(root: str) -> list[str]:
    """Committed checkpoint folders under ``root``, oldest first (absolute paths)."""
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if _NAME.match(n) and os.path.isdir(os.path.join(root, n)))
    return [os.path.join(root, n) for n in names]


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
            shutil.rmtree(old, ignore_errors=True)
    return final


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
    runs float32 (the learners' precision)."""
    return dtype if backend == "vllm" else "float32"


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
    import json

    with open_private(os.path.join(model_dir, POLICY_CARD), "w") as f:
        json.dump(card, f, indent=2)


def read_policy_card(model_dir: str) -> dict | None:
    """The policy card of a model folder, or None when it has none (a plain HF folder) or it is not
    a JSON object."""
    import json

    try:
        with open(os.path.join(model_dir, POLICY_CARD)) as f:
            card = json.load(f)
    except (OSError, ValueError):
        return None
    return card if isinstance(card, dict) else None
