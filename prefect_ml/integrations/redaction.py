"""URLs for people: every URL that goes into a message, a log line or an artifact passes through
:func:`masked`, so a database or server password in a setting never reaches what a parameter
can make us print."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

MASK = "***"
# Query parameters that carry credentials (``?password=``, ``sslpassword``, ``X-Amz-Signature``).
_SECRET_PARAMETER = re.compile(
    r"(?i)([?&][^=&]*(?:password|passwd|secret|token|signature|credential|key)[^=&]*=)[^&#]*"
)


def masked(url: str) -> str:
    """``url`` with the password of its user info and the values of credential-like query
    parameters replaced by ``***``; the rest of it exactly as it was."""
    try:
        netloc = urlsplit(url).netloc
    except ValueError:  # not parseable as a URL (an unclosed IPv6 bracket): no user info kept
        netloc = ""
    user_info, at, host = netloc.rpartition("@")
    if at and ":" in user_info:
        start = url.index(netloc)
        url = (
            f"{url[:start]}{user_info.partition(':')[0]}:{MASK}@{host}{url[start + len(netloc) :]}"
        )
    return _SECRET_PARAMETER.sub(rf"\1{MASK}", url)
