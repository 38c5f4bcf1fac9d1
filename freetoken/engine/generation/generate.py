"""Generation on a loaded model: the decoder's own sequence, reused from call to call, run as a request of the
model's step loop (:mod:`freetoken.engine.batching.step_loop`); tokens stream out as they come."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from freetoken.engine.batching.step_loop import StepLoop
from freetoken.engine.decoding.sampling import SamplingParams
from freetoken.engine.decoding.stats import Generation, GenerationStats
from freetoken.engine.decoding.text_stream import TextStream
from freetoken.models.kv import OutOfKVBlocks

#: Default of :attr:`Model.restore_residency`: off, as measured (bench/bench_anchor_residency.py, bundled model on
#: emu, 48 of 96 expert records in slots, 24 decode tokens after a side request): re-admitting the anchor's 48
#: resident records copied 25 and saved 6 misses of the resumed decode, 69 records copied in all against 50 without.
#: Decode routes to few enough experts that its own misses fill the slots it needs; a prefill streams whole layers.
RESTORE_RESIDENCY = False


class Model:
    """A loaded model: ``logits(ids)`` and ``generate(prompt, ...)`` (run in :attr:`step_loop`, on the decoder's own
    sequence).

    ``cached_ids`` are the token ids whose K/V rows the decoder holds (rows ``[0, decoder.length)``).
    ``generate(..., reuse_cache=True)`` reuses the longest prefix of the new prompt whose K/V rows are still in the
    pool: the decoder's own sequence, or any earlier one in the radix prefix cache (:attr:`prefix_cache`, made on
    first use; :mod:`freetoken.engine.reuse.prefix_cache`), or a verified anchor (:attr:`anchors`,
    :mod:`freetoken.engine.reuse.anchors`), and prefills only the rest. A model with linear-attention layers resumes
    only where the layers' recurrent states were kept as well: the decoder's own snapshots, the states of earlier
    sequences in :attr:`state_cache` (:mod:`freetoken.engine.reuse.state_cache`), an anchor's states. This bookkeeping
    assumes the decoder is driven through this Model only. ``chat_template`` is the model's
    :class:`freetoken.engine.generation.chat.ChatTemplate` (None when the model has none). ``weight_files``: the files
    the weights came from (part of :attr:`fingerprint`)."""

    def __init__(self, decoder, tokenizer=None, eos_ids: Sequence[int] = (), chat_template=None,
                 weight_files: Sequence[str] = ()):
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.eos_ids = set(int(i) for i in eos_ids)
        self.chat_template = chat_template
        self.weight_files = list(weight_files)
        self.cached_ids: list[int] = []
        #: re-admit the experts an anchor recorded as resident when restoring it (gpu/emu expert cache; see
        #: bench/bench_anchor_residency.py for the measurement behind the default)
        self.restore_residency = RESTORE_RESIDENCY
        self._fingerprint: str | None = None
        self._prefix_cache = None
        self._state_cache = None
        self._anchors = None
        self._step_loop = None
        self._live = None  # the request of the generation running (or left open) in the step loop

    @property
    def step_loop(self) -> StepLoop:
        """The step loop this model's own generations run in, one request at a time on the decoder's sequence
        (made on first use, and anew for a new pool or prefill chunk: a step runs one chunk of the prompt). A server
        that batches requests runs a loop of its own."""
        loop, dec = self._step_loop, self.decoder
        if loop is None or loop.decoder.pool is not dec.pool or loop.scheduler.step_tokens != dec.prefill_chunk:
            self._step_loop = StepLoop(self, max_seqs=1, step_tokens=dec.prefill_chunk)
        return self._step_loop

    # ---- reuse: prefix cache and anchors -------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """What an anchor must match to be used with this model (:mod:`freetoken.engine.reuse.fingerprint`)."""
        if self._fingerprint is None:
            from freetoken.engine.reuse.fingerprint import model_fingerprint

            self._fingerprint = model_fingerprint(self.decoder.cfg, self.decoder.embed,
                                                  self.experts.formats_name(), self.weight_files)
        return self._fingerprint

    @property
    def prefix_cache(self):
        """The radix prefix cache over the decoder's KV pool (made on first use, and anew for a new pool)."""
        if self._prefix_cache is None or self._prefix_cache.pool is not self.decoder.pool:
            from freetoken.engine.reuse.prefix_cache import RadixCache

            self._prefix_cache = RadixCache(self.decoder.pool)
        return self._prefix_cache

    @property
    def state_cache(self):
        """The linear-attention states of earlier sequences by token prefix (made on first use; a model without
        linear-attention layers never fills it)."""
        if self._state_cache is None:
            from freetoken.engine.reuse.state_cache import StateCache

            self._state_cache = StateCache()
        return self._state_cache

    @property
    def anchors(self):
        """The anchor store (made on first use, in memory only: :meth:`use_anchor_dir` adds a directory)."""
        if self._anchors is None:
            self.use_anchor_dir(None)
        return self._anchors

    def use_anchor_dir(self, directory, **store_options):
        """(Re)make the anchor store, its anchors written to and indexed from ``directory`` (None: memory only);
        ``store_options``: :class:`freetoken.engine.reuse.anchors.AnchorStore` keywords. Returns the store."""
        from freetoken.engine.reuse.anchors import AnchorStore

        if self._anchors is not None:  # the old store lets go of the pool; its files stay where they are
            self._anchors.close()
        self.prefix_cache  # noqa: B018 - the prefix cache evicts first when the pool is short, then anchors spill
        self._anchors = AnchorStore(self.decoder.pool, self.fingerprint, directory, states=self._recurrent,
                                    **store_options)
        return self._anchors

    def _residency(self):
        get = getattr(self.experts, "residency", None)
        return get() if get is not None else None

    def anchor(self, length: int | None = None, label: str | None = None):
        """An anchor of the decoder's first ``length`` tokens (default all it holds), for :meth:`rollback` or a
        later prompt's ``anchor=``. With linear-attention layers ``length`` must be one the decoder kept the states
        at (:meth:`freetoken.models.decoder.MoeDecoder.resume_points`)."""
        n = self.decoder.length if length is None else int(length)
        if n < 1 or n > self.decoder.length or len(self.cached_ids) < n:
            raise ValueError(f"an anchor of {n} tokens: the decoder holds {self.decoder.length}")
        states = self.decoder.export_states(n) if self._recurrent else None
        return self.anchors.create(self.decoder.kv, self.cached_ids, n, label=label, residency=self._residency(),
                                   states=states)

    def rollback(self, anchor) -> int:
        """Make the decoder's sequence the anchor's tokens again (verified, see
        :meth:`freetoken.engine.reuse.anchors.AnchorStore.restore`); returns their number. ValueError when the anchor is
        refused."""
        a = self.anchors.get(anchor) if isinstance(anchor, str) else anchor
        if a is None:
            raise ValueError(f"no anchor {anchor!r}")
        self._retire()
        self.decoder.reset()  # in the prefix caches now: room for the anchor's blocks, if it must be read back
        self.cached_ids = []
        states = {}
        n, why = self.anchors.restore(a, a.tokens.tolist(), self.decoder.kv, states_out=states)
        if why is not None:
            raise ValueError(f"anchor {a.id[:16]} refused: {why}")
        if self._recurrent:
            self.decoder.import_states(states)
        self.decoder.kv.own_last()
        self.cached_ids = a.tokens.tolist()
        return n

    @property
    def _recurrent(self) -> bool:
        """Whether the decoder has linear-attention layers: a prefix is then reusable only where their recurrent
        states were kept too."""
        return bool(getattr(self.decoder, "recurrent", False))

    def _own_resume(self, ids: Sequence[int]) -> int:
        """The longest prefix of ``ids`` (its last token excluded) that the decoder's own sequence shares and that
        it can resume at without recomputing (a linear-attention model: its current length or a state snapshot)."""
        limit = min(len(ids) - 1, self.decoder.length, len(self.cached_ids))
        same = 0
        while same < limit and self.cached_ids[same] == ids[same]:
            same += 1
        return max(p for p in self.decoder.resume_points() if p <= same)

    def _retire(self) -> None:
        """Put the decoder's current sequence into the prefix caches (before it is replaced)."""
        if self.decoder.length:
            self.retire_sequence(self.decoder.seq, self.cached_ids)

    def retire_sequence(self, seq, tokens: Sequence[int]) -> None:
        """Put ``seq`` (a :class:`freetoken.models.sequence.DecoderSequence` whose rows are those of ``tokens``'
        first ``seq.length``) into the radix prefix cache, and with linear-attention layers the states it kept (its
        snapshots and its current length) into the state cache, those not there already; the sequence itself is
        left as it is."""
        n = seq.length
        if not n or len(tokens) < n:  # fewer ids: the sequence ran tokens the caller did not see
            return
        self.prefix_cache.insert(tokens, seq.kv.blocks, n)
        if self._recurrent:
            for m in seq.resume_points():
                if m and not self.state_cache.has(tokens[:m]):
                    self.state_cache.put(tokens[:m], seq.export_states(m))

    def _anchor_candidate(self, ids: Sequence[int], anchor, boundaries: Sequence[int], st: GenerationStats):
        """(store, target, cand): the anchor to try, ``anchor`` (an Anchor or an id) or else the longest one at
        ``boundaries``, and the Anchor it names (None: none to try; an unknown id is refused into ``st``)."""
        store = self._anchors if anchor is None else self.anchors
        target = anchor
        if target is None and store is not None and boundaries:
            target = store.best_prefix(ids, boundaries)
        cand = store.get(target) if isinstance(target, str) else target
        if target is not None and cand is None:
            st.anchor_refused = store.refuse(target, "no such anchor")[1]
        return store, target, cand

    def _restore_anchor(self, store, target, cand, ids: Sequence[int], limit: int, blocks, n: int,
                        st: GenerationStats, states_out: dict | None = None, seq=None) -> int:
        """Restore ``cand`` (``target``: how it was named) into ``seq`` (default: the decoder's sequence) after the
        store's checks, over the first ``n`` tokens' prefix-cache ``blocks``; what came of it goes into ``st``, the
        expert residency it recorded is re-admitted when :attr:`restore_residency`. Returns the tokens restored (0:
        refused)."""
        keep, why = store.restore(target, ids, self.decoder.kv if seq is None else seq, limit, have=blocks,
                                  have_tokens=n, states_out=states_out)
        st.anchor, st.anchor_refused = (cand.id, None) if why is None else (None, why)
        if why is None and self.restore_residency and cand.residency and hasattr(self.experts, "residency"):
            self.experts.restore_residency(cand.residency)
        return keep

    def _reuse_recurrent(self, ids: Sequence[int], anchor, boundaries: Sequence[int], st: GenerationStats) -> int:
        """:meth:`_reuse` for a decoder with linear-attention layers: the longest prefix of ``ids`` whose states are
        at hand as well as its KV rows, from the decoder's own sequence (no copy), or else as
        :meth:`adopt_prefix` finds it."""
        limit = len(ids) - 1
        own = self._own_resume(ids)
        # at a boundary: one that ends before the prompt's last token (the states hold the token they end at)
        candidate = self._anchor_candidate(ids, anchor, [b for b in boundaries if b <= limit], st)
        cand = candidate[2]
        cached = self._state_cache.best(ids, limit) if self._state_cache is not None else None
        elsewhere = max(cached.length if cached is not None else 0,
                        cand.length if cand is not None and cand.length <= limit else 0)
        if anchor is None and own and own >= elsewhere:  # the decoder's own sequence serves best
            self.decoder.length = own  # (what is cut off is dropped: keeping it would share the last block)
            return own
        self._retire()
        self.decoder.reset()  # the old sequence is in the prefix caches now
        return self._adopt_recurrent(self.decoder.seq, ids, candidate, st)

    def _reuse(self, ids: Sequence[int], anchor, boundaries: Sequence[int], st: GenerationStats) -> int:
        """Put the longest reusable prefix of ``ids`` into the decoder's sequence; returns its length."""
        if self._recurrent:
            return self._reuse_recurrent(ids, anchor, boundaries, st)
        self._retire()
        self.decoder.kv.reset()  # the old sequence is in the prefix cache: what of it nobody needs can go when needed
        return self.adopt_prefix(self.decoder.seq, ids, anchor, boundaries, st)

    def adopt_prefix(self, seq, ids: Sequence[int], anchor, boundaries: Sequence[int], st: GenerationStats) -> int:
        """Put the longest reusable prefix of ``ids`` into the empty
        :class:`freetoken.models.sequence.DecoderSequence` ``seq``: the radix prefix cache's match, or an anchor
        (``anchor``, an Anchor or an id, or else the longest at one of ``boundaries``; verified, and refused into
        ``st``) when it holds more; with linear-attention layers only a prefix whose states are at hand too (the
        anchor's, or the state cache's over the match). Returns the tokens reused. The last token of ``ids`` is
        never among them (it is fed again, for its logits)."""
        limit = len(ids) - 1
        if self._recurrent:
            candidate = self._anchor_candidate(ids, anchor, [b for b in boundaries if b <= limit], st)
            return self._adopt_recurrent(seq, ids, candidate, st)
        kv = seq.kv
        blocks, n = self.prefix_cache.match(ids, limit)
        pool = self.decoder.pool
        pool.retain(blocks)  # the match is held while room is made below (what else the tree holds may go)
        try:
            store, target, cand = self._anchor_candidate(ids, anchor, boundaries, st)
            keep = 0
            if cand is not None and (anchor is not None or min(cand.length, limit) > n):
                keep = self._restore_anchor(store, target, cand, ids, limit, blocks, n, st, seq=kv)
            if n > keep:
                kv.adopt(blocks, n)
                keep = n
            kv.own_last()  # a shared partial last block copied now, while the pool can still make room for it
        finally:
            pool.release(blocks)
        return keep

    def _adopt_recurrent(self, seq, ids: Sequence[int], candidate, st: GenerationStats) -> int:
        """:meth:`adopt_prefix` with linear-attention layers, ``candidate`` the anchor to try
        (:meth:`_anchor_candidate`): the anchor (verified, states included), or the state cache's longest entry
        whose KV rows the radix prefix cache's match covers, whichever holds more."""
        limit = len(ids) - 1
        store, target, cand = candidate
        blocks, n = self.prefix_cache.match(ids, limit)
        pool, kv = self.decoder.pool, seq.kv
        pool.retain(blocks)  # the match is held while room is made below
        try:
            keep = 0
            if cand is not None:
                states = {}
                keep = self._restore_anchor(store, target, cand, ids, limit, blocks, n, st, states, seq=kv)
                if keep:
                    seq.import_states(states)
            entry = self.state_cache.best(ids, min(n, limit))  # states whose KV rows the match covers
            if entry is not None and entry.length > keep:
                keep = entry.length
                kv.adopt(blocks[:-(-keep // pool.block_size)], keep)
                seq.import_states(entry.arrays)
            kv.own_last()
        finally:
            pool.release(blocks)
        return keep

    @property
    def config(self):
        return self.decoder.cfg

    @property
    def experts(self):
        """The runner of the routed experts (:mod:`freetoken.engine.experts`): residency, counters, report."""
        return self.decoder.experts

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens=False`` skips the tokenizer's BOS/EOS post-processing (for
        text rendered by a chat template, which writes its own special tokens)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        if add_special_tokens:
            return list(self.tokenizer.encode(text).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def token_offsets(self, text: str, ids: Sequence[int]) -> list[tuple[int, int]] | None:
        """Each token's ``(start, end)`` characters in ``text``, when the tokenizer gives offsets and ``ids`` are
        ``text``'s tokens (no special-token post-processing); else None."""
        try:
            enc = self.tokenizer.encode(text, add_special_tokens=False)
            offsets = enc.offsets
        except (AttributeError, TypeError):
            return None
        return [tuple(o) for o in offsets] if list(enc.ids) == list(ids) else None

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        return self.tokenizer.decode(list(ids))

    def logits(self, token_ids: Sequence[int], last_only: bool = False) -> np.ndarray:
        """float32 [T, vocab] logits of a fresh sequence (``last_only``: [1, vocab], the last token's)."""
        self.decoder.reset()
        self.cached_ids = []
        ids = [int(i) for i in np.asarray(token_ids, np.int64).reshape(-1)]
        out = self.decoder.forward(np.asarray(ids, np.int64), last_only=last_only)
        self.cached_ids = ids
        return out

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 64, sampling: SamplingParams | None = None,
                 record_routing: bool = False, reuse_cache: bool = False, constraint=None, anchor=None,
                 boundaries: Sequence[int] = (), stats: GenerationStats | None = None) -> Generation:
        """Up to ``max_tokens`` new token ids (stops early at an end-of-sequence token), as a :class:`Generation`:
        iterate it for the ids as they come; its ``stats`` say what the call did. The prompt is checked here; the
        work runs as it is iterated.

        ``reuse_cache``: keep the K/V rows of the longest prefix of the prompt still in the pool (the previous
        prompt and the tokens generated after it, an earlier sequence in the prefix cache, an anchor at one of
        ``boundaries``) and prefill only the rest. ``stats.cached_tokens`` counts the reused tokens and
        ``stats.prompt_tokens`` the prefilled ones. Default: a fresh sequence, the whole prompt prefilled.
        ``anchor``: an :class:`freetoken.engine.reuse.anchors.Anchor` (or its id) to resume from; it is verified first
        and, refused, recomputed (``stats.anchor_refused`` says why). ``boundaries``: positions in the prompt
        (message boundaries) at which anchors are made once the prompt has run (``stats.anchors_made``).
        ``constraint``: a :class:`freetoken.engine.decoding.grammar.TokenConstraint` the tokens must follow;
        generation ends when its grammar is complete. ``stats``: the object to fill in (default a new one)."""
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        st = GenerationStats() if stats is None else stats
        return Generation(self._tokens(ids, max_tokens, sampling, record_routing, reuse_cache, constraint, anchor,
                                       boundaries, st), st)

    def _tokens(self, ids: list[int], max_tokens: int, sampling: SamplingParams | None, record_routing: bool,
                reuse_cache: bool, constraint, anchor, boundaries: Sequence[int], st: GenerationStats) -> Iterator[int]:
        """:meth:`generate`'s work, its stats kept in ``st``: the prompt's reusable prefix put into the decoder's own
        sequence, then that sequence run as a request of :attr:`step_loop` (its prompt in chunks, a token a step),
        which leaves its rows in it."""
        if self._live is not None and not self._live.finished:  # a generation left open: it ends here, in its loop
            self._step_loop.abort(self._live)  # (before step_loop may make a new loop for a new pool)
        loop = self.step_loop
        keep = self._reuse(ids, anchor, boundaries, st) if reuse_cache or anchor is not None else 0
        if not keep:
            self.decoder.reset()
        self.cached_ids = ids[:keep]
        req = self._live = loop.submit(ids, max_tokens, sampling, constraint, anchor=None, boundaries=boundaries,
                                       sequence=self.decoder.seq, share=reuse_cache, stats=st)
        prompt_routing = []
        try:
            while not req.finished:
                t0 = time.perf_counter()
                events = loop.step()
                spent = time.perf_counter() - t0
                event = next((e for e in events if e.request is req), None)
                routing = self._routing() if record_routing else None
                sampled = event is not None and event.token is not None
                if st.generated_tokens - sampled > 0:  # the step fed a token of this generation: a decode step
                    st.decode_seconds += spent
                    if routing is not None:
                        st.routing.append(routing)
                else:
                    st.prefill_seconds += spent
                    if routing is not None:
                        prompt_routing.append(routing)
                if event is None:
                    continue
                if record_routing and prompt_routing:
                    st.prefill_routing = [np.concatenate(layer) for layer in zip(*prompt_routing, strict=True)]
                    prompt_routing = []
                if event.finish_reason == "kv":
                    raise OutOfKVBlocks(f"a sequence of {len(ids)} prompt tokens does not fit the KV pool "
                                        f"({self.decoder.pool.num_blocks} blocks of {self.decoder.pool.block_size})")
                if sampled:
                    yield event.token
        finally:
            if not req.finished:  # closed early: the sequence keeps exactly the tokens it ran
                loop.abort(req)
            if self._live is req:  # (a generation left open and ended by a later one has no say)
                self.cached_ids = req.seq.tokens[:self.decoder.length]

    def _routing(self) -> list[np.ndarray]:
        """The expert ids per MoE layer of the last forward pass, on the host."""
        return [np.asarray(self.decoder.dev.to_host(r)) for r in self.experts.last_routing]

    def generate_text(self, prompt: str | Sequence[int], max_tokens: int = 64, sampling: SamplingParams | None = None,
                      record_routing: bool = False, reuse_cache: bool = False,
                      stop: Sequence[str] = (), should_stop: Callable[[], bool] | None = None,
                      constraint=None, anchor=None, boundaries: Sequence[int] = (),
                      stats: GenerationStats | None = None) -> Generation:
        """Text pieces as tokens come (a piece is held back while it ends in an incomplete character), as a
        :class:`Generation` whose ``stats`` are those of the tokens' :meth:`generate`.

        ``stop``: strings that end the text (not included). One that is a single token of the vocabulary stops at
        that token; any of them stops when it shows up in the decoded text, so text that could be the start of a
        stop string is held back until it is clear that it is not; ``stats.stop_sequence`` says which one ended the
        text. ``reuse_cache``: as in :meth:`generate`.
        ``should_stop``: asked after every token (held-back ones too); True ends generation there (a cancelled
        request: ``stats.finish_reason`` stays None). ``constraint``, ``anchor``, ``boundaries``, ``stats``: as in
        :meth:`generate`."""
        tokens = self.generate(prompt, max_tokens, sampling, record_routing, reuse_cache=reuse_cache,
                               constraint=constraint, anchor=anchor, boundaries=boundaries, stats=stats)
        return Generation(self._pieces(tokens, TextStream(self, stop), should_stop), tokens.stats)

    @staticmethod
    def _pieces(tokens: Generation, text: TextStream, should_stop) -> Iterator[str]:
        """:meth:`generate_text`'s work: ``tokens`` through ``text``."""
        st = tokens.stats
        try:
            for tok in tokens:
                if should_stop is not None and should_stop():
                    st.finish_reason = None
                    return
                piece = text.push(tok)
                if piece:
                    yield piece
                if text.done:
                    break
        finally:
            tokens.close()  # stopping early: the decoder holds exactly the tokens it ran (``cached_ids``)
        piece = text.flush()
        if text.finish_reason is not None:
            st.finish_reason, st.stop_sequence = text.finish_reason, text.stop_sequence
        if piece:
            yield piece
