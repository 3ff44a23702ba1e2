"""Routing policies over replicas: which replica serves the next request.

Small pure classes (no HTTP, no clock), so the HTTP router
(``tinyserve.serving.router``) and the simulated cluster (``tinyserve.sim.cluster``) make
the very same decisions. They belong to neither: both layers import them from here,
below them.

* ``round_robin``: replica 0, 1, 2, ..., 0, ... whatever the load.
* ``least_outstanding``: the replica with the fewest requests in flight
  (ties go round-robin, so an idle fleet still spreads).
* ``cache_aware``: each replica gets a prefix tree of the keys routed to it,
  an estimate of what its prefix cache holds. A request goes to the replica
  whose tree shares the longest prefix with its key, so requests with the same
  system prompt meet the same cached blocks. Two guards (defaults below):
  if the fleet is imbalanced (max - min outstanding > ``balance_abs_threshold``
  and max > ``balance_rel_threshold`` * min) or the best match covers less than
  ``min_match_ratio`` of the key, the request goes to the least loaded replica
  instead. Either way the key is recorded in the chosen replica's tree. Each
  tree holds at most ``max_tree_size`` elements and forgets its least recently
  used leaves first, as the replica's cache would.
  The idea (prefix trees in the router, a load-balance escape hatch) is the one
  of SGLang's cache-aware router; this is an independent implementation.

The key of a request is its token ids when the prompt is a list of ids, the
prompt string otherwise (for chat, the rendered messages).
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

# ---- the policies -------------------------------------------------------------------


class RoutingPolicy:
    name = "base"

    def __init__(self, num_replicas: int):
        if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
        self.num_replicas = num_replicas

    def choose(self, key: Sequence, outstanding: list[int]) -> int:
        raise NotImplementedError

    def on_finish(self, replica: int, key: Sequence) -> None:
        """Called when a routed request completes (default: nothing to update)."""

    def _check(self, outstanding: list[int]) -> None:
        if len(outstanding) != self.num_replicas:
            raise ValueError(f"outstanding has {len(outstanding)} entries for "
                             f"{self.num_replicas} replicas")


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self, num_replicas: int):
        super().__init__(num_replicas)
        self._next = 0          # the replica whose turn it is

    def choose(self, key, outstanding):
        self._check(outstanding)
        return self._take_turn(self._next)

    def _take_turn(self, replica: int) -> int:
        self._next = (replica + 1) % self.num_replicas
        return replica


def _least_loaded(outstanding: list[int], start: int) -> int:
    """Index of the minimum, ties broken by the first one at or after ``start``."""
    n = len(outstanding)
    low = min(outstanding)
    for k in range(n):
        i = (start + k) % n
        if outstanding[i] == low:
            return i
    raise AssertionError("unreachable")


class LeastOutstanding(RoundRobin):
    """The fewest requests in flight; ties go round-robin, so an idle fleet still spreads."""
    name = "least_outstanding"

    def choose(self, key, outstanding):
        self._check(outstanding)
        return self._take_turn(_least_loaded(outstanding, self._next))


class _Node:
    __slots__ = ("edge", "children", "parent", "last_used")

    def __init__(self, edge: Sequence, parent: "_Node | None", last_used: int):
        self.edge = edge                    # elements on the edge from the parent to here
        self.children: dict[Any, _Node] = {}
        self.parent = parent
        self.last_used = last_used


def _common(a: Sequence, a_start: int, b: Sequence) -> int:
    """Length of the common prefix of ``a[a_start:]`` and ``b``."""
    n = min(len(a) - a_start, len(b))
    if a[a_start:a_start + n] == b[:n]:     # fast path: the whole edge matches
        return n
    i = 0
    while i < n and a[a_start + i] == b[i]:
        i += 1
    return i


class PrefixTree:
    """A radix tree of sequences with a size budget and LRU eviction of leaves.

    ``size`` counts stored elements (the sum of edge lengths), so memory stays
    bounded by ``max_size`` whatever the number of keys.
    """

    def __init__(self, max_size: int = 1 << 16):
        if not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"max_tree_size must be an integer >= 1, got {max_size!r}")
        self.max_size = max_size
        self.root = _Node((), None, 0)
        self.size = 0
        self._clock = itertools.count(1)

    @staticmethod
    def _normalize(key: Sequence) -> Sequence:
        return key if isinstance(key, (str, tuple)) else tuple(key)

    def match(self, key: Sequence) -> int:
        """Length of the longest prefix of ``key`` stored in the tree (read-only)."""
        key = self._normalize(key)
        node, i = self.root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            k = _common(key, i, child.edge)
            i += k
            if k < len(child.edge):
                break
            node = child
        return i

    def insert(self, key: Sequence) -> None:
        """Record ``key``; touch its path so it is the last to be evicted."""
        key = self._normalize(key)
        now = next(self._clock)
        node, i = self.root, 0
        node.last_used = now
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf = _Node(key[i:], node, now)
                node.children[key[i]] = leaf
                self.size += len(leaf.edge)
                break
            k = _common(key, i, child.edge)
            if k < len(child.edge):         # split the edge at the mismatch
                mid = _Node(child.edge[:k], node, now)
                node.children[key[i]] = mid
                child.edge = child.edge[k:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            child.last_used = now
            node, i = child, i + k
        if self.size > self.max_size:
            self._evict()

    def _evict(self) -> None:
        # Down to 90% of the budget at once, so eviction's tree walk is amortized.
        target = self.max_size * 9 // 10
        while self.size > target:
            leaves = sorted(self._leaves(), key=lambda n: n.last_used)
            if not leaves:
                return
            for leaf in leaves:
                if self.size <= target:
                    break
                self._remove_leaf(leaf)

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    def _remove_leaf(self, leaf: _Node) -> None:
        parent = leaf.parent
        del parent.children[leaf.edge[0]]
        self.size -= len(leaf.edge)
        # A parent left with one child is merged with it, keeping the tree compact.
        if parent is not self.root and len(parent.children) == 1:
            (only,) = parent.children.values()
            parent.edge = parent.edge + only.edge
            parent.children = only.children
            for c in parent.children.values():
                c.parent = parent
            parent.last_used = max(parent.last_used, only.last_used)


def imbalanced(outstanding: list[int], abs_threshold: int, rel_threshold: float) -> bool:
    """The cache-aware rule's load guard: the busiest replica has more than
    ``abs_threshold`` requests more than the idlest, and more than ``rel_threshold``
    times as many."""
    hi, lo = max(outstanding), min(outstanding)
    return hi - lo > abs_threshold and hi > rel_threshold * lo


def cache_aware_choice(key, outstanding: list[int], trees: list[PrefixTree], abs_threshold: int,
                       rel_threshold: float, min_match_ratio: float, tie_start: int = 0) -> tuple[int, bool]:
    """Where the cache-aware rule sends ``key``, and whether the prefix match decided.

    Unless the load is imbalanced, the replica whose tree holds the longest prefix of
    ``key`` (the less loaded among equal matches), if that match is at least
    ``min_match_ratio`` of the key; otherwise the least loaded replica, ties to the
    first at or after ``tie_start``. Reads ``trees`` and leaves them as they are.
    """
    if not imbalanced(outstanding, abs_threshold, rel_threshold):
        matches = [tree.match(key) for tree in trees]
        best = max(matches)
        if best > 0 and best >= min_match_ratio * len(key):
            return min((i for i in range(len(trees)) if matches[i] == best),
                       key=lambda i: outstanding[i]), True
    return _least_loaded(outstanding, tie_start), False


class CacheAware(RoutingPolicy):
    """Longest prefix match, unless the load is imbalanced or the match is short
    (:func:`cache_aware_choice`, on a prefix tree per replica that it keeps).

    Defaults: ``balance_abs_threshold=8`` requests, ``balance_rel_threshold=1.5``,
    ``min_match_ratio=0.1`` of the key, ``max_tree_size=65536`` elements per
    replica (about a small replica's KV cache, in tokens). When the least loaded
    replicas tie, it takes them in turn, so an idle fleet still spreads.
    """
    name = "cache_aware"

    def __init__(self, num_replicas: int, balance_abs_threshold: int = 8,
                 balance_rel_threshold: float = 1.5, min_match_ratio: float = 0.1,
                 max_tree_size: int = 1 << 16):
        super().__init__(num_replicas)
        if not isinstance(balance_abs_threshold, int) or balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be an integer >= 0, "
                             f"got {balance_abs_threshold!r}")
        if not isinstance(balance_rel_threshold, (int, float)) or balance_rel_threshold < 1:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold!r}")
        if not isinstance(min_match_ratio, (int, float)) or not 0 <= min_match_ratio <= 1:
            raise ValueError(f"min_match_ratio must be in [0, 1], got {min_match_ratio!r}")
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.min_match_ratio = min_match_ratio
        self.trees = [PrefixTree(max_tree_size) for _ in range(num_replicas)]
        self._tie = 0
        self.num_by_match = 0       # decisions taken by prefix match (for reports)
        self.num_by_load = 0        # decisions taken by the load guard

    def choose(self, key, outstanding):
        self._check(outstanding)
        if len(key) == 0:
            raise ValueError("key must not be empty")
        replica, by_match = cache_aware_choice(key, outstanding, self.trees, self.balance_abs_threshold,
                                               self.balance_rel_threshold, self.min_match_ratio, self._tie)
        if by_match:
            self.num_by_match += 1
        else:
            self._tie = (replica + 1) % self.num_replicas
            self.num_by_load += 1
        self.trees[replica].insert(key)
        return replica


ROUTING_POLICIES: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobin,
    "least_outstanding": LeastOutstanding,
    "cache_aware": CacheAware,
}


def make_routing_policy(name: str, num_replicas: int, **kwargs) -> RoutingPolicy:
    if name not in ROUTING_POLICIES:
        raise ValueError(f"policy: unknown routing policy {name!r}; "
                         f"choose one of {sorted(ROUTING_POLICIES)}")
    return ROUTING_POLICIES[name](num_replicas, **kwargs)
