"""The engines: one interface, two implementations of the same step plan (docs/ENGINE.md).

The model's module (cflow.models) builds the plan ONCE per model: typed ops (cflow.plan) with
tensor indices into the mapped file and scratch buffer ids; barriers only where data
dependence needs them. `Engine` hands it to the C++ executor, which checks every offset, shape
and field before it runs anything; then one native call runs a whole step (all layers, all
threads, GIL released). Python never loops over layers. `RefEngine` (engine_ref.py) interprets
the same plan in numpy, fp32: slow and readable.

Sequence state is apart from the engine: a State holds one sequence's tokens and KV cache, and
`forward` advances one state, or several at once (their rows share every weight read):

    eng = Engine("smollm2.cflow", threads=2)
    st = eng.new_state()
    logits = eng.forward(st, prompt_ids)               # prefill: (vocab,) of the last token
    logits = eng.forward(st, [next_id])                # one decode step
    a, b = eng.forward([s1, s2], [[t1], [t2]])         # two sequences in one step
    st.tokens, st.pos; st.truncate(n)                  # history; keep a prefix

Several Python threads may run forwards on one Engine at once, each with its own states.

Each forward checks the mapped file before and after the step (CflowFile.check_mapping: one
fstat and a flag): once the file was truncated or written in place under the mapping, forward
raises ModelFileChanged, and that step's logits are dropped (docs/ENGINE.md, "Model file changed
on disk").
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import numpy as np

from cflow.config import MAX_SIZE, ModelConfig
from cflow.errors import CflowError, CflowFormatError, ModelFileChanged

# Weight roles whose int8 activations may be two-level (Engine's `precise`; an op's two_level).
# The plan (cflow.plan, which needs the native core) is imported where it is used, so the CLI
# and the training path import this module without the core.
ROLES = ("qkv", "attn_output", "gate_up", "down", "head")
MAX_BATCH = 512  # rows per native call when prefilling (bounds the scratch)
DEFAULT_MAX_CTX = 8192  # default context: the model's, at most this (KV pages and RoPE tables grow with it)
CACHE_RAM_MIB = 256  # the server's prompt cache by default (cflow serve --cache-ram): MiB of KV pages

ACTIVATIONS = {"int8x2": dict(fast=True, precise=True), "int8": dict(fast=True, precise=False),
               "fp32": dict(fast=False, precise=False)}
"""The activation settings by name (CLI --activations): two-level int8 (the default), one-level
int8, fp32."""


KV_CACHE_TYPES = ("f16", "q8_0", "f32")
"""How the KV cache may store keys and values (Engine cache_type_k / cache_type_v, CLI
--cache-type-k / --cache-type-v, as llama.cpp names them): IEEE halves (the int8 paths' default),
llama.cpp's q8_0 blocks (32 int8 and a half scale: 17/32 of the halves' memory and of the bytes
attention reads), or floats (the fp32 path's default)."""


def check_kv_types(cache_type_k: str | None, cache_type_v: str | None, plan=None) -> None:
    """Raise CflowError for a KV cache type not in KV_CACHE_TYPES (None: the engine's default), or
    for q8_0 where the plan's head dims are not multiples of its blocks of 32."""
    for name, t in (("cache_type_k", cache_type_k), ("cache_type_v", cache_type_v)):
        if t is not None and t not in KV_CACHE_TYPES:
            raise CflowError(f"{name} must be one of {', '.join(KV_CACHE_TYPES)}, got {t!r}")
    if plan is not None and "q8_0" in (cache_type_k, cache_type_v):
        odd = _q8_0_misfits(plan)
        if odd:
            raise CflowError(f"a q8_0 KV cache takes head dims that are multiples of 32 (its blocks); this model's "
                             f"are {', '.join(map(str, odd))}: use f16")


def _q8_0_misfits(plan) -> list[int]:
    """The plan's KV head dims that q8_0's blocks of 32 do not divide (none: q8_0 fits)."""
    return sorted({d for _, d in _plan().kv_slots(plan) if d % 32})


def kv_row_bytes(dtype: str, head_dim: int) -> int:
    """Bytes one position of one KV head takes in a cache of `dtype` (KV_CACHE_TYPES)."""
    if dtype == "q8_0":
        return head_dim // 32 * 34
    return head_dim * (2 if dtype == "f16" else 4)


def _kv_heads(engine) -> list[tuple[int, int]]:
    """Per KV slot: (n_kv_head, bytes of one token's key and value in one head)."""
    k, v = engine.kv_types
    return [(h, kv_row_bytes(k, d) + kv_row_bytes(v, d)) for h, d in _plan().kv_slots(engine.plan)]


def kv_bytes_per_token(engine) -> int:
    """Bytes of KV cache one token takes in one state: K and V of every attention layer."""
    return sum(h * b for h, b in _kv_heads(engine))


def kv_bytes_read(engine, context: int) -> int:
    """Bytes of keys and values a decode step at `context` positions reads: every attention op's K
    and V over its window (the whole context where it has none)."""
    k, v = engine.kv_types
    return sum(op.n_kv_head * (kv_row_bytes(k, op.head_dim) + kv_row_bytes(v, op.head_dim))
               * (min(context, op.window) if op.window > 0 else context)
               for op in engine.plan.ops if isinstance(op, _plan().Attention))


PAGE = 4096  # the pages a state's KV cache is committed in


def kv_bytes_held(engine, n: int) -> int:
    """Bytes of memory a state holding n tokens has committed: each KV head's positions are one
    region of n_ctx (State's head-major layout), committed in whole pages as it fills."""
    k, v = engine.kv_types
    return sum(h * sum(-(-n * kv_row_bytes(t, d) // PAGE) * PAGE for t in (k, v))
               for h, d in _plan().kv_slots(engine.plan))


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo, else psutil's figure, in bytes (None if neither is known)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return None


def check_kv_memory(engine, n: int) -> None:
    """Fail with advice when the KV caches of n full sequences would not fit in memory (the
    server checks its --parallel slots at start-up, Engine.new_state one sequence)."""
    per_token = kv_bytes_per_token(engine)
    need, avail = n * engine.n_ctx * per_token, available_memory()
    if avail is not None and need > avail:
        who = f"--parallel {n} sequences" if n > 1 else "one sequence"
        # a smaller cache type where the model's heads take it and the cache holds more
        q8 = engine.kv_types != ("q8_0", "q8_0") and not _q8_0_misfits(engine.plan)
        raise CflowError(f"the KV cache ({engine.kv_dtype}) of {who} x n_ctx {engine.n_ctx} tokens x "
                         f"{per_token / 1024:.1f} KiB per token needs {need / 2**30:.2f} GiB, but only "
                         f"{avail / 2**30:.2f} GiB of memory is available: lower --n-ctx or --parallel"
                         + (", or keep keys and values in q8_0 (-ctk q8_0 -ctv q8_0)" if q8 else ""))


AUTO_PARALLEL = 4  # `cflow serve`'s sequences by default, as llama-server's slots


def auto_parallel(engine, avail: int | None = None) -> int:
    """`cflow serve --parallel`'s default: AUTO_PARALLEL sequences, fewer (at least one) where
    their full KV caches would take more than half the available memory (avail, bytes; default
    available_memory()), the other half left to the prompt cache and the rest of the machine."""
    avail = available_memory() if avail is None else avail
    if avail is None:
        return AUTO_PARALLEL
    per_sequence = engine.n_ctx * kv_bytes_per_token(engine)
    return max(1, min(AUTO_PARALLEL, avail // 2 // max(1, per_sequence)))


def _plan():
    from cflow import plan

    return plan


MAX_THREADS = 1024  # far above any machine's cores; a thread pool of 10^5 threads cannot start


def default_threads() -> int:
    """CFLOW_THREADS when set, else the cores this process may run on."""
    env = os.environ.get("CFLOW_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise CflowError(f"CFLOW_THREADS must be a positive integer, got {env!r}") from None
        if n < 1:
            raise CflowError(f"CFLOW_THREADS must be a positive integer, got {env!r}")
        return n
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def activations_name(fast: bool, precise_roles) -> str:
    if not fast:
        return "fp32"
    if not precise_roles:
        return "int8"
    return "int8x2" if set(precise_roles) == set(ROLES) else "int8x2:" + "+".join(precise_roles)


def open_weights(src):
    """A path (.cflow, .gguf, HF directory) or an already open CflowFile / Checkpoint."""
    if not isinstance(src, (str, os.PathLike)):
        return src
    from cflow.convert import load_source, source_kind

    if source_kind(src) == "cflow":
        from cflow.format import CflowFile

        return CflowFile(src)
    return load_source(src)


def build_plan(weights, cfg: ModelConfig, precise=()):
    """The step plan of a model (a cflow.plan.Plan): its architecture module describes its forward pass."""
    from cflow import models
    from cflow import plan as P

    return models.get(cfg.arch).build(P.PlanBuilder(weights, precise), cfg)


class EngineBase:
    """What both engines share: the plan, the context, argument checks, and forward over one or
    several states. Subclasses implement new_state() and _forward(states, ids, all_logits), and
    say how their KV cache stores keys and values (kv_types: "f32", "f16" or "q8_0" each; kv_dtype).

    fast=True: activations quantized to int8 per op (integer dot products); fast=False: fp32
    activations, the parity path. precise=True (with fast; the default): two-level int8 for
    every weight (ROLES): about 14 bits of activation precision; a collection of ROLES limits
    it to those weights; False: one level, as llama.cpp's q8 activations. ACTIVATIONS names
    the three settings.
    """

    def __init__(self, weights, *, threads: int | None = None, n_ctx: int | None = None, fast: bool = True,
                 precise: bool | Iterable[str] = True):
        from cflow import models

        self.file = open_weights(weights)
        cfg: ModelConfig = self.file.config
        models.check_model(cfg, self.file.tensors)  # the plan trusts the config: it must fit the tensors
        self.config = cfg
        self.n_ctx = int(n_ctx or min(cfg.max_seq_len, DEFAULT_MAX_CTX))
        if self.n_ctx <= 0:
            raise CflowError(f"n_ctx must be positive, got {self.n_ctx}")
        if self.n_ctx > MAX_SIZE:
            raise CflowError(f"n_ctx={self.n_ctx} exceeds {MAX_SIZE} tokens (the model holds {cfg.max_seq_len})")
        self.threads = int(threads or default_threads())
        if not 1 <= self.threads <= MAX_THREADS:
            raise CflowError(f"threads must be in 1..{MAX_THREADS}, got {self.threads}")
        self.fast = bool(fast)
        roles = ROLES if precise is True else tuple(precise or ())
        self.precise_roles = roles if self.fast else ()
        self.precise = bool(self.precise_roles)
        self.activations = activations_name(self.fast, self.precise_roles)
        from cflow import plan as P

        self.plan = build_plan(self.file, cfg, self.precise_roles)
        if self.precise and not any(getattr(op, "two_level", False) for op in self.plan.ops):
            self.activations = "int8"  # every matrix one level: a ternary model (plan.PlanBuilder.op)
        elif self.precise and any(t.type in P.TERNARY_CODES for t in self.plan.tensors):
            self.activations += " (int8 on the ternary matrices and the head)"
        self.bytes_per_token = P.bytes_per_token(self.plan)
        self.vocab = self.plan.buffers[self.plan.logits].width

    def new_state(self):
        raise NotImplementedError

    @property
    def kv_dtype(self) -> str:
        """kv_types in one word: "f16", "q8_0" or "f32", or "K/V" (such as "q8_0/f16") when they differ."""
        k, v = self.kv_types
        return k if k == v else f"{k}/{v}"

    @property
    def prompt_rows_as_decode(self) -> bool:
        """Whether a prompt row computes bit for bit what a decode row computes, so that a prompt
        whose prefix is cached needs only its last token computed again (else its last two: a
        piece of two or more rows takes the prefill path of a fresh prompt)."""
        return False

    def _forward(self, states: list, ids: list[np.ndarray], all_logits: bool) -> tuple[np.ndarray, bool | None]:
        """Run one step over the states' new tokens: the logits rows as Engine.forward
        concatenates them, and whether they are all finite (None: not known, forward checks)."""
        raise NotImplementedError

    def forward(self, state, token_ids, *, all_logits: bool = False):
        """Append token_ids to state; logits float32 of its last token (vocab,), or of every
        token (len, vocab) with all_logits. With a list of states and a list of token lists,
        one step for all of them; returns a list of those arrays, one per state."""
        many = isinstance(state, (list, tuple))
        states = list(state) if many else [state]
        lists = list(token_ids) if many else [token_ids]
        if len(states) != len(lists):
            raise CflowError(f"forward: {len(states)} states but {len(lists)} token lists")
        if not states:
            raise CflowError("forward: no states")
        if len({id(s) for s in states}) != len(states):
            raise CflowError("forward: a state appears twice")
        ids = []
        for st, toks in zip(states, lists):
            a = np.asarray(toks, dtype=np.int64).reshape(-1)
            if a.size == 0:
                raise CflowError("forward: no tokens")
            if st.pos + a.size > self.n_ctx:
                raise CflowError(f"context full: {st.pos} tokens in the cache + {a.size} new exceed n_ctx={self.n_ctx}")
            if a.min() < 0 or a.max() >= self.vocab:
                raise CflowError(f"token ids must be in 0..{self.vocab - 1}")
            ids.append(np.ascontiguousarray(a, dtype=np.int32))
        self.check_weights()
        before = [st.pos for st in states]
        if sum(a.size for a in ids) <= MAX_BATCH:
            whole, finite = self._forward(states, ids, all_logits)
            outs = self._split(whole, ids, all_logits)
            if finite is None:
                finite = np.isfinite(whole).all()  # one pass for the step's rows (a server step: 8)
        else:  # long prompts: each sequence on its own, in pieces of MAX_BATCH rows
            outs, finite = [], True
            for st, a in zip(states, ids):
                parts = [self._forward([st], [a[s:s + MAX_BATCH]], all_logits) for s in range(0, a.size, MAX_BATCH)]
                kept = parts if all_logits else parts[-1:]  # the rows returned
                finite = finite and all(np.isfinite(p).all() if f is None else f for p, f in kept)
                outs.append(np.concatenate([p for p, _ in parts]) if all_logits else parts[-1][0][0])
        self.check_weights()  # the step may have read zeros or new bytes: its logits are not the model's
        if not finite:
            # a file whose numbers pass every check can still overflow (huge weights or scales):
            # the step is undone and no one samples from NaN
            for st, n in zip(states, before):
                st.truncate(n)
            raise CflowError("the model computed non-finite logits (NaN or infinity): its weights or settings are "
                             "broken (`cflow verify FILE` checks a .cflow file)")
        return outs if many else outs[0]

    def weights_error(self) -> str | None:
        """Why the weights can no longer be used (the mapped model file changed on disk), or None
        (CflowFile.mapping_error; weights that are not a mapped file never change)."""
        check = getattr(self.file, "mapping_error", None)
        return check() if check is not None else None

    def check_weights(self) -> None:
        """Raise ModelFileChanged when weights_error() says why the weights cannot be used."""
        err = self.weights_error()
        if err is not None:
            raise ModelFileChanged(err)

    @staticmethod
    def _split(out: np.ndarray, ids: list[np.ndarray], all_logits: bool) -> list[np.ndarray]:
        if not all_logits:
            return list(out)
        return np.split(out, np.cumsum([a.size for a in ids])[:-1])


class State:
    """One sequence of the native engine: its tokens (pos of them) and KV cache (its engine's
    kv_dtype)."""

    def __init__(self, core_state):
        self._st = core_state

    @property
    def pos(self) -> int:
        return self._st.pos

    @property
    def n_ctx(self) -> int:
        return self._st.n_ctx

    @property
    def tokens(self) -> list[int]:
        return list(self._st.tokens)

    @property
    def kv_resident_bytes(self) -> int:
        """Bytes of the KV cache resident in memory: the pages its histories committed and kept
        (a shorter history gives a longer one's whole pages back, State::truncate)."""
        return self._st.kv_resident_bytes

    def reset(self) -> None:
        self._st.truncate(0)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (prompt reuse)."""
        if not 0 <= n <= self.pos:
            raise CflowError(f"truncate({n}): the state holds {self.pos} tokens")
        self._st.truncate(n)

    def copy_prefix(self, src: "State", n: int) -> None:
        """Become the first n tokens of src and their KV cache (a prefix shared with another
        sequence, taken instead of computed again)."""
        try:
            self._st.copy_prefix(src._st, n)
        except RuntimeError as e:
            raise CflowError(str(e)) from None


EXPERT_POLICIES = ("mmap", "sync", "staged")
"""Where a mixture-of-experts model's experts come from (docs/ENGINE.md, "Experts on disk"): the
mapping (the page cache decides what stays in RAM), or a bounded cache of experts read from the
file with O_DIRECT when a layer needs them (sync) or as soon as the router has chosen, with the
next layer's experts predicted and read ahead (staged)."""

IO_BACKENDS = ("pread", "uring")
"""How staged reads reach the disk: blocking preads on io_threads threads, or one io_uring."""

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(v) -> int:
    """Bytes from an int or a string such as "8G", "8GiB", "512M", "1.5g", "4096" (K, M, G, T are
    powers of 1024, with or without "iB"/"B")."""
    if isinstance(v, bool):
        raise CflowError(f"a size must be a number of bytes or a string like 8G, got {v!r}")
    if isinstance(v, (int, np.integer)):
        n = int(v)
    else:
        t = str(v).strip().lower().removesuffix("ib").removesuffix("b")
        unit = t[-1:] if t[-1:] in _UNITS else ""
        try:
            n = int(float(t[:len(t) - len(unit)]) * _UNITS[unit])
        except ValueError:
            raise CflowError(f"a size must be a number of bytes or a string like 8G, 512M, got {v!r}") from None
    if n <= 0:
        raise CflowError(f"a size must be positive, got {v!r}")
    return n


def _align(n: int) -> int:
    return (n + 4095) // 4096 * 4096


SCHEDULES = ("sequential", "pipeline")
"""Engine(schedule=...): every thread on every op in plan order, or the weight streams' lanes on
teams of threads that wait only on true dependencies (docs/ENGINE.md, "Schedules")."""


class Engine(EngineBase):
    """A converted model on the native executor; one per model, any number of States.

    schedule: "sequential" or "pipeline" (SCHEDULES; the same logits either way).
    all_experts: multiply every expert of each MoE layer and keep the chosen ones (same results,
    all the expert bytes read: the A/B of conditional expert loading).
    ram_budget: bytes (or "8G") the model's weights may keep in RAM. A mixture-of-experts model
    larger than that keeps its other weights mapped and its experts in a cache of the rest of the
    budget, read from the file (expert_policy "staged" unless another is given); a model within
    it runs from the mapping. expert_policy: one of EXPERT_POLICIES ("sync" and "staged" without
    a budget cache every expert once read); io_threads: the staged policy's reads in flight;
    predict: whether staged reads ahead the next layer's predicted experts; io_backend: "pread" (a
    thread per read in flight) or "uring" (one thread, the reads in flight on an io_uring; the
    threads where the kernel refuses it). The same logits under every policy.
    """

    def __init__(self, weights, *, threads: int | None = None, n_ctx: int | None = None, fast: bool = True,
                 precise: bool | Iterable[str] = True, schedule: str = "sequential", all_experts: bool = False,
                 ram_budget=None, expert_policy: str | None = None, io_threads: int = 4, predict: bool = True,
                 io_backend: str = "pread", cache_type_k: str | None = None, cache_type_v: str | None = None):
        from cflow._native import core

        if schedule not in SCHEDULES:
            raise CflowError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        if expert_policy is not None and expert_policy not in EXPERT_POLICIES:
            raise CflowError(f"expert_policy must be one of {', '.join(EXPERT_POLICIES)}, got {expert_policy!r}")
        if not isinstance(io_threads, int) or not 1 <= io_threads <= 256:
            raise CflowError(f"io_threads must be in 1..256, got {io_threads!r}")
        if io_backend not in IO_BACKENDS:
            raise CflowError(f"io_backend must be one of {', '.join(IO_BACKENDS)}, got {io_backend!r}")
        check_kv_types(cache_type_k, cache_type_v)
        super().__init__(weights, threads=threads, n_ctx=n_ctx, fast=fast, precise=precise)
        check_kv_types(cache_type_k, cache_type_v, self.plan)
        self.schedule, self.all_experts = schedule, bool(all_experts)
        buf = getattr(self.file, "buffer", None)
        if buf is None:
            raise CflowError("the native engine runs .cflow files (convert the model first: cflow convert)")
        self.ram_budget = None if ram_budget is None else parse_size(ram_budget)
        self.expert_policy, cache = self._expert_tier(expert_policy)
        self.expert_cache_bytes = cache
        path = str(getattr(self.file, "path", ""))  # the tier reads experts from it
        try:
            self._core = core.EngineCore(buf, buf, self.plan, self.n_ctx, self.threads, self.fast, schedule,
                                         self.all_experts, self.expert_policy, path, cache, io_threads, bool(predict),
                                         True, io_backend, cache_type_k or "", cache_type_v or "")
        except (RuntimeError, ValueError) as e:
            raise CflowFormatError(f"cannot run this model: {e}") from None

    def _expert_tier(self, policy: str | None) -> tuple[str, int]:
        """(policy, bytes of expert cache) for the ram_budget and the policy asked for."""
        budget = self.ram_budget
        if policy is None and budget is None:
            return "mmap", 0
        experts = getattr(self.file, "experts", {}) or {}
        size = int(getattr(self.file, "size", 0) or len(self.file.buffer))
        expert_bytes = sum(_align(e.length) for e in experts.values())
        resident = size - expert_bytes
        if policy is None:
            policy = "staged" if budget is not None and size > budget and experts else "mmap"
        if policy == "mmap":
            return policy, 0
        if not experts:
            raise CflowError(f"expert_policy {policy!r} reads experts from disk, but this model has no "
                             "mixture-of-experts layers (a dense model runs from its mapping)")
        if budget is None:
            return policy, expert_bytes
        if budget <= resident:
            raise CflowError(f"a RAM budget of {budget / 2**30:.2f} GiB is below the {resident / 2**30:.2f} GiB of "
                             "weights that stay mapped (attention, dense, router, embedding and head): raise it")
        return policy, min(budget - resident, expert_bytes)

    def tier_report(self) -> dict:
        """The expert tier's counters since the engine was made: reads and bytes from disk, cache
        hits and misses (pinned requests), hinted reads and how many were used, seconds in reads
        and waiting for them, slots, whether reads bypass the page cache (direct), and the staged
        policy's predictions (predicted, predicted_right); with hit_rate and prediction_accuracy."""
        r = dict(self._core.tier_report())
        asked = r["hits"] + r["misses"]
        r["hit_rate"] = r["hits"] / asked if asked else None
        r["prediction_accuracy"] = r["predicted_right"] / r["predicted"] if r["predicted"] else None
        r["policy"], r["cache_bytes"] = self.expert_policy, self.expert_cache_bytes
        return r

    @property
    def critical_path_bytes(self) -> float:
        """Weight bytes per token on the longest chain of true dependencies through the attention,
        dense and expert streams (top_k experts per layer): `cflow analyze`'s longest path."""
        return self._core.critical_path_bytes

    @property
    def teams(self) -> list[dict]:
        """The schedule's teams: the lanes each runs and its threads (one team: sequential)."""
        lanes = ("attention", "dense", "experts")
        return [{"lanes": [n for i, n in enumerate(lanes) if bits >> i & 1], "threads": k}
                for bits, k in self._core.teams]

    def byte_counts(self) -> dict:
        """Weight bytes read since the engine was made, per stream (cflow.plan.STREAMS), with the
        steps and rows (tokens) that read them: {"bytes": {stream: n}, "steps": s, "rows": r}."""
        from cflow.plan import STREAMS

        b, steps, rows = self._core.byte_counts()
        return {"bytes": dict(zip(STREAMS, b)), "steps": steps, "rows": rows}

    @property
    def kv_types(self) -> tuple[str, str]:
        """How the KV cache stores keys and values (KV_CACHE_TYPES): ("f16", "f16") on the int8
        paths unless cache_type_k / cache_type_v said otherwise, ("f32", "f32") on the fp32 path."""
        return tuple(self._core.kv_types)

    @functools.cached_property
    def prompt_rows_as_decode(self) -> bool:
        return self._core.prompt_rows_as_decode  # AVX-512 fast paths: every matrix's batched kernel

    def new_state(self) -> State:
        """A fresh, empty sequence (its KV cache for n_ctx tokens is allocated here)."""
        check_kv_memory(self, 1)
        return State(self._core.new_state())

    def _forward(self, states, ids, all_logits):
        out = np.empty((sum(a.size for a in ids) if all_logits else len(ids), self.vocab), dtype=np.float32)
        try:
            finite = self._core.forward([s._st for s in states], ids, all_logits, out)
        except RuntimeError as e:
            raise CflowError(str(e)) from None
        return out, finite

    def profile(self) -> dict[str, float]:
        """Seconds spent per op kind since creation (needs CFLOW_PROFILE=1)."""
        from cflow import plan as P

        return {k.__name__: t for k, t in zip(P.OP_KINDS, self._core.profile())}

