"""ServerArgs: the server's own settings (the engine's are EngineArgs)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    root_path: str = ""
    max_request_body_bytes: int = 4 * 1024 * 1024
    max_concurrent_requests: int = 0  # 0: no limit
    max_waiting_requests: int = 0  # requests not yet scheduled before 503; 0: no limit
    max_queue_wait: float = 0.0  # seconds a request may wait to be scheduled; 0: no limit
    trust_request_chat_template: bool = False  # accept chat_template in chat_template_kwargs
    keepalive_interval: float = 5.0  # seconds of silence before a `: keep-alive` comment
    shutdown_timeout: float = 30.0  # seconds in-flight streams get to finish on SIGTERM
    stream_retention: float = 300.0  # seconds a resumable stream outlives its last reader
    stream_buffer_bytes: int = 256 * 1024 * 1024  # events all resumable streams may hold
    response_store: str | None = None  # sqlite:///PATH; default: a file in the cache folder
    # a connection that has not sent a whole request this long after connecting (or after its
    # last response) is closed: idle keep-alive connections, and headers sent a byte at a time
    keep_alive_timeout: float = 75.0
    # a request's headers not all in this long after their first byte: 408, closed (nginx's
    # client_header_timeout); 0: only the keep-alive timeout bounds them
    header_timeout: float = 60.0
    body_timeout: float = 60.0  # a request's body not all in this long after its headers: 408
    engine_restart: bool = True  # a dead engine core is replaced by a new one
    engine_restarts_per_minute: int = 3  # past this, a dead engine stays down (/health 503)
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral: reads tool calls
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1: reasoning_content apart

    @classmethod
    def from_namespace(cls, namespace: Any) -> ServerArgs:
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(namespace, n) for n in names if hasattr(namespace, n)})
