"""The few calls the runner makes to rank 0's control endpoint itself (the controller makes the
rest): health while starting, status for migration details, and stop-with-checkpoint.

Blocking urllib with short timeouts, run in a worker thread from async code.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

__all__ = ["Endpoint"]


class Endpoint:
    """Rank 0's control endpoint at `url`, writing with `token`."""

    def __init__(self, url: str, token: str | None, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if method != "GET" and self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                code, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            with e:
                code, raw = e.code, e.read()
        try:
            return code, json.loads(raw) if raw.strip() else None
        except ValueError:
            return code, raw.decode(errors="replace")

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(HTTP code, decoded body); raises OSError (URLError) when nothing answers."""
        return await asyncio.to_thread(self._call, method, path, body)

    async def healthy(self) -> bool:
        try:
            code, _ = await self.call("GET", "/healthz")
        except (OSError, urllib.error.URLError):
            return False
        return code == 200

    async def status(self) -> dict[str, Any] | None:
        """GET /status, or None when it cannot be had."""
        try:
            code, body = await self.call("GET", "/status")
        except (OSError, urllib.error.URLError):
            return None
        return body if code == 200 and isinstance(body, dict) else None
