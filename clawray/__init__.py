"""clawray: online reinforcement learning of LLM agents from live conversations, on Ray.

Owns: ``__version__``. Must not: import a submodule (``import clawray`` loads no Ray, torch or engine).
"""

__version__ = "0.1.0"
