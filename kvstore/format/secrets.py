"""Secrets kept out of what kvstore prints: the password in a URL, masked.

A Redis index URL may carry a password (`redis://USER:PASSWORD@HOST`, or redis-py's
`?password=` query argument). Whatever is printed or logged (log lines, `kvstore info`,
config errors, the service's error replies) passes through `masked` or `masked_url`
first, so no secret reaches a log file, a terminal or another user's client. The masks
keep the user name and the host: what someone fixing a config needs to see.
"""

from __future__ import annotations

import re

MASK = "***"
# A URL inside free text: a scheme, then anything up to white space or a quote.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"]*")
_SECRET_ARGUMENT = re.compile(r"(?i)((?:^|&)[^&=]*(?:password|passwd|secret|token)[^&=]*=)[^&]*")


def masked_url(url: str) -> str:
    """`url` with its password (userinfo after the first `:`, and any query argument whose
    name says password, secret or token) replaced by ***; a URL without one unchanged.
    Userinfo ends at the URL's last `@`, so a raw `@`, `/`, `?` or `#` in a password is
    hidden too (at worst more than the password is)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    at = rest.rfind("@")
    if at >= 0 and ":" in rest[:at]:
        rest = f"{rest[:at].partition(':')[0]}:{MASK}{rest[at:]}"
    question = rest.find("?", rest.rfind("@") + 1)
    if question >= 0:
        query, hash_, fragment = rest[question + 1 :].partition("#")
        rest = f"{rest[:question]}?{_SECRET_ARGUMENT.sub(_hide_value, query)}{hash_}{fragment}"
    return f"{scheme}://{rest}"


def _hide_value(argument: re.Match[str]) -> str:
    return argument.group(1) + MASK


def masked(text: str) -> str:
    """`text` with every URL in it masked (masked_url): for messages that may quote a
    config value or a whole config. A URL there ends at white space or a quote, so a
    password holding one is masked only up to it (URL-encode such passwords)."""
    return _URL.sub(lambda match: masked_url(match.group(0)), text)
