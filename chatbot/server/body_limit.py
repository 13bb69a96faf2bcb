"""The request body cap of `chatbot serve`: an ASGI middleware that reads a body whole, up to a
limit, before the app parses it."""

from __future__ import annotations

from typing import Any

from chatbot.server.protocol import APIError

# The default cap on a request body: 128 bytes per token of context, at least 1 MiB. A prompt
# that fills the context is about 4 bytes a token of English, up to 6x that JSON-escaped
# (`\u4e2d` for a 3-byte character), and no token stands for more than ~100 bytes (SmolLM2's
# longest, a run of spaces, is 81): an 8k context gets 1 MiB, a 128k one 16 MiB.
BODY_BYTES_PER_TOKEN = 128
MIN_BODY_BYTES = 1 << 20


def default_max_body(max_context: int) -> int:
    """The body cap `chatbot serve` uses unless --max-body says otherwise."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_context)


class BodyLimit:
    """ASGI middleware: a request body is read whole, up to `max_bytes`, before the app sees
    it. Over the cap (by Content-Length, before reading, or counted as a chunked body
    arrives) is a 413 at once; bytes that are not UTF-8 are a 400 (JSON between systems is
    UTF-8, and a body of raw bytes would otherwise reach the parser's generic error).

    The app then reads the buffered body, and after it the connection's own messages (a
    disconnect). The rest of a refused body is read and dropped by uvicorn, so the client
    gets the answer and the connection stays usable; memory stays at the cap.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(int(declared)).response()(scope, receive, send)
            return
        parts: list[bytes] = []
        size = 0
        left: dict[str, Any] | None = None  # the client went away before the body was whole
        while True:
            message = await receive()
            if message["type"] != "http.request":
                left = message
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(None).response()(scope, receive, send)
                return
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = body[exc.start : exc.start + 1].hex()
            error = APIError(400, f"the body is not UTF-8: byte 0x{bad} at offset {exc.start:,}")
            await error.response()(scope, receive, send)
            return
        pending = [left or {"type": "http.request", "body": body, "more_body": False}]

        async def replay() -> dict[str, Any]:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    def _too_large(self, declared: int | None) -> APIError:
        size = f" ({declared:,} bytes)" if declared is not None else ""
        return APIError(
            413,
            f"the request body{size} is over this server's limit of {self.max_bytes:,} bytes "
            "(chatbot serve --max-body)",
            code="request_too_large",
        )
