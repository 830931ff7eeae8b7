"""Client-side helpers for tests that talk to the mock provider over raw HTTP."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

__all__ = ["parse_sse", "read_body", "split_sse"]


def split_sse(data: bytes) -> tuple[list[bytes], bytes]:
    """Split raw SSE bytes into complete frames (each ending in ``\\n\\n``) and a remainder."""
    frames: list[bytes] = []
    start = 0
    while True:
        end = data.find(b"\n\n", start)
        if end < 0:
            return frames, data[start:]
        frames.append(data[start : end + 2])
        start = end + 2


def parse_sse(frame: bytes) -> tuple[str | None, str]:
    """Parse one frame into ``(event name or None, data)``."""
    event: str | None = None
    data: list[str] = []
    for line in frame.decode("utf-8").splitlines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    return event, "\n".join(data)


def parse_sse_json(frame: bytes) -> tuple[str | None, Any]:
    """Like :func:`parse_sse` but decodes the data as JSON (raises on malformed frames)."""
    event, data = parse_sse(frame)
    return event, json.loads(data)


async def read_body(resp: aiohttp.ClientResponse) -> tuple[bytes, BaseException | None]:
    """Read a response body incrementally; return the bytes received and the error, if any.

    Unlike ``resp.read()`` this keeps the bytes that arrived before a reset.
    """
    chunks: list[bytes] = []
    try:
        while True:
            chunk = await resp.content.readany()
            if not chunk:
                break
            chunks.append(chunk)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return b"".join(chunks), exc
    return b"".join(chunks), None
