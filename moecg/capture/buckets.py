"""Batch buckets: the batch sizes graphs are captured for, and which one a batch runs in."""
from __future__ import annotations

import bisect

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
EXAMPLE = "capture.buckets=[1,2,4,8]"


def validate_buckets(buckets) -> tuple[int, ...]:
    items = [buckets] if isinstance(buckets, (str, int, float)) else buckets
    try:
        b = tuple(items)
    except TypeError:
        b = None
    whole = b is not None and all(not isinstance(x, bool) and (isinstance(x, int) or isinstance(x, float)
                                                             and x.is_integer()) for x in b)
    if not whole:
        raise ValueError(f"capture.buckets={buckets!r}: must be a list of batch sizes (integers), e.g. {EXAMPLE}")
    b = tuple(int(x) for x in b)
    if not b:
        raise ValueError(f"capture.buckets is empty: give ascending positive batch sizes, e.g. {EXAMPLE}")
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
