"""Two inputs that xxh3-128 (key format 1's hash) gives one digest, built by hand: the
attack a collision-resistant key hash must stop (docs/architecture.md, "Why SHA-256").

xxh3's long-input round adds, per 8-byte lane, the lane's value to its neighbour's
accumulator and the product of its two halves, each xored with the public secret, to its
own. A lane whose high half equals the secret's multiplies by zero, so only its value
counts; raise one such lane's low half by d and lower the same lane of the next stripe by
d, and every accumulator ends as it was."""

from __future__ import annotations

from collections.abc import Callable

import xxhash

# The first 64 bytes of xxh3's public default secret (kSecret in xxhash.h).
SECRET_HEAD = bytes.fromhex("b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
                            "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c")
_STRIPE = 64
_STRIPES_PER_BLOCK = 16  # (192 - 64) / 8 with the default secret: a scramble after each block


def xxh3_twins(prefix: bytes, body: bytes, usable: Callable[[bytes], bool] = lambda _: True,
               step: int = 7) -> tuple[bytes, bytes]:
    """(one, other): `body` with eight of its bytes set, twice, so that xxh3-128 hashes
    `prefix + one` and `prefix + other` alike although one and other differ in two lanes'
    low halves; the first pair of stripes that works and whose bodies are both `usable`
    (e.g. decode as finite numbers)."""
    whole = len(prefix) + len(body)
    for stripe in range(-(-len(prefix) // _STRIPE), (whole - _STRIPE) // _STRIPE - 1):
        if stripe % _STRIPES_PER_BLOCK == _STRIPES_PER_BLOCK - 1 or 8 * stripe + 16 > len(SECRET_HEAD):
            continue
        at = [_STRIPE * s - len(prefix) for s in (stripe, stripe + 1)]  # lane 0, in the body
        if at[1] + 8 > whole - len(prefix) - _STRIPE:  # the last 64 bytes are hashed apart
            break
        one, other = bytearray(body), bytearray(body)
        for s, where, delta in zip((stripe, stripe + 1), at, (step, -step), strict=True):
            low = int.from_bytes(body[where : where + 4], "little") % (1 << 31) + (1 << 30)
            high = SECRET_HEAD[8 * s + 4 : 8 * s + 8]
            one[where : where + 8] = low.to_bytes(4, "little") + high
            other[where : where + 8] = (low + delta).to_bytes(4, "little") + high
        if usable(bytes(one)) and usable(bytes(other)):
            assert xxhash.xxh3_128_digest(prefix + one) == xxhash.xxh3_128_digest(prefix + other)
            return bytes(one), bytes(other)
    raise ValueError("no pair of stripes fits in this body")
