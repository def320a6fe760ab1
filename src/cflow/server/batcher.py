"""Continuous batching: N sequence slots, one thread that owns the engine, one forward per step.

Each step advances every decoding sequence by one token and prefills the next piece of the
prompts of joining requests (pieces of generate.PREFILL_CHUNK tokens, at most `prefill_budget`
prompt tokens a step, and always at least one piece), all in ONE `engine.forward(states, ids)`:
the rows share every weight read, attention runs per sequence over its own KV cache. The
logits of each row go to that request's Decoder (its own sampler, seed, stop strings,
penalties); the resulting Chunk is handed to the request's asyncio queue on the event loop
(`loop.call_soon_threadsafe`). The event loop never runs model code.

Requests wait in a queue (at most max_queue beyond the free slots, then QueueFull) and the
batcher thread gives them slots between steps, when no forward runs, so that any sequence's KV
cache can be read then. Which request goes next: among the first REORDER_WINDOW waiting, the one
with the longest prompt prefix already in some slot's cache (running or free: a system prompt, a
question another user asked a moment ago, the earlier turns of a chat), the earliest of equals;
the one at the head of the queue goes next once it has been passed over REORDER_WINDOW times, so
no request waits more than that many admissions longer than first come, first served would make
it. This is the longest-prefix-match order of SGLang's scheduler, bounded.
Which slot it takes, keeping the other slots' histories for later requests where it can: a free
slot that loses nothing (empty, or all of its history a prefix of the prompt); else the free slot
sharing the longest prefix with the prompt (the earlier turns of a chat) when that prefix is at
least half of what it holds; else the least recently used free slot. When the prompt cuts into
the prompt of the history it takes, that history, another conversation's, moves to the prompt
cache (below) instead of being lost. The longest prefix any slot or cached history
shares with the prompt is then copied into the taken slot (State.copy_prefix) when it holds less
of it, and only the rest of the prompt is computed. A finished or cancelled sequence leaves at
the next step; its state keeps its tokens for reuse.

The prompt cache (PromptCache, `cflow serve --cache-ram`, as llama-server's) keeps the histories
that leave the slots in sequence states of their own, within a memory budget: a conversation
that comes back after other users' requests took every slot starts from its earlier turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import deque

import numpy as np

from cflow._native import core
from cflow.engine import CACHE_RAM_MIB, check_kv_memory, kv_bytes_held
from cflow.errors import CflowError
from cflow.generate import PREFILL_CHUNK, Chunk, Decoder

END = object()  # put on a Job's queue after its last chunk (or its error)
REORDER_WINDOW = 8  # waiting requests compared for prompt reuse; also the most one is passed over


class QueueFull(Exception):
    pass


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences (lists or integer arrays),
    compared as arrays: a slot's history and a chat's prompt can be thousands of tokens, and an
    admission compares up to REORDER_WINDOW prompts with every slot between two steps."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


def _longest(reuse: tuple[int, Slot]) -> tuple[int, int]:
    """Key of a (shared prefix, slot) pair: the longest prefix, then the least recently used."""
    return reuse[0], -reuse[1].used


def _reusable(job: Job, held: dict) -> int:
    """The longest prefix of the job's prompt in any history (held: slot or cache entry -> its
    tokens), as much of it as its Decoder keeps."""
    return job.decoder.reusable(max((common_prefix(tokens, job.ids) for tokens in held.values()), default=0))


def _put_all(pairs) -> None:
    for queue, item in pairs:
        queue.put_nowait(item)


def _deliver(items: list) -> None:
    """Hand a step's (job, item) pairs to their handlers: one wake-up of each event loop a step."""
    by_loop: dict = {}
    for job, item in items:
        by_loop.setdefault(job._loop, []).append((job.queue, item))
    for loop, pairs in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody is left to read it
            loop.call_soon_threadsafe(_put_all, pairs)


class Job:
    """One request's generation, made on the event loop. Iterate with `await next()`; each item
    is a Chunk, an Exception (raised by the model) or END."""

    def __init__(self, batcher: Batcher, decoder: Decoder, stream: bool = True):
        """stream=False: the handler wants only the whole answer, so the batcher holds the chunks
        and hands out one, at the end (an unstreamed answer then costs the event loop one wake-up
        instead of one a token: at --parallel 8 the event loop was busy a fifth of the time, about
        half of it waking for tokens, on the two cores the engine runs on)."""
        self.batcher, self.decoder, self.stream = batcher, decoder, stream
        self.ids = np.asarray(decoder.prompt, dtype=np.int64)  # the prompt, for prefix comparisons
        self._held: list[Chunk] = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.slot: Slot | None = None
        self.cached = 0
        self.begun = False
        self.passed = 0  # times a later request was admitted before it (REORDER_WINDOW)
        self._loop = asyncio.get_running_loop()

    def whole(self, chunk: Chunk) -> Chunk | None:
        """What to hand out for this chunk: itself when streaming; else None until the last one,
        then one chunk of all the text and tokens, with the last one's end, usage and timings."""
        if self.stream:
            return chunk
        self._held.append(chunk)
        if chunk.finish_reason is None:
            return None
        held, self._held = self._held, []
        logprobs = None if chunk.logprobs is None else [x for c in held for x in c.logprobs or []]
        return Chunk("".join(c.text for c in held), [t for c in held for t in c.token_ids], chunk.finish_reason,
                     chunk.usage, chunk.timings, logprobs, held[0].prompt_logprobs)

    def put(self, item) -> None:
        """From the batcher thread: hand an item to the request's handler."""
        _deliver([(self, item)])

    async def next(self):
        return await self.queue.get()

    def cancel(self) -> None:
        """Stop generating (client gone, or answer no longer wanted): a queued request leaves
        the queue now, a running one its slot at the next step."""
        self.batcher.cancel(self)


class Slot:
    """A sequence state of the batcher and the job it runs (None: free)."""

    def __init__(self, state):
        self.state = state
        self.job: Job | None = None
        self.used = 0  # when it was last given a job (least recently used is reused first)
        self.prompt_len = 0  # of its last job: the part of its history a request asked


class PromptCache:
    """Histories that left the slots, each in a sequence state of its own, within `max_bytes` of
    KV memory (the pages their tokens committed, engine.kv_bytes_held). What the batcher does with
    it, between steps and under its lock:
    - park(state, tokens, prompt_len): a slot's history that a new request would overwrite moves
      here, state and all (no copy), and the slot goes on with the state park() returns: an
      evicted entry's, emptied, or a new one. The histories it makes obsolete go: those whose
      whole prompt (their request's) is a prefix of the new one, which offers all they did. Then
      the least recently used go until the budget holds it; one larger than the budget is not kept.
    - held(): entry -> its tokens, for the prefix search; hit(entry): one was copied from (it
      becomes the most recently used).
    max_bytes 0: nothing is kept."""

    def __init__(self, engine, max_bytes: int):
        if max_bytes < 0:
            raise CflowError("the prompt cache's budget must be >= 0 bytes")
        self.engine, self.max_bytes = engine, max_bytes
        self._entries: dict = {}  # state -> (tokens, prompt_len, bytes); insertion order = least recently used first
        self.bytes = 0
        self.hits = self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def held(self) -> dict:
        return {state: e[0] for state, e in self._entries.items()}

    def hit(self, state) -> None:
        self._entries[state] = self._entries.pop(state)
        self.hits += 1

    def _drop(self, state):
        self.bytes -= self._entries.pop(state)[2]
        self.evicted += 1
        return state

    def park(self, state, tokens, prompt_len: int):
        tokens = np.asarray(tokens, dtype=np.int64)
        size = kv_bytes_held(self.engine, len(tokens))
        if not len(tokens) or size > self.max_bytes:
            return state
        freed = [self._drop(s) for s, (t, p, _) in list(self._entries.items()) if common_prefix(t, tokens) >= p]
        while self._entries and self.bytes + size > self.max_bytes:
            freed.append(self._drop(next(iter(self._entries))))
        if freed:  # the first goes on in the slot; the others are freed, their pages back to the system
            spare = freed[0]
            spare.truncate(0)
        else:
            try:
                spare = self.engine.new_state()
            except CflowError:  # no memory for one more state: the history is not kept
                return state
        self._entries[state] = (tokens, min(prompt_len, len(tokens)), size)
        self.bytes += size
        return spare


class Batcher:
    """N slots over one engine and the thread that runs their steps (module docstring)."""

    def __init__(self, engine, n: int, max_queue: int, prefill_budget: int = PREFILL_CHUNK,
                 cache_bytes: int = CACHE_RAM_MIB << 20):
        if n < 1 or max_queue < 0:
            raise CflowError("parallel must be >= 1 and max_queue >= 0")
        check_kv_memory(engine, n)
        self.engine, self.n, self.max_queue, self.prefill_budget = engine, n, max_queue, prefill_budget
        self.slots = [Slot(engine.new_state()) for _ in range(n)]
        self.cache = PromptCache(engine, cache_bytes)
        self._waiting: deque[Job] = deque()
        self._cv = threading.Condition()
        self._clock = itertools.count(1)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # forwards run (a step per token of the longest running sequence)
        # where the batcher thread's time goes (/metrics): seconds inside engine.forward, seconds
        # of whole steps (the forward, then sampling, detokenizing and handing out each row's
        # result), and the rows the steps carried (decode tokens, prompt pieces)
        self.forward_seconds = self.step_seconds = 0.0
        self.decode_rows = self.prompt_rows = 0

    # ---- what /health and /metrics read
    @property
    def active(self) -> int:
        return sum(1 for s in self.slots if s.job is not None)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot (those that free slots will take at the next step aside)."""
        return max(0, self._beyond_free())

    def slot_states(self) -> list[dict]:
        """What each slot does now (GET /slots), read under the lock: its request's progress, or
        the history it keeps for the next. No prompt text: the slots hold other users' requests."""
        out = []
        with self._cv:
            for i, s in enumerate(self.slots):
                job = s.job
                if job is None:  # no forward touches an idle slot's state
                    out.append({"id": i, "is_processing": False, "state": "idle", "n_past": s.state.pos})
                    continue
                d = job.decoder
                decoded = len(d.out_ids)
                out.append({"id": i, "is_processing": True, "state": "prefilling" if d.prefilling or not job.begun
                            else "decoding", "n_prompt_tokens": len(d.prompt), "n_cached_tokens": job.cached,
                            "n_decoded": decoded, "n_remain": d.max_tokens - decoded})
        return out

    def _beyond_free(self) -> int:
        """Waiting requests less free slots (negative while slots are free)."""
        return len(self._waiting) - sum(1 for s in self.slots if s.job is None)

    # ---- the event loop's side
    def submit(self, job: Job) -> None:
        """Queue the job (the batcher thread gives it a slot at the next step, or when one frees);
        QueueFull when max_queue requests already wait beyond the free slots."""
        with self._cv:
            if self._beyond_free() >= self.max_queue:
                raise QueueFull
            self._waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        with self._cv:
            job.cancelled = True
            if job.slot is None and job in self._waiting:
                self._waiting.remove(job)
                job.put(END)
            self._cv.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cflow-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
        with self._cv:  # whoever still waits gets its end
            for job in [s.job for s in self.slots if s.job is not None] + list(self._waiting):
                job.put(END)
            self._waiting.clear()
            for s in self.slots:
                s.job = None

    # ---- slots (the batcher thread, under the lock, between steps)
    def _admit(self) -> None:
        """Give free slots to waiting requests (module docstring: which goes next, which slot)."""
        free = [s for s in self.slots if s.job is None]
        if not free or not self._waiting:
            return
        held = {s: np.asarray(s.state.tokens, dtype=np.int64) for s in self.slots}  # every history, read once
        while free and self._waiting:
            window = list(itertools.islice(self._waiting, REORDER_WINDOW))
            pick = 0
            if window[0].passed < REORDER_WINDOW:
                known = held | self.cache.held()  # every history a prompt could start from
                reuse = [_reusable(job, known) for job in window]
                pick = max(range(len(window)), key=lambda i: (reuse[i], -i))
            for job in window[:pick]:
                job.passed += 1
            job = window[pick]
            del self._waiting[pick]
            slot = self._assign(job, free, held)
            free.remove(slot)
            held[slot] = job.ids[:job.cached]  # what its cache holds until it runs

    def _assign(self, job: Job, free: list[Slot], held: dict) -> Slot:
        prompt = job.ids
        reuse = [(common_prefix(held[s], prompt), s) for s in free]
        intact = [(c, s) for c, s in reuse if c == len(held[s])]  # empty, or all of it the prompt's
        own = max(((c, s) for c, s in reuse if c > 0), key=_longest, default=None)
        if intact:  # a slot that loses nothing
            cached, slot = max(intact, key=_longest)
        elif own and 2 * own[0] >= len(held[own[1]]):  # mostly this prompt's own past
            cached, slot = own
        else:  # the least recently used slot
            cached, slot = min(reuse, key=lambda cs: cs[1].used)
        if cached < min(slot.prompt_len, len(held[slot])) and self.cache.max_bytes:
            # the prompt cut is another conversation's: its history goes to the prompt cache
            state = self.cache.park(slot.state, held[slot], slot.prompt_len)
            if state is not slot.state:  # kept: the slot goes on with another state
                slot.state = state
                held[slot], cached = held[slot][:0], 0
        # the longest shared prefix in any slot, running ones too (no forward runs now), or cached
        best = max(((common_prefix(t, prompt), s) for s, t in (held | self.cache.held()).items() if s is not slot),
                   key=lambda cs: cs[0], default=(0, None))
        if best[0] > cached:
            src = best[1]
            if isinstance(src, Slot):
                src = src.state
            else:
                self.cache.hit(src)
            slot.state.copy_prefix(src, best[0])
            cached = best[0]
        slot.job, slot.used, slot.prompt_len = job, next(self._clock), len(prompt)
        job.slot, job.cached = slot, cached
        return slot

    def _release(self, slot: Slot) -> None:
        slot.job.put(END)
        slot.job = None

    # ---- the batcher thread
    def _run(self) -> None:
        core.set_thread_name("cflow-batcher")  # as the OS shows it (Python 3.11 names only its own record)
        while True:
            with self._cv:
                while True:
                    for s in self.slots:
                        if s.job is not None and s.job.cancelled:
                            self._release(s)
                    self._admit()
                    if self._stopping or any(s.job is not None for s in self.slots):
                        break
                    self._cv.wait()
                if self._stopping:
                    return
                jobs = sorted((s.job for s in self.slots if s.job is not None), key=lambda j: j.slot.used)
            try:
                self._step(jobs)
            except Exception as e:  # a fault outside any one request: fail these, keep serving
                with self._cv:
                    for job in jobs:
                        if job.slot is not None and job.slot.job is job:
                            job.put(e)
                            self._release(job.slot)

    def _compose(self, jobs: list[Job]) -> tuple[list[Job], list[list[int]]]:
        """This step's rows: every decoding sequence's next token, then prompt pieces of
        joining sequences in arrival order while they fit the budget (at least one piece)."""
        batch, ids, budget = [], [], self.prefill_budget
        for job in jobs:
            if not job.begun:
                job.decoder.begin(job.slot.state, job.cached)
                job.begun = True
            piece = job.decoder.next_input()
            if job.decoder.prefilling:
                if budget < len(piece) and budget < self.prefill_budget:
                    continue
                budget -= len(piece)
            batch.append(job)
            ids.append(piece)
        return batch, ids

    def _forward(self, batch: list[Job], ids: list[list[int]]) -> list:
        """Each job's logits (or the exception that failed its forward): one forward for the
        rows whose last logits suffice, and one of its own for each prompt piece whose every
        row's logits its job needs (its prompt's logprobs), so that no other row's head changes
        path (bit for bit, a row's logits do not depend on what shares its step either way)."""
        outs: list = [None] * len(batch)
        calls = [([i for i, job in enumerate(batch) if not job.decoder.all_rows], False)]
        calls += [([i], True) for i, job in enumerate(batch) if job.decoder.all_rows]
        for rows, every in calls:
            if not rows:
                continue
            try:
                got = self.engine.forward([batch[i].slot.state for i in rows], [ids[i] for i in rows], all_logits=every)
            except Exception as e:  # these requests fail, the batcher and the server live on
                got = [e] * len(rows)
            for i, out in zip(rows, got):
                outs[i] = out
        return outs

    def _step(self, jobs: list[Job]) -> None:
        t0 = time.perf_counter()
        batch, ids = self._compose(jobs)
        tf = time.perf_counter()
        outs = self._forward(batch, ids)
        t1 = time.perf_counter()
        self.steps += 1
        for job, piece in zip(batch, ids):
            if job.decoder.prefilling:
                self.prompt_rows += len(piece)
            else:
                self.decode_rows += 1
        ended, items = [], []
        for job, logits in zip(batch, outs):
            try:
                if isinstance(logits, Exception):
                    raise logits
                chunk = job.decoder.feed(logits)
            except Exception as e:
                items.append((job, e))
                ended.append(job)
                continue
            if chunk is not None and (chunk := job.whole(chunk)) is not None:
                items.append((job, chunk))
            if job.decoder.done:
                ended.append(job)
        _deliver(items)
        if ended:
            with self._cv:
                for job in ended:
                    self._release(job.slot)
        t2 = time.perf_counter()
        self.forward_seconds += t1 - tf
        self.step_seconds += t2 - t0
