"""The OpenAI-compatible PolicyServer (Ray Serve + FastAPI)."""
