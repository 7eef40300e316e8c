"""Batch buckets: the batch sizes graphs are captured for, and which one a batch runs in."""
from __future__ import annotations

import bisect

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def validate_buckets(buckets) -> tuple[int, ...]:
    b = tuple(int(x) for x in buckets)
    if not b:
        raise ValueError("capture.buckets is empty: give ascending positive batch sizes, e.g. [1,2,4,8]")
    if any(x < 1 for x in b):
        raise ValueError(f"capture.buckets={list(b)}: every bucket must be a positive batch size")
    if any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(f"capture.buckets={list(b)}: must be strictly ascending, e.g. [1,2,4,8,16,32,64]")
    return b


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """Smallest bucket >= n (pad up to it), or None when n is above the largest bucket."""
    if n < 1:
        raise ValueError(f"batch of {n} rows")
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None
