"""The web view: ``GET /ui``, one page that draws ``GET /status`` live.

One HTML file shipped with the package (``webview.html``), its CSS and JavaScript
inline: no build step, nothing fetched from anywhere else.  The page polls
``status`` next to its own address once a second (``/ui`` reads ``/status``,
``/t/<token>/ui`` reads ``/t/<token>/status``), so it needs exactly the
authorisation ``/status`` needs and holds no secret itself.  Its
Content-Security-Policy allows only those two inline blocks (by their SHA-256)
and requests to its own origin.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources
from typing import Final

__all__ = ["PAGE_FILE", "page"]

#: the page, next to this module in the package
PAGE_FILE: Final = "webview.html"


def _source_hash(block: bytes) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(block).digest()).decode() + "'"


def _inline(tag: str, html: bytes) -> bytes:
    found = re.search(rb"<" + tag.encode() + rb">(.*?)</" + tag.encode() + rb">", html, re.S)
    if found is None:
        raise RuntimeError(f"{PAGE_FILE} has no <{tag}> block")
    return found.group(1)


@functools.cache
def page() -> tuple[bytes, dict[str, str]]:
    """The page's bytes and the headers it is served with (read once)."""
    html = resources.files(__package__).joinpath(PAGE_FILE).read_bytes()
    csp = "; ".join(
        (
            "default-src 'none'",
            f"script-src {_source_hash(_inline('script', html))}",
            f"style-src {_source_hash(_inline('style', html))}",
            "connect-src 'self'",  # GET status, nothing else
            "img-src 'none'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        )
    )
    headers = {
        "Content-Type": "text/html; charset=utf-8",
        "Content-Security-Policy": csp,
        "Cache-Control": "no-store",
        "Referrer-Policy": "no-referrer",  # a /t/<token>/ address never leaves in a Referer
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
    }
    return html, headers
