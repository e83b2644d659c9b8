"""A learner group's part of a checkpoint: the HF model folder, the sharded train state, RNG, counters.

Owns: the layout of the learner's files inside a checkpoint folder (below), writing and restoring them.
Must not: import Ray, commit, point ``latest`` at or prune the folder (:mod:`clawray.checkpoint`), or
apply the scheduler state and counters it loads (the worker does).

:class:`~clawray.actors.learner.LearnerWorker` calls these from its thin ``save``,
``save_checkpoint`` and ``load_checkpoint`` actor methods. Layout inside a checkpoint folder:

* ``model/``: an HF folder of the full (LoRA-merged) float32 weights, plus the initial folder's
  tokenizer, chat template and generation config (it serves and evaluates as it is);
* ``train_state/``: ``torch.distributed.checkpoint`` of the AdamW state, plus the LoRA adapters
  with LoRA (:func:`train_state_weights`); one file per rank, so no rank gathers the optimizer state
  and a different number of ranks can load it;
* ``learner.pkl`` (rank 0): scheduler state, policy version, optimizer and skipped step counts,
  world size, LoRA rank and where the weights are (``weights``: ``model``, ``adapters``, or ``all``
  in ``train_state/`` for checkpoints of older versions);
* ``rng/rank{r}.pkl``: torch, python, numpy and CUDA RNG states of each rank.

A model-only checkpoint (``checkpoint.save_optimizer=false``) has no ``train_state/``: it cannot be
resumed (:func:`load_learner_state` raises). Every function that touches the sharded model is
collective: call it on every rank.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil

import numpy as np
import torch

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".gguf")


def save_hf_folder(hf_model: torch.nn.Module, state: dict[str, torch.Tensor], init_folder: str, path: str) -> None:
    """Write ``state`` (the full float32 state dict, base names) as an HF folder at ``path`` (rank 0
    only), plus every non-weight file of ``init_folder`` (tokenizer, chat template, generation
    config) that the save did not write. A tied output embedding is stored once."""
    os.makedirs(path, exist_ok=True)
    out_emb, in_emb = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    if out_emb is not None and out_emb.weight is in_emb.weight:  # tied: store the matrix once
        name = next(n for n, m in hf_model.named_modules() if m is out_emb)
        state = {k: v for k, v in state.items() if k != f"{name}.weight"}
    hf_model.save_pretrained(path, state_dict=state)
    for name in os.listdir(init_folder):
        src = os.path.join(init_folder, name)
        if (
            os.path.isfile(src)
            and not name.endswith(WEIGHT_FILES)
            and name != "config.json"
            and not name.endswith(".index.json")
            and not os.path.exists(os.path.join(path, name))
        ):
            shutil.copy2(src, os.path.join(path, name))


def train_state_weights(model_sd: dict, lora_rank: int) -> dict:
    """The weights a resumable checkpoint keeps in ``train_state/`` beside the optimizer.

    Full fine-tuning (``lora_rank`` 0): none, since ``model/`` already holds every weight in float32
    (the training dtype), so storing them again would double the checkpoint (SmolLM2-135M: 0.54 GB).
    LoRA: the adapters only (``model/`` holds the *merged* weights, which cannot be split back; the
    frozen base weights are reloaded from the initial model folder at start-up).
    """
    if lora_rank == 0:
        return {}
    return {k: v for k, v in model_sd.items() if ".lora_" in k}


def load_hf_weights(model: torch.nn.Module, hf_model: torch.nn.Module, folder: str, keys: list[str]) -> None:
    """Load the float32 weights of an HF folder written by :func:`save_hf_folder` into the sharded
    ``model`` (every rank reads the files; full fine-tuning only). ``keys``: the model's state-dict
    names (``get_state_dict``). A tied output embedding, stored once, is filled from the input one.

    Raises:
        FileNotFoundError: ``folder`` has no ``*.safetensors`` file.
        RuntimeError: a weight of the model is missing from the folder.
    """
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint model folder {folder} has no .safetensors file")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(folder, name)))
    out_emb, in_emb = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    if out_emb is not None and out_emb.weight is in_emb.weight:
        out_name = next(n for n, m in hf_model.named_modules() if m is out_emb)
        in_name = next(n for n, m in hf_model.named_modules() if m is in_emb)
        state.setdefault(f"{out_name}.weight", state.get(f"{in_name}.weight"))
    missing = [k for k in keys if state.get(k) is None]
    if missing:
        raise RuntimeError(f"checkpoint model folder {folder} lacks {len(missing)} weight(s), e.g. {missing[0]}")
    set_model_state_dict(model, {k: state[k].float() for k in keys}, options=StateDictOptions(full_state_dict=True))


def save_learner_state(
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    meta: dict,
    save_optimizer: bool = True,
) -> None:
    """Write ``train_state/`` (unless not ``save_optimizer``), this rank's ``rng/rank{r}.pkl`` and (rank
    0) ``meta`` as ``learner.pkl`` into the checkpoint folder ``path``; ends with a barrier. Collective.

    Args:
        meta: ``{"scheduler", "version", "optimizer_steps", "skipped_steps", "world_size",
            "lora_rank", "weights"}`` (see the module docstring).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if save_optimizer:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        model_sd = train_state_weights(model_sd, meta["lora_rank"])
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "train_state"))
    os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    rng = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    with open(os.path.join(path, "rng", f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(rng, f)
    if rank == 0:
        with open(os.path.join(path, "learner.pkl"), "wb") as f:
            pickle.dump(meta, f)
    dist.barrier()


def load_learner_state(
    path: str,
    model: torch.nn.Module,
    hf_model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    lora_rank: int,
) -> dict:
    """Restore the weights, the optimizer state and this rank's RNG states from a checkpoint folder
    written by :func:`save_learner_state`; ends with a barrier. Collective.

    Args:
        hf_model: the transformers model inside ``model`` (the model itself without LoRA).
        lora_rank: the learner's LoRA rank (0: full fine-tuning); it must match the checkpoint's.

    Returns:
        the checkpoint's ``learner.pkl`` (scheduler state and counters, for the caller to apply).

    Raises:
        FileNotFoundError: ``path`` lacks ``train_state/`` or ``learner.pkl`` (a model-only checkpoint).
        ValueError: the checkpoint was made with a different LoRA rank.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    for name in ("train_state", "learner.pkl"):
        if not os.path.exists(os.path.join(path, name)):
            raise FileNotFoundError(f"checkpoint {path} has no {name}")
    with open(os.path.join(path, "learner.pkl"), "rb") as f:
        meta = pickle.load(f)
    if meta["lora_rank"] != lora_rank:
        raise ValueError(f"checkpoint {path} has LoRA rank {meta['lora_rank']}, the learner {lora_rank}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    weights = meta.get("weights", "all")  # where the weights are: model/, adapters or (older) all in train_state
    stored = {"model": {}, "adapters": train_state_weights(model_sd, lora_rank)}.get(weights, model_sd)
    state = {"model": stored, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(path, "train_state"))
    if weights == "model":
        load_hf_weights(model, hf_model, os.path.join(path, "model"), list(model_sd))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(strict=weights == "all"),
    )
    rng_file = os.path.join(path, "rng", f"rank{rank}.pkl")
    if os.path.exists(rng_file):  # absent when the group grew: the new rank keeps its seed
        with open(rng_file, "rb") as f:
            rng = pickle.load(f)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    dist.barrier()
    return meta
