"""Routed experts through the GPU's expert cache (gpu/emu devices).

Every expert record lives in the host pool (the authoritative copy, :class:`freetoken.cache.HostPool`); the device
keeps :class:`freetoken.cache.ExpertCache` slots shared by all MoE layers. Per forward pass:

* a prompt whose routed pairs exceed one admission **streams**: whole layers go through the cache's two prefill
  buffers, layer m+1 copied while layer m computes;
* a decode step **admits** each layer's routed experts (hits refresh the policy's statistics, misses take the
  victims it picks, the ids are rewritten to slots, the missed records are copied in), then runs the expert kernels
  over the slots. The cache policy (``--cache-policy``, :func:`freetoken.policy.runtime.resolve_cache_policy`) is
  ``next_use`` by default with ``--moe-mode gpu`` when the slots cannot hold every expert (in hybrid mode on
  request): the simulator's ``default`` row admitted on the device (``cache_admit_scored``), a miss it bypasses
  streamed through one of ``top_k`` scratch slots (copied in, computed, not kept, nothing evicted) or, in hybrid
  mode, computed on the CPU where q* says so, and each streamed prompt's routing counts seeding its statistics (the
  prefill prior); otherwise LRU. With
  ``--moe-mode cpu|hybrid`` the misses are first split (:class:`freetoken.policy.hybrid.MissSplitter`): the CPU
  share runs on a worker from the host pool (:class:`CpuShare`) while the GPU share is admitted and computed, and
  the partial outputs are merged in a fixed order. The gpu mode is the empty split: it never reads the routing back
  to the host, so its steps need no synchronisation;
* with ``--prefetch`` each admission is followed by the next layer's predicted admission on the transfer stream
  (:class:`NextLayerPrefetch`).

With ``--host-memory`` below the routed experts the host pool is a :class:`freetoken.cache.HostTier` over the FTW
file: each admission's missed records are read into host rows before they are copied (the cache reads its worklist
back: one synchronisation per MoE layer), the CPU share ensures and pins its records, and a streamed prompt reads
layer m+1 into host memory after layer m's kernels are issued, so the disk read overlaps them.
"""

from __future__ import annotations

import numpy as np

from freetoken import ops
from freetoken.cache import ExpertCache, HostPool, HostTier
from freetoken.device.constants import NO_ROUTE
from freetoken.engine.experts.base import RunnerBase
from freetoken.engine.experts.cpu_share import CpuShare, substitute
from freetoken.engine.experts.prefetch import NextLayerPrefetch
from freetoken.engine.options import ExpertOptions
from freetoken.policy.hybrid import MissSplitter
from freetoken.policy.runtime import make_oracle, resolve_cache_policy, resolve_mode


class CachedExperts(RunnerBase):
    """The expert cache of ``num_layers`` MoE layers x ``num_experts`` experts run as ``opts`` says."""

    def __init__(self, device, layouts, num_layers: int, num_experts: int, top_k: int, opts: ExpertOptions,
                 reader=None):
        super().__init__(device, layouts, num_layers, num_experts)
        self.top_k, self.opts = top_k, opts
        if reader is None:
            pool = HostPool(device, self.parts, num_layers, num_experts)  # filled layer by layer by load_layer
        else:  # host memory holds opts.host_memory bytes of records, read from the file as steps need them
            pool = self.tier = HostTier(device, self.parts, num_layers, num_experts, reader, opts.host_memory)
            self.reads_own_experts = True
        slots = opts.cache_slots or max(num_layers * num_experts, 2 * num_experts)
        mode = resolve_mode(opts.mode, device, self.layout.fmt.name, make_oracle(opts.pcie_gbps, opts.cpu_gbps))[0]
        self.cache_policy, self.cache_policy_note = resolve_cache_policy(opts.cache_policy, mode, opts.prefetch,
                                                                         slots, num_layers * num_experts, self.mixed)
        max_active = min(1024, opts.max_decode_tokens * top_k)
        policy = {}
        if self.cache_policy == "next_use":
            from freetoken.policy.next_use import next_use_device

            # top_k scratch slots: every miss of a one-token step that the policy bypasses can be streamed; a call
            # of several tokens admits the bypassed misses past top_k
            policy = dict(policy="default", policy_state=next_use_device(num_layers, num_experts, slots),
                          scratch=min(top_k, max_active, num_experts))
        self.cache = ExpertCache(pool, slots, max_active=max_active, **policy)
        # decode's plan and expert buffers, allocated once over the slot banks (see ops.moe_experts), per layout
        self.workspaces = [ops.MoeWorkspace(device, lay, banks, self.cache.max_active)
                           for lay, banks in zip(pool.groups, self.cache.group_slot_banks, strict=True)]
        self.prefetch: NextLayerPrefetch | None = None
        self._prefetch_event = None
        self._pinned = 0
        self.streaming = False
        self.split = self.cpu_share = None
        self._setup_policy()

    def _setup_policy(self) -> None:
        """The mode (``auto`` resolved), the oracle (fresh: no samples yet) and, for a split mode, the splitter and
        the CPU share."""
        opts = self.opts
        self.mode, oracle, self.policy_note = resolve_mode(opts.mode, self.dev, self.layout.fmt.name,
                                                           make_oracle(opts.pcie_gbps, opts.cpu_gbps))
        if self.cpu_share is not None:
            self.cpu_share.close()
        self.split = self.cpu_share = None
        if self.mode != "gpu":
            self.split = MissSplitter(self.cache, self.layouts, self.mode, oracle, opts.future_value,
                                      scored=self.cache_policy == "next_use")
            self.cpu_share = CpuShare(self.dev, self.cache.pool, self.cache.max_active, oracle,
                                      opts.cpu_activations)

    def set_predictor(self, predict) -> None:
        """``predict(layer, h) -> (ids, weights)``: MoE layer ``layer``'s router; enables ``--prefetch``."""
        if self.opts.prefetch:
            self.prefetch = NextLayerPrefetch(self.dev, self.num_layers, predict)

    def load_layer(self, layer: int, banks: dict, part: int = 0) -> None:
        self.cache.pool.write_layer(layer, banks, part)  # the host pool: the authoritative copy

    def load_target(self, layer: int, part: int = 0) -> dict | None:
        return None if self.tier is not None else self.cache.pool.layer_banks(layer, part)

    # ---- a forward pass --------------------------------------------------------------------------------------
    def begin(self, tokens: int, first: bool = True) -> None:
        super().begin(tokens, first)
        if self.prefetch is not None:
            self.prefetch.forget()
        self.streaming = tokens * self.top_k > self.cache.max_active
        if self.streaming:
            self.cache.begin_prefill()
            self._prefill_layer(0)

    def end(self) -> None:
        if self.split is not None and not self.streaming:
            self.split.end_step()

    def _prefill_layer(self, layer: int) -> None:
        """Copy ``layer``'s records into its prefill buffer (on the transfer stream); the shadow mirrors the borrow."""
        self.cache.prefetch_layer(layer)
        if self.split is not None:
            self.split.prefill_layer(layer)

    def run(self, layer: int, h, ids, weights):
        self.record(ids)
        if self.streaming:
            return self._run_streaming(layer, h, ids, weights)
        if self.prefetch is not None:
            self.prefetch.score(layer, ids)
        if self.split is not None:
            return self._run_split(layer, h, ids, weights)
        if self.parts[layer].mixed:
            return self._run_parts(layer, h, ids, weights)
        slots = ids.copy()  # admission rewrites in place; ``ids`` stays the routing record
        self._admit_and_copy(layer, slots, h)
        return self._experts(layer, h, slots, weights)

    def _run_parts(self, layer: int, h, ids, weights):
        """A decode step of a layer whose experts are in several formats: each part admits its own pairs (the others
        are NO_ROUTE), copies its misses with its layout's table and runs its layout's kernels; the outputs add."""
        last = len(self.parts[layer].layouts) - 1

        def run(g, slots):  # ``slots`` is a new array: ``ids`` stays the routing record
            self._admit_and_copy(layer, slots, h, part=g, prefetch=g == last)
            return self._experts(layer, h, slots, weights, g)

        return self.run_parts(layer, ids, run)

    def _experts(self, layer: int, h, slots, weights, part: int = 0):
        return ops.moe_experts(h, slots, weights, self.cache.layer_slot_banks(layer, part),
                               self.parts[layer].layouts[part], device=self.dev, validate=False,
                               workspace=self.workspaces[self.cache.pool.group_of(layer, part)])

    def _run_streaming(self, layer: int, h, ids, weights):
        cache = self.cache
        ahead = layer + 1 < cache.num_layers
        if ahead and self.tier is None:
            self._prefill_layer(layer + 1)  # overlaps this layer's compute
            ahead = False
        first = cache.wait_layer(layer)
        parts = self.parts[layer]
        self._prefill_prior(layer, ids)
        if not parts.mixed:
            y = ops.moe_experts(h, ids + np.int32(first), weights, cache.layer_slot_banks(layer), self.layouts[layer],
                                device=self.dev, validate=False)
        else:  # the buffer holds the layer's records by local id: each part reads its own through its layout
            y = self.run_parts(layer, ids, lambda g, part_ids: ops.moe_experts(
                h, part_ids, weights, cache.layer_slot_banks(layer, g), parts.layouts[g], device=self.dev,
                validate=False), offset=first)
        cache.release_layer(layer)
        if ahead:  # a host tier: the next layer is read from disk (on the host) while this layer's kernels run
            self._prefill_layer(layer + 1)
        return y

    def _prefill_prior(self, layer: int, ids) -> None:
        """Under ``next_use``: the streamed prompt's routing counts of ``layer`` (tokens per expert, by the cache's
        local ids) seed the policy's statistics (``ExpertCache.prefill_prior``; a prompt in several streamed chunks
        seeds once per chunk, the later chunk weighing more). One decode step routes ``top_k`` pairs."""
        if self.cache_policy != "next_use":
            return
        local = ids if self._local[layer] is None else self.dev.xp.take(self._local[layer], ids)
        counts = ops.histogram(self.dev.xp.ascontiguousarray(local, np.int32), self.cache.num_experts, device=self.dev)
        self.cache.prefill_prior(layer, counts.astype(np.float64), float(self.top_k))

    def _admit_and_copy(self, layer: int, slots, h, timed_bytes: int = 0, experts=None, part: int = 0,
                        prefetch: bool = True, end_call: bool = True):
        """The one decode admission: the pending prefetch lands first, ``slots`` (expert ids, device int32 ``[T,
        k]``; of a mixed layer: its part ``part``'s local ids, others NO_ROUTE) are admitted and rewritten to slots
        (``experts``: their unique ids on the host, for the split's shadow), the misses are copied in, and (with
        ``prefetch``) the next layer's prefetch is issued. Returns the copy's (start event, end event, bytes) when
        ``timed_bytes`` (an oracle sample); ``end_call`` False: more parts of this layer's call follow (the split's
        shadow)."""
        self._wait_prefetch()
        self.cache.admit(layer, slots, part=part)
        if self.split is not None:
            self.split.admitted(layer, experts, end_call=end_call)
        start = self.dev.event().record() if timed_bytes else None
        self.cache.copy_missing()
        timing = (start, self.dev.event().record(), timed_bytes) if timed_bytes else None
        if prefetch:
            self._prefetch_next(layer, h)
        return timing

    def _prefetch_next(self, layer: int, h) -> None:
        if self.prefetch is None:
            return
        # The prefetch's victims are the least recent slots not predicted; this layer's slots (just admitted, the
        # most recent) are taken only when fewer older slots exist, and its expert kernel would then read records
        # being overwritten. Prefetch only when the older slots certainly suffice (a, b <= min(T k, E) slots for
        # this layer and the prediction; b victims needed among the others).
        tk = min(h.shape[0] * self.top_k, self.cache.num_experts)
        if self.cache.slots - self._pinned < 3 * tk:
            return
        predicted = self.prefetch.predict(layer, h)
        if predicted is None:
            return
        pred, pred_host = predicted
        target, parts = layer + 1, self.parts[layer + 1]
        if not parts.mixed:
            batches = [(0, pred.astype(np.int32, copy=True), pred_host)]
        else:  # one admission per part, as a decode step of that layer does
            local = parts.local_of[pred_host]
            batches = [(g, self.dev.asarray(np.where((local >= lo) & (local < hi), local, NO_ROUTE).astype(np.int32)),
                        local[(local >= lo) & (local < hi)]) for g, (lo, hi) in enumerate(parts.bounds)
                       if ((local >= lo) & (local < hi)).any()]
        for g, slots, experts in batches:
            self.cache.admit(target, slots, count=False, part=g)  # a prefetch: not a hit or a miss of the statistics
            if self.split is not None:
                self.split.admitted(target, experts, count=False)
            self.cache.copy_missing(stream=self.cache.transfer)
        self._prefetch_event = self.dev.event().record(self.cache.transfer)

    def _wait_prefetch(self) -> None:
        if self._prefetch_event is not None:
            self.dev.wait_event(self._prefetch_event, None)  # the prefetched slots are complete before use
            self._prefetch_event = None

    def _run_split(self, layer: int, h, ids, weights):
        if self.cache_policy == "next_use":
            return self._run_split_scored(layer, h, ids, weights)
        dev = self.dev
        self.cpu_share.harvest()
        parts = self.parts[layer]
        ids_host = np.asarray(dev.to_host(ids), np.int32)
        if parts.mixed:  # the cache, its shadow and the CPU share number a mixed layer's experts by local id
            ids_host = parts.local_of[ids_host].astype(np.int32)
        w_host = np.asarray(dev.to_host(weights), np.float32)
        uniq, resident, on_cpu = self.split.plan(layer, ids_host)
        cpu_pair = np.isin(ids_host, uniq[on_cpu]) if on_cpu.any() else np.zeros(ids_host.shape, bool)
        job = self.cpu_share.submit(layer, h, ids_host, w_host, cpu_pair) if cpu_pair.any() else None  # starts first
        y, timings = None, []
        gpu_pair = ~cpu_pair
        fetch = ~resident & ~on_cpu
        if not gpu_pair.any():
            self.split.admitted(layer, uniq[:0])  # every expert on the CPU: the call still ends for the estimator
        elif not parts.mixed:
            slots, wg = substitute(ids_host, w_host, gpu_pair)
            slots_dev = dev.asarray(slots)
            nbytes = int(fetch.sum()) * self.layouts[layer].record_bytes
            timings.append(self._admit_and_copy(layer, slots_dev, h, nbytes, uniq[~on_cpu]))
            y = self._experts(layer, h, slots_dev, dev.asarray(wg))
        else:  # each part with GPU pairs admitted, copied and computed in its layout; the shadow follows part by part
            todo = [(g, lo, hi) for g, (lo, hi) in enumerate(parts.bounds)
                    if (gpu_pair & (ids_host >= lo) & (ids_host < hi)).any()]
            for i, (g, lo, hi) in enumerate(todo):
                mine = gpu_pair & (ids_host >= lo) & (ids_host < hi)
                slots_dev = dev.asarray(np.where(mine, ids_host, NO_ROUTE).astype(np.int32))
                in_part = (uniq >= lo) & (uniq < hi)
                nbytes = int((fetch & in_part).sum()) * parts.layouts[g].record_bytes
                last = i == len(todo) - 1
                timings.append(self._admit_and_copy(layer, slots_dev, h, nbytes, uniq[~on_cpu & in_part], part=g,
                                                    prefetch=last, end_call=last))
                yg = self._experts(layer, h, slots_dev, weights, g)
                y = yg if y is None else y + yg
        for timing in timings:  # each copy's event-timed duration is an oracle PCIe sample
            if timing is None:
                continue
            start, stop, nbytes = timing
            stop.synchronize()
            self.split.oracle.add_copy(nbytes, start.elapsed_ms(stop) / 1e3)
        if job is not None:
            y = self.cpu_share.merge(job, y, h)
        if y is None:
            y = dev.xp.zeros(h.shape, np.float32)
        return y

    def _run_split_scored(self, layer: int, h, ids, weights):
        """Hybrid under ``next_use`` (layers of one format): the device admits every routed id (its statistics see
        them all), the bypassed misses are read back and q* (:meth:`MissSplitter.place`) streams some through the
        scratch slots and leaves the others to the CPU share; the admitted misses and the streamed ones are copied,
        the GPU computes every pair but the CPU's, and the CPU's partial output is merged after it."""
        dev, cache = self.dev, self.cache
        self.cpu_share.harvest()
        ids_host = np.asarray(dev.to_host(ids), np.int32)
        w_host = np.asarray(dev.to_host(weights), np.float32)
        slots = ids.copy()  # admission rewrites in place; ``ids`` stays the routing record
        self._wait_prefetch()
        cache.admit(layer, slots, stream_bypassed=False)
        bypassed = cache.bypassed_ids()  # synchronises: the admission's decisions
        admitted = int(dev.to_host(cache.n_work)[0])
        routed = np.unique(ids_host[ids_host != NO_ROUTE])
        local = bypassed - np.int32(layer * cache.num_experts)
        tokens = [int((ids_host == e).any(axis=1).sum()) for e in local]
        streamed = self.split.place(layer, len(routed) - admitted - len(bypassed), admitted, tokens)
        cache.place_bypassed(bypassed[streamed], bypassed[~streamed])
        cpu_pair = np.isin(ids_host, local[~streamed])
        job = self.cpu_share.submit(layer, h, ids_host, w_host, cpu_pair) if cpu_pair.any() else None
        nbytes = (admitted + int(streamed.sum())) * self.layouts[layer].record_bytes
        start = dev.event().record() if nbytes else None
        cache.copy_missing()
        if nbytes:
            stop = dev.event().record()
            stop.synchronize()
            self.split.oracle.add_copy(nbytes, start.elapsed_ms(stop) / 1e3)
        y = self._experts(layer, h, slots, weights) if not cpu_pair.all() else dev.xp.zeros(h.shape, np.float32)
        return self.cpu_share.merge(job, y, h) if job is not None else y

    # ---- state, counters, report -----------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        host = "expert rows (host tier)" if self.tier is not None else "expert banks (host pool)"
        return {host: int(self.cache.pool.nbytes), "expert slots": int(self.cache.slot_nbytes)}

    def reset(self) -> None:
        self.dev.synchronize()
        self.cache.reset()
        if self.tier is not None:  # its rows stay valid: only the counters start again
            self.tier.reset_stats()
        self._prefetch_event = None
        self._pinned = 0
        if self.prefetch is not None:
            self.prefetch.reset_stats()
        self._setup_policy()

    def close(self) -> None:
        if self.cpu_share is not None:
            self.cpu_share.close()

    def pin_hot(self, counts, n: int):
        from freetoken.policy.pinning import pin_hot, pin_order

        if self.mixed:  # the cache numbers a mixed layer's experts by local id
            counts = np.array(counts, copy=True)
            for layer, parts in enumerate(self.parts):
                if parts.mixed:
                    counts[layer, parts.local_of] = np.asarray(counts[layer]).copy()
        pinned = pin_hot(self.cache, counts, n)
        if self.split is not None:  # the split's shadow takes the same pins in the same slots
            for layer, experts in pin_order(pinned):
                self.split.pin(layer, experts)
        self._pinned += len(pinned)
        return pinned

    def residency(self) -> list[int]:
        """The expert records (``layer * num_experts + expert``) in the cache's slots now, sorted."""
        ids = self.dev.to_host(self.cache.id_of_slot)
        return sorted(int(i) for i in ids if i >= 0)

    def restore_residency(self, records) -> int:
        """Admit ``records`` (as :meth:`residency` gave them) into the slots again, copying in those that are not
        there (not counted as hits or misses); returns the number of records copied. The split modes' shadow does
        not follow such admissions, so there it does nothing; nor under ``next_use``, whose admissions are its calls
        (it would count them and might bypass them)."""
        if self.split is not None or self.cache_policy == "next_use":
            return 0
        cache, copied = self.cache, 0
        recs = np.asarray(sorted(int(r) for r in records), np.int64)
        for layer in np.unique(recs // cache.num_experts):
            experts = (recs[recs // cache.num_experts == layer] % cache.num_experts).astype(np.int32)
            for i in range(0, experts.size, cache.max_distinct):
                ids = self.dev.asarray(np.ascontiguousarray(experts[i:i + cache.max_distinct]).reshape(1, -1))
                cache.admit(int(layer), ids, count=False)
                copied += int(self.dev.to_host(cache.n_work)[0])
                cache.copy_missing()
        cache.check_errors()
        return copied

    def hit_stats(self) -> tuple[float, int, int]:
        """(hit rate, hits, misses) of decode steps' routed experts: with a split a miss is fetched or computed on
        the CPU (the cache's own counters see only the fetched ones)."""
        if self.split is not None:
            st = self.split.stats
            misses = st["fetched"] + st["cpu"]
            total = st["hits"] + misses
            return (st["hits"] / total if total else 0.0), st["hits"], misses
        cs = self.cache.stats()
        return cs["hit_rate"], cs["hits"], cs["misses"]

    def counters(self) -> dict[str, int]:
        cs = self.cache.stats()
        out = {"cache_hits": cs["hits"], "cache_misses": cs["misses"]}
        if self.split is not None:
            st = self.split.stats
            out.update(split_hits=st["hits"], split_fetched=st["fetched"], split_cpu=st["cpu"])
        if "bypassed" in cs:
            out["cache_bypassed"] = cs["bypassed"]
        if self.prefetch is not None:
            out.update({f"prefetch_{k}": v for k, v in self.prefetch.stats.items()})
        out.update(self.tier_counters())
        return out

    def summary(self) -> str:
        rate, hits, misses = self.hit_stats()
        bypassed = self.cache.stats().get("bypassed", 0)
        on_cpu = int(self.cache.served_elsewhere.sum())  # hybrid: the bypassed misses q* left to the CPU
        streamed = f", {bypassed - on_cpu} streamed past the cache" if bypassed > on_cpu else ""
        return (f"expert cache: {self.cache.slots} slots ({self.cache_policy}), hit rate {rate:.1%} ({hits} hits, "
                f"{misses} misses{streamed}, {self.formats_name()})")

    def report(self) -> str:
        parts = [f"moe mode {self.mode}, cache policy {self.cache_policy}"]
        if self.cache_policy_note:
            parts.append(self.cache_policy_note)
        if self.split is not None:
            st, o = self.split.stats, self.split.oracle
            parts.append(f"{st['hits']} hits, {st['fetched']} fetched, {st['cpu']} on the CPU; PCIe "
                         f"{o.pcie_gbps():.1f} GB/s, CPU {o.cpu_gbps(self.layout.fmt.name):.1f} GB/s")
        if self.prefetch is not None and self.prefetch.report():
            parts.append(self.prefetch.report())
        if self.policy_note:
            parts.append(self.policy_note)
        return "; ".join(parts)
