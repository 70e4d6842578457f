"""The OpenAI-compatible HTTP / SSE / WebSocket server around AsyncLLM."""

from asyncllm.server.app import build_app
from asyncllm.server.args import ServerArgs

__all__ = ["ServerArgs", "build_app"]
