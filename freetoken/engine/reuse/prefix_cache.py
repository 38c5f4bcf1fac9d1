"""A radix prefix cache over the paged KV pool: the K/V blocks of earlier sequences, found again by their token ids.

Every node below the root is one KV block and the token ids whose keys and values it holds: a full block has
``block_size`` of them, a partial one (the last block of a finished sequence) fewer, and a node's path from the root
spells the tokens before it. The tree holds one reference to each node's block (:meth:`KVPool.retain`), so a block
outlives the sequence that wrote it for as long as its node is in the tree.

* :meth:`RadixCache.insert` adds a sequence's blocks (a finished one with its partial last block; an in-flight one
  with the full blocks of its prompt). Tokens already in the tree keep the block they have.
* :meth:`RadixCache.match` finds the longest prefix of a new sequence the tree holds: whole blocks down the tree,
  then the longest common start with one block below the last match (a block whose first rows are this sequence's:
  the sequence shares it, and copies it before writing into it, :meth:`KVSequence.prepare`).
* :meth:`RadixCache.evict` drops least-recently-used leaves that nobody but the tree holds, when the pool needs
  room (the cache registers it with :attr:`KVPool.reclaimers`).

The match is by token ids, exactly: a block is reused only for the very tokens it was computed from, at the same
positions (the path fixes them), so the reused K/V rows are the rows a prefill would write, up to the order of
floating-point sums of a prefill chunked at other places.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from freetoken.models.kv import KVPool


@dataclass(eq=False)
class _Node:
    tokens: tuple  # the block's token ids (block_size of them, fewer for a partial block)
    block: int
    parent: _Node | None
    children: dict = field(default_factory=dict)  # tokens -> _Node
    last_use: int = 0


class RadixCache:
    """Blocks of ``pool`` by token prefix; registers :meth:`evict` as one of the pool's reclaimers."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.block_size = pool.block_size
        self.root = _Node((), -1, None)
        self._clock = 0
        self.nodes = 0
        self.evicted = 0  # blocks evicted so far
        pool.reclaimers.append(self.evict)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- lookup ----------------------------------------------------------------------------------------------
    def match(self, ids: Sequence[int], limit: int | None = None) -> tuple[list[int], int]:
        """(blocks, n): the first ``n`` tokens of ``ids`` (at most ``limit``) have their K/V rows in ``blocks``
        (position order; the last one may hold more rows than are this sequence's). The caller retains what it
        keeps (:meth:`KVSequence.adopt`)."""
        bs, now = self.block_size, self._tick()
        n_max = len(ids) if limit is None else min(limit, len(ids))
        node, blocks, n = self.root, [], 0
        while n < n_max:
            want = tuple(int(t) for t in ids[n:min(n + bs, n_max)])
            child = node.children.get(want) if len(want) == bs else None
            if child is not None:
                node, n = child, n + bs
                node.last_use = now
                blocks.append(node.block)
                continue
            best, common = None, 0  # the child sharing the longest start with what is left
            for c in node.children.values():
                k = _common(c.tokens, want)
                if k > common:
                    best, common = c, k
            if best is not None:
                best.last_use = now
                blocks.append(best.block)
                n += common
            break
        return blocks, n

    # ---- insertion --------------------------------------------------------------------------------------------
    def insert(self, ids: Sequence[int], blocks: Sequence[int], length: int | None = None) -> int:
        """Add the first ``length`` tokens of ``ids`` (default all), whose K/V rows are in ``blocks``; returns the
        number of blocks the tree took a reference to (nodes it did not have)."""
        bs, now = self.block_size, self._tick()
        length = len(ids) if length is None else int(length)
        if len(blocks) < -(-length // bs):
            raise ValueError(f"{length} tokens need {-(-length // bs)} blocks, {len(blocks)} given")
        node, added = self.root, 0
        for i in range(-(-length // bs)):
            toks = tuple(int(t) for t in ids[i * bs:min((i + 1) * bs, length)])
            child = node.children.get(toks)
            if child is None and len(toks) < bs and any(_common(c.tokens, toks) == len(toks)
                                                        for c in node.children.values()):
                break  # a partial block whose tokens another block already starts with: nothing new
            if child is None:
                for c in [c for c in node.children.values() if len(c.tokens) < len(toks)
                          and _common(c.tokens, toks) == len(c.tokens) and not c.children]:
                    self._remove(c)  # a partial block this one extends: the longer one serves every match it did
                self.pool.retain([blocks[i]])
                child = _Node(toks, int(blocks[i]), node)
                node.children[toks] = child
                self.nodes += 1
                added += 1
            child.last_use = now
            node = child
        return added

    # ---- eviction ---------------------------------------------------------------------------------------------
    def _remove(self, node: _Node) -> None:
        del node.parent.children[node.tokens]
        self.pool.release([node.block])
        self.nodes -= 1

    def evict(self, n: int) -> int:
        """Drop least-recently-used leaves whose block only the tree holds until ``n`` blocks are free again (or
        nothing more can go); returns the number of blocks freed."""
        heap = [(c.last_use, id(c), c) for c in self._leaves() if self.pool.refs[c.block] == 1]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._remove(node)
            freed += 1
            if parent is not self.root and not parent.children and self.pool.refs[parent.block] == 1:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        self.evicted += freed
        return freed

    def clear(self) -> None:
        """Drop every node (their blocks go back to the pool unless someone else holds them)."""
        while self.root.children:
            for leaf in list(self._leaves()):
                self._remove(leaf)

    def _leaves(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                yield node

    def held_blocks(self) -> list[int]:
        """Every block the tree holds a reference to."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node.block)
            stack.extend(node.children.values())
        return out


def _common(a: tuple, b: tuple) -> int:
    """Length of the common start of two token tuples."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
