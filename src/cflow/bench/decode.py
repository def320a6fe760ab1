"""`cflow bench decode`: decode and prefill speed of a model, next to the bandwidth probe and,
with --vs llama.cpp, next to llama.cpp on the same GGUF with the same threads.

cflow is timed the way a user sees it (wall clock around Engine.forward plus the greedy pick in
Python); llama.cpp's figures come from its own perf counters (llama_perf_context: prompt and
eval times), so none of the Python binding's overhead is charged to it. Runs alternate between
the two so that the machine's load affects both alike. Decode: median of --runs runs of
--tokens greedy tokens after a warm-up, each run from a --depth-token prompt (16 by default; the
context its attention reads, as llama-bench's --n-depth); prefill: median over the runs of a
--prompt-token prompt.

Two probes: the standard one (PROBE_MIB, beyond what this machine's cache holds: memory
bandwidth) and one over the model's own bytes per token, which says what the memory system
delivers for a working set of that size (a model that fits a large L3 reads faster than memory).
Every run's figures are in the JSON record too (decode_runs, prefill_runs), and the ISA that ran.

--batch N also times decode steps that advance N sequences together (the server's --parallel N)
against steps of one, and with --vs llama.cpp llama.cpp's own steps of N sequences (one
llama_decode of N tokens, each its own sequence, as llama-server batches its slots), both timed
by the wall clock: what continuous batching can gain on this machine, engine against engine.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time

import numpy as np

from cflow.errors import CflowError

PROBE_MIB = 1024


def add_arguments(p):
    from cflow.commands.generate import add_activation_arguments

    p.add_argument("-m", "--model", default="smollm2-135m",
                   help="model: a name known to `cflow pull`, a .cflow or .gguf path (default smollm2-135m)")
    p.add_argument("--gguf", help="GGUF file for --vs llama.cpp (default: the model's own source)")
    p.add_argument("--threads", type=int, default=2, help="threads for both engines (default 2)")
    p.add_argument("--vs", choices=["llama.cpp"], help="also run llama.cpp (llama-cpp-python, extra cflow[bench])")
    p.add_argument("--vs-flash-attn", choices=["on", "off"], default="on",
                   help="llama.cpp's flash attention: on as llama.cpp's own tools run it on a CPU (default), off as "
                        "llama-cpp-python opens a context (faster for llama.cpp at long depths on some CPUs)")
    p.add_argument("--runs", type=int, default=5, help="timed runs per engine (default 5)")
    p.add_argument("--tokens", type=int, default=128, help="decoded tokens per run (default 128)")
    p.add_argument("--prompt", type=int, default=512, help="prefill prompt length (default 512)")
    p.add_argument("--depth", type=int, default=16, metavar="N",
                   help="decode (and --batch) steps start after an N-token prompt: the context their attention "
                        "reads, as llama-bench's --n-depth (default 16)")
    add_activation_arguments(p)
    p.add_argument("--batch", type=int, default=1, metavar="N",
                   help="also time decode steps of N sequences together (the server's --parallel N), "
                        "against one, and llama.cpp's with --vs (default 1: not measured)")
    p.add_argument("--agreement", type=int, default=0, metavar="N",
                   help="with --vs llama.cpp: feed the first N prompt tokens one at a time to both engines and "
                        "report how often their greedy next tokens agree, and how often each picks what cflow's "
                        "fp32 path picks on the same weights (default 0: not measured)")
    p.add_argument("--json", action="store_true", help="print one JSON line")


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    # A fixed pseudo-random prompt: both engines get exactly the same token ids.
    return [int(t) for t in np.random.default_rng(seed).integers(100, min(vocab, 30000), size=n)]


def _rotations(prompt: list[int], n: int) -> list[list[int]]:
    # n distinct prompts of one length, for the sequences of a batched step
    return [prompt[i:] + prompt[:i] for i in range(n)]


class CflowRunner:
    def __init__(self, engine):
        self.eng = engine
        self.st = engine.new_state()
        self.steps: list[float] = []  # seconds of every decode step timed so far

    def decode(self, prompt: list[int], n: int) -> float:
        self.st.reset()
        logits = self.eng.forward(self.st, prompt)
        t0 = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            logits = self.eng.forward(self.st, [int(np.argmax(logits))])
            self.steps.append(time.perf_counter() - t)
        return n / (time.perf_counter() - t0)

    def prefill(self, prompt: list[int]) -> float:
        self.st.reset()
        t0 = time.perf_counter()
        self.eng.forward(self.st, prompt)
        return len(prompt) / (time.perf_counter() - t0)

    def teacher_argmax(self, tokens: list[int]) -> list[int]:
        """The greedy next token after each of `tokens`, fed one decode step at a time."""
        self.st.reset()
        return [int(np.argmax(self.eng.forward(self.st, [t]))) for t in tokens]

    def bytes_read(self, prompt: list[int], n: int) -> dict[str, float] | None:
        """Weight bytes per decoded token, per stream, by the engine's counters over n greedy steps
        (None for an engine without counters)."""
        if not hasattr(self.eng, "byte_counts"):
            return None
        self.st.reset()
        logits = self.eng.forward(self.st, prompt)
        a = self.eng.byte_counts()
        for _ in range(n):
            logits = self.eng.forward(self.st, [int(np.argmax(logits))])
        b = self.eng.byte_counts()
        return {k: (b["bytes"][k] - a["bytes"][k]) / (b["rows"] - a["rows"]) for k in b["bytes"]}

    def batched_steps(self, prompt: list[int], n_seq: int, n: int) -> list[float]:
        """Seconds of n decode steps that advance n_seq sequences (prompt, then greedy) together."""
        states = [self.eng.new_state() for _ in range(n_seq)]
        outs = self.eng.forward(states, _rotations(prompt, n_seq))
        steps = []
        for _ in range(n):
            t = time.perf_counter()
            outs = self.eng.forward(states, [[int(np.argmax(o))] for o in outs])
            steps.append(time.perf_counter() - t)
        return steps


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_int8" in line for line in f)
    except OSError:
        return False


@contextlib.contextmanager
def _default_params(which: str, **fields):
    """llama_cpp.Llama builds its llama_model_params and llama_context_params from
    llama_{which}_default_params() and has no argument for some fields: set them by wrapping that
    function while the model loads."""
    import llama_cpp.llama as module

    name = f"llama_{which}_default_params"
    orig = getattr(module.llama_cpp, name)

    def params():
        p = orig()
        for k, v in fields.items():
            setattr(p, k, v)
        return p

    setattr(module.llama_cpp, name, params)
    try:
        yield
    finally:
        setattr(module.llama_cpp, name, orig)


def check_flash_attn(cache_type_v: str | None, flash_attn: bool) -> None:
    """llama.cpp keeps a quantized V cache only with its flash attention."""
    if cache_type_v not in (None, "f16", "f32") and not flash_attn:
        raise CflowError(f"llama.cpp needs flash attention for a {cache_type_v} V cache: leave --vs-flash-attn on")


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's low-level API, timed by its perf counters."""

    N_BATCH = 512  # tokens a llama_decode takes at most (llama.cpp aborts the process beyond)

    def __init__(self, gguf: str, threads: int, n_ctx: int, extra_bufts: bool | None = None,
                 logits_all: bool = False, n_seq: int = 1, cache_types: tuple[str, str] = ("f16", "f16"),
                 flash_attn: bool = True):
        try:
            import llama_cpp
        except ImportError as e:
            raise CflowError("--vs llama.cpp needs llama-cpp-python: pip install 'cflow[bench]'") from e
        self.lc = llama_cpp
        if n_seq > (most := llama_cpp.llama_max_parallel_sequences()):
            raise CflowError(f"llama.cpp runs at most {most} sequences at once, not {n_seq}")
        # On CPUs with AMX, ggml's AMX buffer type takes this model's Q4_1 matrices and its
        # ggml_backend_amx_mul_mat segfaults (llama-cpp-python 0.3.36, Xeon with amx_int8), so
        # extra buffer types are turned off there: llama.cpp then runs its AVX-512/VNNI CPU
        # kernels, which is what it runs on every CPU without AMX. On this model no other extra
        # buffer type (CPU_REPACK) applies.
        # extra_bufts=False also keeps the weights in the mapping (CPU_REPACK copies the matrices it
        # takes into anonymous memory), as a memory-limited run needs.
        self.extra_bufts = not _cpu_has_amx() if extra_bufts is None else bool(extra_bufts)
        # n_seq > 1: a context for that many sequences at once (batched_steps), each with its own
        # KV cells, n_ctx / n_seq of them (kv_unified off). In one unified buffer every sequence's
        # attention spans all the sequences' cells, masked: at 1024 positions a step of 8 SmolLM2
        # sequences took llama.cpp 211.7 ms against 92.2 (Zen 3, 2 threads), at 16 as fast.
        # llama.cpp pads each sequence's cells to a multiple of 256 (and warns when the total then
        # does not divide): asked for as it will be
        if n_seq > 1:
            n_ctx = n_seq * -(-n_ctx // (256 * n_seq)) * 256
        with (_default_params("model", use_extra_bufts=self.extra_bufts),
              _default_params("context", n_seq_max=n_seq, kv_unified=False) if n_seq > 1 else contextlib.nullcontext()):
            # its KV cache of the types cflow's holds (--cache-type-k / -v): f16 unless asked. Flash
            # attention as llama.cpp's own tools run it on a CPU (their default, "auto", turns it on
            # there), not llama-cpp-python's default (off); a quantized V cache needs it. Measured
            # on a Zen 3 VM (2 threads, SmolLM2, f16 cache): on, llama.cpp decoded 138.0 tok/s after
            # 64 positions against 126.2 off, and 53.8 after 2048 against 68.9 (--vs-flash-attn off)
            ggml = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}
            check_flash_attn(cache_types[1], flash_attn)
            self.cache_types, self.flash_attn = tuple(cache_types), bool(flash_attn)
            self.llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_batch=self.N_BATCH, n_ubatch=self.N_BATCH,
                                       n_threads=threads, n_threads_batch=threads, logits_all=logits_all,
                                       type_k=ggml[cache_types[0]], type_v=ggml[cache_types[1]],
                                       flash_attn=self.flash_attn, verbose=False)
        self.ctx = self.llm._ctx.ctx
        self.n_seq = n_seq
        self.steps: list[float] = []  # seconds of every decode step timed so far

    def _perf(self):
        return self.lc.llama_perf_context(self.ctx)

    def _eval(self, tokens: list[int]) -> None:
        # llama.cpp charges the tokens queued since the last synchronize to its counters when it
        # synchronizes: one token as a decode step, more as prompt. Llama.eval does not
        # synchronize, so without this every step would be charged later as one big "prompt".
        self.llm.eval(tokens)
        self.lc.llama_synchronize(self.ctx)

    def _greedy(self) -> int:
        # The last token's logits from the context itself: Llama.eval keeps no scores unless the
        # model was opened with logits_all (llm.scores stays zeros, and every pick would be token 0).
        logits = self.lc.llama_get_logits_ith(self.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),))))

    def teacher_argmax(self, tokens: list[int]) -> list[int]:
        """The greedy next token after each of `tokens`, fed one decode step at a time."""
        self.llm.reset()
        out = []
        for t in tokens:
            self._eval([t])
            out.append(self._greedy())
        return out

    def decode(self, prompt: list[int], n: int) -> float:
        """Decode tok/s of the run, and each step's time into self.steps, all by its counters."""
        llm = self.llm
        llm.reset()
        self._eval(prompt)
        total_ms = 0.0
        for _ in range(n):
            self.lc.llama_perf_context_reset(self.ctx)
            self._eval([self._greedy()])
            p = self._perf()
            if p.n_eval != 1:
                raise CflowError(f"llama.cpp counted {p.n_eval} decode steps, expected 1")
            total_ms += p.t_eval_ms
            self.steps.append(p.t_eval_ms / 1e3)
        return n / (total_ms / 1e3)

    def _decode_batch(self, items: list[tuple[int, int, int, bool]]) -> float:
        """One llama_decode of items (token, position, sequence, wants logits), synchronized:
        its wall-clock seconds, the batch filled before the clock starts."""
        lc, n = self.lc, len(items)
        batch = lc.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i, (tok, pos, seq, want) in enumerate(items):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, want
                batch.seq_id[i][0] = seq
            self._outputs = [i for i, item in enumerate(items) if item[3]]  # the batch indices with logits
            t = time.perf_counter()
            if (r := lc.llama_decode(self.ctx, batch)) != 0:
                raise CflowError(f"llama.cpp: llama_decode of {n} tokens returned {r}")
            lc.llama_synchronize(self.ctx)
            return time.perf_counter() - t
        finally:
            lc.llama_batch_free(batch)

    def _logits(self, k: int) -> np.ndarray:
        # the logits of the last batch's k-th token that asked for them (llama_get_logits_ith
        # takes the token's index in the batch)
        p = self.lc.llama_get_logits_ith(self.ctx, self._outputs[k])
        return np.ctypeslib.as_array(p, shape=(self.llm.n_vocab(),))

    def _clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        self.llm.reset()

    def _start(self, prompts: list[list[int]]) -> None:
        # a fresh context holding each prompt as its own sequence s, decoded in one batch
        if not 0 < len(prompts) <= self.n_seq:
            raise CflowError(f"llama.cpp: {len(prompts)} sequences in a context opened for {self.n_seq}")
        self._clear()
        items = [(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
        if len(items) <= self.N_BATCH:
            self._decode_batch(items)
            return
        # more than one llama_decode takes: every prompt's tokens but its last in batches of
        # N_BATCH, then the last tokens together, the batch whose logits the caller reads
        head = [it for it in items if not it[3]]
        for a in range(0, len(head), self.N_BATCH):
            self._decode_batch(head[a:a + self.N_BATCH])
        self._decode_batch([it for it in items if it[3]])

    def batched_logits(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """Each prompt as its own sequence, all in one batch: each one's last-token logits."""
        self._start(prompts)
        out = [self._logits(s).copy() for s in range(len(prompts))]
        self._clear()
        return out

    def batched_steps(self, prompt: list[int], n_seq: int, n: int) -> list[float]:
        """Seconds of n decode steps that advance n_seq sequences (prompt, then greedy) together,
        one llama_decode of n_seq tokens each, as CflowRunner.batched_steps runs cflow."""
        self._start(_rotations(prompt, n_seq))
        steps, pos = [], len(prompt)
        for _ in range(n):
            nxt = [int(np.argmax(self._logits(s))) for s in range(n_seq)]
            steps.append(self._decode_batch([(t, pos, s, True) for s, t in enumerate(nxt)]))
            pos += 1
        self._clear()
        return steps

    def prefill(self, prompt: list[int]) -> float:
        llm = self.llm
        llm.reset()
        self.lc.llama_perf_context_reset(self.ctx)
        self._eval(prompt)
        p = self._perf()
        if p.n_p_eval != len(prompt):
            raise CflowError(f"llama.cpp counted {p.n_p_eval} prompt tokens, expected {len(prompt)}")
        return p.n_p_eval / (p.t_p_eval_ms / 1e3)


def _resolve(model: str, gguf: str | None, quiet: bool):
    """(opened model for the Engine, GGUF path for llama.cpp or None)."""
    from cflow import hub
    from cflow.llm import load_model

    src = hub.resolve(model, quiet=quiet)
    if gguf is None and str(src).endswith(".gguf"):
        gguf = str(src)
    return load_model(model, quiet=quiet), gguf


def _decode_positions(depth: int, tokens: int) -> int:
    """Positions a decode run reaches: its prompt (the 16-token warm-up's, or the depth's) and tokens."""
    return max(16, depth) + tokens


def run(engine, *, name: str, threads: int, gguf: str | None = None, runs: int = 5, tokens: int = 128,
        prompt_len: int = 512, batch: int = 1, agreement: int = 0, exact=None, log=print, depth: int = 16,
        flash_attn: bool = True) -> dict:
    """Measure `engine` (and llama.cpp on `gguf` when given); returns the --json record.
    exact: with agreement, a callable that opens the same model on cflow's fp32 path, the
    reference both engines' greedy picks are also compared with (which of them flips the ties)."""
    from cflow.kernels import probe_read

    if engine.n_ctx < prompt_len + 1 or engine.n_ctx < _decode_positions(depth, tokens):
        raise CflowError(f"n_ctx={engine.n_ctx} is too small for a {prompt_len}-token prompt and "
                         f"{tokens} tokens after {depth}")
    vocab = engine.config.vocab_size
    short, long_ = _prompt(vocab, 16, 1), _prompt(vocab, prompt_len, 2)
    deep = _prompt(vocab, depth, 1)  # what decode runs start from (`short` itself at depth 16)
    ours = CflowRunner(engine)
    # llama.cpp's KV cache as cflow's int8 paths keep theirs (f16 unless --cache-type-k / -v)
    kv = tuple(engine.kv_types) if getattr(engine, "fast", False) else ("f16", "f16")
    theirs = (LlamaCppRunner(gguf, threads, max(1024, prompt_len + tokens + 32, depth + tokens + 32), cache_types=kv,
                             flash_attn=flash_attn)
              if gguf else None)
    # llama.cpp's steps of `batch` sequences run in a context of its own, opened for them (the one
    # above keeps llama.cpp's single-sequence setup)
    theirs_b = (LlamaCppRunner(gguf, threads, max(1024, batch * (_decode_positions(depth, tokens) + 8)), n_seq=batch,
                               cache_types=kv, flash_attn=flash_attn) if gguf and batch > 1 else None)
    # warm-up (page in the weights, spin up the threads)
    ours.decode(short, 8)
    ours.prefill(long_[:64])
    if theirs:
        theirs.decode(short, 8)
        theirs.prefill(long_[:64])
    dec, pre, ldec, lpre = [], [], [], []
    ours.steps.clear()
    if theirs:
        theirs.steps.clear()
    for r in range(runs):
        dec.append(ours.decode(deep, tokens))
        if theirs:
            ldec.append(theirs.decode(deep, tokens))
        pre.append(ours.prefill(long_))
        if theirs:
            lpre.append(theirs.prefill(long_))
        log(f"  run {r + 1}/{runs}: cflow decode {dec[-1]:.1f} tok/s, prefill {pre[-1]:.1f} tok/s"
            + (f" | llama.cpp decode {ldec[-1]:.1f} tok/s, prefill {lpre[-1]:.1f} tok/s" if theirs else ""))
    from cflow.kernels import best_isa

    # the bytes actually read (the counters: top-k experts, or all of them with --all-experts)
    read = ours.bytes_read(short, min(tokens, 32))
    per_token = sum(read.values()) if read else engine.bytes_per_token
    probe = statistics.median(probe_read(PROBE_MIB, threads, 5))
    probe_model = statistics.median(probe_read(max(16.0, per_token / 2**20), threads, 5))
    d, p = statistics.median(dec), statistics.median(pre)
    gbps = per_token * d / 1e9
    rnd = lambda xs: [round(x, 2) for x in xs]
    # GB/s to 4 significant digits: a tiny model on a slow host reads a few tenths of a GB/s,
    # where two decimals would lose percents
    sig = lambda x: float(f"{x:.4g}")
    rec = {"model": name, "threads": threads, "depth": depth, "decode_tok_s": round(d, 2), "prefill_tok_s": round(p, 2),
           "bytes_per_token": int(per_token), "gbps": sig(gbps), "probe_gbps": sig(probe),
           "pct_of_probe": round(100 * gbps / probe, 1), "probe_model_gbps": sig(probe_model),
           "pct_of_probe_model": round(100 * gbps / probe_model, 1), "isa": best_isa(),
           "activations": getattr(engine, "activations", "fp32"), "decode_runs": rnd(dec), "prefill_runs": rnd(pre),
           # a host that stalls the VM for a second now and then drags a whole run's average;
           # the median single step is what the engine does when it runs
           "decode_step_ms_median": round(1e3 * statistics.median(ours.steps), 3),
           "schedule": getattr(engine, "schedule", "sequential"), "all_experts": getattr(engine, "all_experts", False),
           "kv_cache": getattr(engine, "kv_dtype", "f32"), "vs": {}}
    # the keys and values a decode step reads at the runs' mean context (the figures above count
    # weights only): at a depth of thousands they rival the weights
    from cflow.engine import kv_bytes_read

    kv = kv_bytes_read(engine, len(deep) + tokens // 2)
    rec["kv_bytes_per_token"] = kv
    gbps_kv = (per_token + kv) * d / 1e9
    rec["gbps_with_kv"] = sig(gbps_kv)
    rec["pct_of_probe_with_kv"] = round(100 * gbps_kv / probe, 1)
    if read:
        rec["bytes_per_token_by_stream"] = {k: round(v) for k, v in read.items()}
        rec["critical_path_bytes"] = int(engine.critical_path_bytes)
    if batch > 1:  # steps of `batch` sequences, interleaved with single steps run by run
        # llama.cpp the same way, timed by the wall clock around each llama_decode, as its
        # counters charge a step of several tokens as prompt
        steps = {"one": [], "many": [], "lc_one": [], "lc_many": []}
        for _ in range(runs):
            steps["one"] += ours.batched_steps(deep, 1, tokens)
            steps["many"] += ours.batched_steps(deep, batch, tokens)
            if theirs_b:
                steps["lc_one"] += theirs_b.batched_steps(deep, 1, tokens)
                steps["lc_many"] += theirs_b.batched_steps(deep, batch, tokens)

        def batched(one, many):
            m1, mb = round(1e3 * statistics.median(one), 4), round(1e3 * statistics.median(many), 4)  # ms
            return {"sequences": batch, "step_ms_median": mb, "one_step_ms_median": m1,
                    "tok_s": round(1e3 * batch / mb, 2), "x_one": round(batch * m1 / mb, 3)}

        rec["batch"] = batched(steps["one"], steps["many"])
        if theirs_b:
            their_batch = batched(steps["lc_one"], steps["lc_many"])
            their_batch["ratio_step"] = round(their_batch["step_ms_median"] / rec["batch"]["step_ms_median"], 3)
    if theirs:
        ld, lp = statistics.median(ldec), statistics.median(lpre)
        rec["vs"]["llama.cpp"] = {"decode_tok_s": round(ld, 2), "prefill_tok_s": round(lp, 2),
                                  "ratio_decode": round(d / ld, 3), "ratio_prefill": round(p / lp, 3),
                                  "decode_runs": rnd(ldec), "prefill_runs": rnd(lpre),
                                  "ratio_decode_runs": rnd(a / b for a, b in zip(dec, ldec)),
                                  "ratio_prefill_runs": rnd(a / b for a, b in zip(pre, lpre)),
                                  "extra_bufts": theirs.extra_bufts, "flash_attn": theirs.flash_attn,
                                  "kv_cache": "/".join(dict.fromkeys(theirs.cache_types)),
                                  "decode_step_ms_median": round(1e3 * statistics.median(theirs.steps), 3),
                                  "ratio_decode_step": round(statistics.median(theirs.steps)
                                                             / statistics.median(ours.steps), 3)}
        if batch > 1:
            rec["vs"]["llama.cpp"]["batch"] = their_batch
        if agreement:  # teacher-forced greedy picks of the two engines on the same tokens
            seq = long_[:agreement]
            a, b = ours.teacher_argmax(seq), theirs.teacher_argmax(seq)
            rec["vs"]["llama.cpp"]["top1_agreement"] = round(sum(x == y for x, y in zip(a, b)) / len(seq), 4)
            rec["vs"]["llama.cpp"]["agreement_positions"] = len(seq)
            if exact is not None:
                ref = CflowRunner(exact()).teacher_argmax(seq)
                same = lambda x: round(sum(p == q for p, q in zip(x, ref)) / len(seq), 4)  # noqa: E731
                rec["top1_agreement_with_fp32"] = same(a)
                rec["vs"]["llama.cpp"]["top1_agreement_with_cflow_fp32"] = same(b)
    return rec


def report(rec: dict) -> str:
    span = lambda xs: f"{min(xs):.1f}..{max(xs):.1f}"
    lines = [f"model {rec['model']}, {rec['threads']} threads, {rec['isa']} kernels, {rec['activations']} activations, "
             f"decode after a {rec['depth']}-token prompt",
             f"  decode   {rec['decode_tok_s']:8.1f} tok/s  ({span(rec['decode_runs'])})  "
             f"{rec['bytes_per_token'] / 1e6:.1f} MB/token, {rec['gbps']:.1f} GB/s = {rec['pct_of_probe']:.0f}% of "
             f"the probe's {rec['probe_gbps']:.1f} GB/s ({PROBE_MIB} MiB), {rec['pct_of_probe_model']:.0f}% of "
             f"{rec['probe_model_gbps']:.1f} GB/s over the model's bytes per token",
             f"           median step {rec['decode_step_ms_median']:.2f} ms = {1e3 / rec['decode_step_ms_median']:.1f} tok/s"
             f", {rec['schedule']} schedule" + (", all experts read" if rec["all_experts"] else "")]
    if "bytes_per_token_by_stream" in rec:
        bs = rec["bytes_per_token_by_stream"]
        lines.append("           read per token: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in bs.items() if v)
                     + f"; critical path {rec['critical_path_bytes'] / 1e6:.2f} MB")
    lines.append(f"           keys and values ({rec['kv_cache']}): {rec['kv_bytes_per_token'] / 1e6:.2f} MB a token at "
                 f"this depth, with the weights {rec['gbps_with_kv']:.1f} GB/s = {rec['pct_of_probe_with_kv']:.0f}% "
                 "of the probe")
    lines.append(f"  prefill  {rec['prefill_tok_s']:8.1f} tok/s  ({span(rec['prefill_runs'])})")
    if "batch" in rec:
        b = rec["batch"]
        lines.append(f"  batched  {b['sequences']} sequences: median step {b['step_ms_median']:.2f} ms = "
                     f"{b['tok_s']:.1f} tok/s, x{b['x_one']:.2f} one sequence's ({b['one_step_ms_median']:.2f} ms a step)")
    for k, v in rec["vs"].items():
        lines.append(f"  {k}: decode {v['decode_tok_s']:.1f} tok/s ({span(v['decode_runs'])}), cflow x"
                     f"{v['ratio_decode']:.2f} (per run {span(v['ratio_decode_runs'])}); prefill "
                     f"{v['prefill_tok_s']:.1f} tok/s ({span(v['prefill_runs'])}), cflow x{v['ratio_prefill']:.2f} "
                     f"(per run {span(v['ratio_prefill_runs'])})"
                     + f"; flash attention {'on' if v['flash_attn'] else 'off'}, KV {v['kv_cache']}"
                     + ("" if v.get("extra_bufts", True) else "; extra buffer types (AMX) off"))
        lines.append(f"  {k}: median step {v['decode_step_ms_median']:.2f} ms, cflow x{v['ratio_decode_step']:.2f}")
        if "batch" in v:
            b = v["batch"]
            lines.append(f"  {k}: {b['sequences']} sequences: median step {b['step_ms_median']:.2f} ms = "
                         f"{b['tok_s']:.1f} tok/s, x{b['x_one']:.2f} one sequence's ({b['one_step_ms_median']:.2f} ms "
                         f"a step); cflow's step of {b['sequences']} x{b['ratio_step']:.2f}")
        if "top1_agreement" in v:
            lines.append(f"  {k}: greedy next token the same at {100 * v['top1_agreement']:.1f}% of "
                         f"{v['agreement_positions']} teacher-forced positions")
        if "top1_agreement_with_cflow_fp32" in v:
            lines.append(f"  against cflow's fp32 path on the same weights: "
                         f"cflow {100 * rec['top1_agreement_with_fp32']:.1f}%, "
                         f"{k} {100 * v['top1_agreement_with_cflow_fp32']:.1f}%")
    return "\n".join(lines)


def main(args) -> int:
    from cflow.commands.generate import activation_kwargs
    from cflow.engine import Engine

    if min(args.threads, args.runs, args.tokens, args.prompt, args.batch, args.depth) < 1:
        raise CflowError("--threads, --runs, --tokens, --prompt, --depth and --batch must be positive")
    check_flash_attn(args.cache_type_v, args.vs_flash_attn == "on")  # before any model loads
    src, gguf = _resolve(args.model, args.gguf, args.json)
    if not 0 <= args.agreement <= args.prompt:
        raise CflowError("--agreement must be between 0 and --prompt")
    if args.vs and not gguf:
        raise CflowError("--vs llama.cpp needs the model's GGUF: pass --gguf PATH")
    n_ctx = max(args.prompt + 1, _decode_positions(args.depth, args.tokens) + 8, 1024)
    kw = activation_kwargs(args)
    eng = Engine(src, threads=args.threads, n_ctx=n_ctx, **kw)
    exact = None
    if args.agreement and kw.get("fast", True):
        exact = lambda: Engine(src, threads=args.threads, n_ctx=n_ctx, fast=False)  # noqa: E731
    rec = run(eng, name=args.model, threads=args.threads, gguf=gguf if args.vs else None, runs=args.runs,
              tokens=args.tokens, prompt_len=args.prompt, batch=args.batch, agreement=args.agreement,
              exact=exact, log=(lambda *a: None) if args.json else print, depth=args.depth,
              flash_attn=args.vs_flash_attn == "on")
    print(json.dumps(rec) if args.json else report(rec))
    return 0
