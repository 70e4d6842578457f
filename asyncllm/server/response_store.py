"""Where the Responses API keeps its responses: behind ResponseStore, so a shared store (Redis,
Postgres) can serve several replicas; SQLite by default, a file that survives a restart."""

from __future__ import annotations

import asyncio
import sqlite3
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from asyncllm.model_files.gguf_convert import cache_dir

SQLITE_PREFIX = "sqlite:///"


class ResponseStoreError(RuntimeError):
    pass


@dataclass
class StoredResponse:
    """A response object and the conversation that led to it (for previous_response_id)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)  # its input, history included


class ResponseStore(ABC):
    @abstractmethod
    async def put(self, stored: StoredResponse) -> None: ...

    @abstractmethod
    async def get(self, response_id: str) -> StoredResponse | None: ...

    @abstractmethod
    async def delete(self, response_id: str) -> bool:
        """False when there was no such response."""

    @abstractmethod
    def close(self) -> None: ...


class SQLiteResponseStore(ResponseStore):
    """One table, one connection, used from one thread: every query runs off the event loop."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="response-store")
        self._db: sqlite3.Connection = self._thread.submit(self._connect).result()

    def _connect(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(
                "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, record BLOB NOT NULL)"
            )
            db.commit()
        except (OSError, sqlite3.Error) as e:
            raise ResponseStoreError(
                f"cannot open the response store {self.path} ({e}); pass --response-store "
                f"{SQLITE_PREFIX}PATH with a writable path"
            ) from e
        return db

    async def _run(self, query: str, *args: Any) -> list[tuple]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._execute, query, args)

    def _execute(self, query: str, args: tuple) -> list[tuple]:
        try:
            cursor = self._db.execute(query, args)
            rows = cursor.fetchall() if cursor.description else [(cursor.rowcount,)]
            self._db.commit()
        except sqlite3.Error as e:
            raise ResponseStoreError(f"the response store {self.path} failed: {e}") from e
        return rows

    async def put(self, stored: StoredResponse) -> None:
        record = orjson.dumps({"response": stored.response, "messages": stored.messages})
        query = "INSERT OR REPLACE INTO responses (id, record) VALUES (?, ?)"
        await self._run(query, stored.response["id"], record)

    async def get(self, response_id: str) -> StoredResponse | None:
        rows = await self._run("SELECT record FROM responses WHERE id = ?", response_id)
        return StoredResponse(**orjson.loads(rows[0][0])) if rows else None

    async def delete(self, response_id: str) -> bool:
        rows = await self._run("DELETE FROM responses WHERE id = ?", response_id)
        return rows[0][0] > 0

    def close(self) -> None:
        self._thread.submit(self._db.close).result()
        self._thread.shutdown()


def default_store_url() -> str:
    return SQLITE_PREFIX + str(cache_dir() / "responses.sqlite3")


def open_response_store(url: str | None) -> ResponseStore:
    """--response-store: sqlite:///PATH (an absolute path: sqlite:////tmp/r.db)."""
    url = url or default_store_url()
    if not url.startswith(SQLITE_PREFIX):
        raise ResponseStoreError(f"--response-store must be {SQLITE_PREFIX}PATH, not {url!r}")
    return SQLiteResponseStore(Path(url.removeprefix(SQLITE_PREFIX)).expanduser())
