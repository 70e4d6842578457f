"""What a request carries through the server for its access-log line."""

from __future__ import annotations

from aiohttp import web

REQUEST_ID = web.RequestKey("request_id", str)  # the client's X-Request-Id, or a fresh one
RESPONSE_ID = web.RequestKey("response_id", str)  # the completion's id, for the access log
DROPPED = web.RequestKey("dropped", bool)  # the client went away mid-answer
