"""lfu_decay: the expert cache with LFU under exponential decay (LRFU), in Numba, on the scored slot table of
:mod:`freetoken.policy.scored`.

The rules (for the device port, with the call order of :mod:`~freetoken.policy.scored`):

* per flat id: ``last`` (the layer clock of its last access, 0: never) and ``c1`` (its decayed access count at
  that access); per layer: ``lclock`` (the layer's call count; one call per decode step, so ages are in steps of the
  id's own layer); per slot: ``owner``, ``stamp``, ``pinned``; ``dp``: the decay table of half-life ``H`` steps
  (:func:`~freetoken.policy.scored.decay_table`, uploaded as data).
* a call of layer ``c`` advances ``lclock[c]`` to ``now``; each active id ``f``: ``c1[f] = 1.0 + c1[f] *
  dp[min(now - last[f], len(dp) - 1)]``, ``last[f] = now``; hits are stamped (not victims in this call).
* the keep key of a resident ``o`` of layer ``lo``: its decayed count now, ``c1[o] * dp[min(lclock[lo] -
  last[o], len(dp) - 1)]`` (one double multiply). Each miss, in increasing id order, takes the eligible slot (not
  stamped in this call, not pinned) with the smallest (key, slot); empty slots have key -inf.
* with ``bypass``: the miss's own key is ``c1[f]`` (just updated, age 0); it is admitted only when that is strictly
  greater than the victim's key (it is the more frequent, so it is expected back sooner), else it is a miss that
  loads nothing and evicts nothing. An empty victim always admits.
* prefill borrows empty slots [first, first + n) (statistics stay), pins take slots from the end, as LRU's.

``H`` -> 0 approaches LRU in layer steps (ties inside a step: the lowest slot); ``H`` -> inf is LFU. Among the ids
of one layer the order does not change between their accesses (it is the order of ``log2(c1) + last / H``), but
the rule is the product above, evaluated at the call's clocks: that is what the simulator and the tests check.

The functions are those of :mod:`~freetoken.policy.scored` under this policy's names: :func:`lfu_decay_new`
makes the state; :func:`lfu_decay_admit` (one whole call), :func:`lfu_decay_borrow`, :func:`lfu_decay_pin`,
:func:`lfu_decay_replay_calls` (a trace's calls, for the simulator).
"""

from __future__ import annotations

from freetoken.policy.scored import (
    KIND_LFU_DECAY,
    scored_admit,
    scored_borrow,
    scored_new,
    scored_pin,
    scored_replay_calls,
)

#: half-life of the decayed count, in steps of the id's layer (tuned by bench/policy_eval.py on its tuning traces:
#: longer half-lives lose more to LRU where a cache holds about one step's accesses)
DEFAULT_HALF_LIFE = 2.0

lfu_decay_admit = scored_admit
lfu_decay_borrow = scored_borrow
lfu_decay_pin = scored_pin
lfu_decay_replay_calls = scored_replay_calls


def lfu_decay_new(num_layers: int, num_experts: int, slots: int, half_life: float = DEFAULT_HALF_LIFE,
                  bypass: bool = False) -> tuple:
    """A fresh lfu_decay state: ``slots`` empty slots for ``num_layers x num_experts`` flat ids; ``half_life`` in
    steps of an id's layer; ``bypass``: admit a miss only when it is more frequent than its victim."""
    return scored_new(KIND_LFU_DECAY, num_layers, num_experts, slots, half_life, bypass=bypass)
