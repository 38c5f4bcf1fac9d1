"""The doubly linked recency list both trace simulators keep (Numba): slots ordered from least to most recent
behind a sentinel ``head``; the device LRU's order (freetoken/testing/reference/cache.py) in O(1) per operation."""

from __future__ import annotations

import numba as nb


@nb.njit(cache=True, inline="always")
def unlink(nxt, prv, s):  # pragma: no cover - compiled
    """Take slot ``s`` out of the list."""
    nxt[prv[s]] = nxt[s]
    prv[nxt[s]] = prv[s]


@nb.njit(cache=True)
def sort_ids(a, n):  # pragma: no cover - compiled
    """Insertion sort of ``a[:n]`` in place (n is one call's handful of ids)."""
    for i in range(1, n):
        v = a[i]
        j = i - 1
        while j >= 0 and a[j] > v:
            a[j + 1] = a[j]
            j -= 1
        a[j + 1] = v


@nb.njit(cache=True)
def append_sorted(nxt, prv, head, touched, nt):  # pragma: no cover - compiled
    """Order the call's touched slots by slot index (they share the call's recency) and append them as the most
    recent."""
    sort_ids(touched, nt)
    for a in range(nt):
        s = touched[a]
        p = prv[head]
        nxt[p] = s
        prv[s] = p
        nxt[s] = head
        prv[head] = s


@nb.njit(cache=True, inline="always")
def push_least_recent(nxt, prv, head, s):  # pragma: no cover - compiled
    """Insert slot ``s`` as the least recent (the next victim): prefill's borrowed slots."""
    n = nxt[head]
    nxt[head] = s
    prv[s] = head
    nxt[s] = n
    prv[n] = s
