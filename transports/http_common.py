"""What both ends of the HTTP transport agree on: the paths, the header that carries a bucket's
msgpack header, socket and read sizes, the per-run token, and the strict `Content-Length`
parser (see `transports.http`). A leaf: imports nothing of this package."""

from __future__ import annotations

import re
import secrets

BUCKET_PATH = "/inflight/v1/bucket"
HEALTH_PATH = "/inflight/v1/health"
HEADER = "X-Inflight-Header"
SOCKET_BUFFER = 8 << 20  # asked for; the kernel caps it (net.core.[rw]mem_max)
_MAX_HEAD = 64 << 10
_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)
_CRC_CHUNK = 1 << 20  # bytes read per call while checksumming: the checksum reads them from cache
_DIGITS = re.compile(r"[0-9]{1,18}")


def new_token() -> str:
    """A per-run secret for the bucket receivers (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def content_length(values: list[str] | None) -> int | None:
    """The body length of a request's `Content-Length` header(s): None when absent; raises
    ValueError for a non-numeric or negative value, or several that disagree."""
    if not values:
        return None
    lengths = {v.strip() for v in values}
    if len(lengths) != 1:
        raise ValueError(f"conflicting Content-Length values {sorted(lengths)}")
    (text,) = lengths
    if not _DIGITS.fullmatch(text):
        raise ValueError(f"Content-Length {text!r} is not a non-negative decimal number")
    return int(text)
