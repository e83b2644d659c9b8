"""The OpenAI-compatible PolicyServer (Ray Serve + FastAPI).

Must not: import its modules (``import clawray.serve`` loads neither Serve nor FastAPI).
"""
