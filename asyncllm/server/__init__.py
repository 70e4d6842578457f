"""The OpenAI-compatible HTTP / SSE / WebSocket server around AsyncLLM."""

from asyncllm.server.app import ServerArgs, build_app

__all__ = ["ServerArgs", "build_app"]
