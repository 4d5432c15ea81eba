"""Who may be served, decided before a request's body is read, and what the log keeps of each request.

Any web page can send requests to a server on loopback, so POSTs must be `application/json` (a form or
`text/plain` POST, which a browser sends cross-site without asking, is refused), a loopback server answers
only Host headers naming loopback (against DNS rebinding), and `--api-key` asks every client but /health and
the page's files (the walkthrough's among them) for `Authorization: Bearer KEY` (or `x-api-key: KEY`,
Anthropic's header). Every response under the page's paths carries the same Content-Security-Policy and frame-
ancestors, whichever route or file it comes from. The log line of a request is escaped: a path is the client's
text, and a raw newline or terminal control code in it (%0a, %1b) would forge log lines or drive the
operator's terminal.

Imports nothing of serving/ (it is the bottom of the folder, with protocol.py).
"""

from __future__ import annotations

import hmac
import ipaddress
import re

from ..errors import APIError

API_KEY_ENV = "QWEN_NP_API_KEY"
LOOPBACK_HOST = re.compile(r"(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?", re.IGNORECASE)
# Served without an API key: the page holds none (it asks for one), and the walkthrough (/docs/...) is opened by
# the page's links, which a browser follows without the key the page's scripts send.
PAGE_PATHS = ("/", "/web", "/docs")
# The page loads nothing from elsewhere, and says so to the browser: it runs offline, and a script
# injected through a model's output (shown as text, never as HTML) could not call out either; no other
# site may frame it. Sent with every response under PAGE_PATHS (app.create_app), files and errors alike.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff"}


def is_page(path: str) -> bool:
    """Whether `path` is the page itself (open to a browser without the API key the page then asks for)."""
    return path in PAGE_PATHS or path.startswith(tuple(folder + "/" for folder in PAGE_PATHS[1:]))


def is_loopback(host: str) -> bool:
    """Whether a listening address is this machine only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning printed at start when the server listens beyond this machine, or None."""
    if is_loopback(host):
        return None
    return (f"warning: listening on {host}: anyone who can reach this machine can use the server"
            + ("" if api_key else " (no --api-key is set)"))


def refusal(method: str, path: str, headers: dict[str, str], api_key: str | None,
            loopback_only: bool) -> APIError | None:
    """Why a request may not be served at all (before its body is read), or None."""
    if loopback_only and not LOOPBACK_HOST.fullmatch(headers.get("host", "")):
        # A page on a rebound DNS name reaches us under that name: only loopback names are ours.
        return APIError(400, "Host: this server answers only to localhost, 127.0.0.1 and [::1]", code="invalid_host")
    if api_key is not None and path != "/health" and not is_page(path):
        scheme, _, key = headers.get("authorization", "").partition(" ")
        bearer = scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), api_key.encode())
        anthropic = hmac.compare_digest(headers.get("x-api-key", "").strip().encode(), api_key.encode())
        if not bearer and not anthropic:
            return APIError(401, "Incorrect API key provided: send `Authorization: Bearer KEY` (or `x-api-key: KEY`, "
                                 "as Anthropic's clients do)", code="invalid_api_key")
    if method == "POST" and headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        # A page on any site may POST text/plain or a form here without the browser asking first.
        return APIError(415, "Content-Type: must be application/json")
    return None


def loggable(text: str) -> str:
    """`text` safe to write on one log line: a backslash and every character that is not printable
    (newlines, ESC and the other C0/C1 controls, bidirectional overrides, line separators: str.isprintable's
    rule) become Python escapes, so a client's %0a or %1b cannot start a line or reach the terminal."""
    return "".join(ch if ch.isprintable() and ch != "\\" else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def log_line(method: str, path: str, status: int, usage: dict[str, int] | None, seconds: float) -> str:
    """One request's line in the log: what was asked (escaped), the answer's status, tokens, time."""
    tokens = (f" prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}"
              if usage is not None else "")
    return f"{loggable(method)} {loggable(path)} {status}{tokens} {seconds:.3f}s"
