"""Reading HTTP responses defensively, shared by every runner that speaks HTTP.

- A response is read through a byte bound: a server that answers a 32-token request with 50 MB is cut
  off at the bound and the request fails naming the size, instead of filling memory and the run.
  The bound follows from what was asked (`response_limit`) and never exceeds a hard cap.
- Streams are split into lines here, not by the HTTP client, so one endless line cannot grow without bound.
- Both clients are read: an httpx response (llama-server's runner) or an aiohttp one (the http runner).
- `transport_error` names an aiohttp failure as what happened (ConnectError, ConnectTimeout, ReadTimeout,
  RemoteProtocolError, ReadError), with the method, URL and limit where a timeout's own text is empty.
- `describe` spells an exception as "Type: detail" even when the exception's own text is empty
  (httpx's timeouts often are), so no record ends in an empty colon.
- `retry_after_s` reads a `Retry-After` header (seconds or an HTTP date).
"""
from __future__ import annotations

import email.utils
import time
from typing import Any, AsyncIterator

import httpx

from moebench.runners.base import RunnerError

DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
# Room for the envelope (ids, usage, timings) and per generated token: a streamed token's event with
# its metadata is a few hundred bytes; each top-logprob alternative adds its token text, id and bytes.
ENVELOPE_BYTES = 64 * 1024
BYTES_PER_TOKEN = 2048
BYTES_PER_ALTERNATIVE = 256


class ResponseTooLarge(RunnerError):
    """The server sent more than the bound allows for this request."""


def response_limit(max_tokens: int | None, top_logprobs: int = 0,
                   hard_cap: int = DEFAULT_MAX_RESPONSE_BYTES) -> int:
    """Bytes a well-behaved reply to a request for `max_tokens` tokens stays under (never above the cap)."""
    if not max_tokens or max_tokens <= 0:
        return hard_cap
    derived = ENVELOPE_BYTES + max_tokens * (BYTES_PER_TOKEN + max(0, top_logprobs) * BYTES_PER_ALTERNATIVE)
    return min(derived, hard_cap)


def _too_large(where: str, size: int, limit: int, declared: bool = False) -> ResponseTooLarge:
    what = "declares" if declared else "exceeded"
    return ResponseTooLarge(f"{where}: response {what} {size:,} bytes, over the bound of {limit:,} bytes "
                            f"for this request; cut off (raise max_response_bytes if this is expected)")


def _chunks(resp: Any) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive: httpx's aiter_bytes, or aiohttp's content.iter_any."""
    aiter_bytes = getattr(resp, "aiter_bytes", None)
    return aiter_bytes() if aiter_bytes is not None else resp.content.iter_any()


async def read_bounded(resp: Any, limit: int, where: str) -> bytes:
    """The whole body of a streamed-open response, or ResponseTooLarge once it passes `limit`."""
    declared = resp.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(where, int(declared), limit, declared=True)
    buf = bytearray()
    async for chunk in _chunks(resp):
        buf += chunk
        if len(buf) > limit:
            raise _too_large(where, len(buf), limit)
    return bytes(buf)


async def bounded_lines(resp: Any, limit: int, where: str) -> AsyncIterator[str]:
    """The lines of a streamed response (SSE), decoded; ResponseTooLarge once the total passes `limit`."""
    total = 0
    pending = b""
    async for chunk in _chunks(resp):
        total += len(chunk)
        if total > limit:
            raise _too_large(where, total, limit)
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            yield raw.rstrip(b"\r").decode("utf-8", "replace")
    if pending:
        yield pending.rstrip(b"\r").decode("utf-8", "replace")


class TransportError(Exception):
    """The request failed below HTTP: no connection, a timeout, a connection cut mid-reply."""


class ConnectError(TransportError):
    """No connection could be made (refused, no route, name not resolved, TLS handshake failed)."""


class ConnectTimeout(TransportError):
    """The connection was not made within connect_timeout_s."""


class ReadTimeout(TransportError):
    """No byte of the reply arrived within timeout_s."""


class RemoteProtocolError(TransportError):
    """The server broke HTTP: closed the connection early, a malformed status line or body."""


class ReadError(TransportError):
    """The connection failed while the request was being sent or its reply read."""


def transport_error(e: Exception, method: str, url: str, connect_s: float | None,
                    read_s: float | None) -> TransportError:
    """An aiohttp failure as a TransportError subclass that says what happened."""
    import aiohttp

    detail = str(e).strip()
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        limit = f" after {connect_s:g} s" if connect_s is not None else ""
        return ConnectTimeout(f"{method} {url}: no connect progress{limit}")
    if isinstance(e, aiohttp.ServerTimeoutError):
        limit = f" after {read_s:g} s" if read_s is not None else ""
        return ReadTimeout(f"{method} {url}: no read progress{limit}")
    if isinstance(e, aiohttp.ClientConnectorError):
        return ConnectError(detail or f"{method} {url}: no connection")
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError)):
        return RemoteProtocolError(f"{method} {url}: {detail or type(e).__name__}")
    return ReadError(f"{method} {url}: {type(e).__name__}: {detail or 'no detail given'}")


def describe(e: BaseException) -> str:
    """'Type: detail', with a detail even when str(e) is empty."""
    detail = str(e).strip()
    if not detail:
        cause = e.__cause__ or e.__context__
        if cause is not None and str(cause).strip():
            detail = f"{type(cause).__name__}: {str(cause).strip()}"
        elif isinstance(e, httpx.TimeoutException):
            detail = _timeout_detail(e)
        else:
            detail = "no detail given" if repr(e) == f"{type(e).__name__}()" else repr(e)
    return f"{type(e).__name__}: {detail}"


def _timeout_detail(e: httpx.TimeoutException) -> str:
    kind = {httpx.ConnectTimeout: "connect", httpx.ReadTimeout: "read", httpx.WriteTimeout: "write",
            httpx.PoolTimeout: "pool"}.get(type(e), "")
    try:
        request = e.request
    except RuntimeError:
        request = None
    if request is None:
        return f"no {kind} progress within the timeout".replace("  ", " ")
    limit = (request.extensions.get("timeout") or {}).get(kind) if kind else None
    after = f" after {limit:g} s" if isinstance(limit, (int, float)) else ""
    return f"{request.method} {request.url}: no {kind} progress{after}".replace("  ", " ")


def retry_after_s(value: str | None) -> float | None:
    """Seconds a `Retry-After` header asks to wait (delta-seconds or an HTTP date); None when absent or bad."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - time.time())
