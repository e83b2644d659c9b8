"""clawray: online reinforcement learning of LLM agents from live conversations, on Ray."""

__version__ = "0.1.0"
