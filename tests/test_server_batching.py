"""Continuous batching in `cflow serve` over real HTTP (the tiny real model of conftest): batched
greedy requests give exactly the tokens they give alone, a request can join running streams, a
chat's next turn starts from the KV of the turn before, and KV caches that cannot fit fail at
start-up. Streams that must still be running when a test looks are FOREVER streams of the
long-context model (server_util): they end only when the test closes them."""

from __future__ import annotations

import json
import os
import re
import threading

import httpx
import numpy as np
import pytest
from cflow.generate import recompute_for
from server_util import FOREVER, TIMEOUT, health, long_llm, serving, wait_for

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "In the beginning God created",
    "1, 2, 3, 4,",
    "Dear Sir or Madam, I am writing",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Q: What is a CPU cache?\nA:",
]


def complete(url, prompt, max_tokens, **kw):
    r = httpx.post(url + "/v1/completions", timeout=5 * TIMEOUT,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def at_once(fn, args_list):
    """fn(*args) for every args in args_list, each on its own thread, all started together."""
    out = [None] * len(args_list)

    def run(i, args):
        out[i] = fn(*args)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return out


@pytest.fixture(scope="module")
def url8(tiny_llm):
    with serving(tiny_llm, parallel=8) as u:
        yield u


@pytest.fixture(scope="module")
def long8(tiny_cflow):
    with serving(long_llm(tiny_cflow), parallel=8) as u:
        yield u


def test_eight_prompts_at_once_give_their_alone_tokens(url8, long8):
    alone = [complete(url8, p, 48)["choices"][0]["text"] for p in PROMPTS]
    together = at_once(lambda p: complete(url8, p, 48), [(p,) for p in PROMPTS])
    assert [r["choices"][0]["text"] for r in together] == alone
    assert all(r["usage"]["completion_tokens"] == 48 for r in together)
    # eight sequences do decode side by side: eight endless streams are active at once
    streams = [Stream(long8, p, FOREVER) for p in PROMPTS]
    wait_for(lambda: health(long8)["active"] == 8, what="eight streams to be active together")
    for s in streams:
        s.close()
    wait_for(lambda: health(long8)["active"] == 0, what="the streams to be cancelled")


def test_logprobs_batched_are_the_ones_alone_and_so_are_an_echoed_prompts(url8):
    # the logits of a batched row are bit for bit its alone logits, and so are their logprobs
    def lp(p):
        return complete(url8, p, 16, logprobs=3)["choices"][0]["logprobs"]

    alone = [lp(p) for p in PROMPTS]
    assert at_once(lp, [(p,) for p in PROMPTS]) == alone
    assert all(len(a["tokens"]) == 16 for a in alone)
    # a prompt scored (its every row's logits, a forward of its own) beside the others
    def echo(p):
        return complete(url8, p, 16, logprobs=3, echo=True)["choices"][0]["logprobs"]

    scored = [echo(p) for p in PROMPTS]
    assert at_once(echo, [(p,) for p in PROMPTS]) == scored
    assert [s["token_logprobs"][-16:] for s in scored] == [a["token_logprobs"] for a in alone]


def batcher_counters(url):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("cflow_batcher_")}


def test_the_batchers_counters_add_up_to_what_the_requests_carried(url8):
    # /metrics counts the rows the steps carried: every token a request computed of its prompt,
    # and a decode row per generated token after the first (which the prompt's last row gives)
    before = batcher_counters(url8)
    done = at_once(lambda p: complete(url8, p, 12), [(p,) for p in PROMPTS])
    after = batcher_counters(url8)
    d = {k: after[k] - before[k] for k in after}
    usage = [r["usage"] for r in done]
    computed = sum(u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    assert d["cflow_batcher_prompt_rows"] == computed > 0
    assert d["cflow_batcher_decode_rows"] == sum(u["completion_tokens"] - 1 for u in usage) > 0
    assert 12 <= d["cflow_batcher_steps"] < computed + sum(u["completion_tokens"] for u in usage)
    assert 0 < d["cflow_batcher_forward_seconds"] < d["cflow_batcher_step_seconds"]


class Stream:
    """A streamed completion read on its own thread: its text so far and whether it has ended."""

    def __init__(self, url, prompt, max_tokens):
        self.text, self.pieces, self.done, self.closing = "", 0, False, False
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(url, body))
        self.thread.start()

    def _read(self, url, body):
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=5 * TIMEOUT) as r:
            for line in r.iter_lines():
                if self.closing:
                    break  # hang up mid-stream
                if line.startswith("data: {"):
                    self.text += json.loads(line[6:])["choices"][0]["text"]
                    self.pieces += 1
        self.done = True

    def close(self):
        self.closing = True
        self.thread.join(5 * TIMEOUT)


def test_a_request_joining_running_streams_gets_its_alone_tokens(long8):
    # the streams never end by themselves, the joiner runs for about 45 steps: it runs beside them,
    # from the streams' 20th token on (they are compared with their alone text over 600 tokens)
    long_prompts, joiner = PROMPTS[:3], "A long question, prefilled in several pieces: " + "la " * 150
    # (an answer cut at 600 tokens may end in half a character, U+FFFD, that the stream completes)
    alone = [complete(long8, p, 600)["choices"][0]["text"].rstrip("\ufffd") for p in long_prompts]
    streams = [Stream(long8, p, FOREVER) for p in long_prompts]
    wait_for(lambda: all(s.pieces >= 20 for s in streams), what="the streams to be under way")
    joined = complete(long8, joiner, 40)
    assert not any(s.done for s in streams)  # (they cannot have ended: they run until closed)
    # its prompt was in no slot: prefilled in three pieces or more, each in a step with the streams' tokens
    assert joined["timings"]["prompt_n"] == joined["usage"]["prompt_tokens"] > 128
    wait_for(lambda: all(len(s.text) > len(a) for s, a in zip(streams, alone)), what="the streams to pass 600 tokens")
    for s in streams:
        s.close()
    for s, a in zip(streams, alone):
        assert s.text.startswith(a)
    alone_joiner = complete(long8, joiner, 40)  # from its cached prompt, alone
    assert joined["choices"][0]["text"] == alone_joiner["choices"][0]["text"]


def chat(url, messages, **kw):
    r = httpx.post(url + "/v1/chat/completions", timeout=5 * TIMEOUT,
                   json={"messages": messages, "max_tokens": 24, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_chats_second_turn_reuses_the_first_turns_kv(tiny_llm):
    with serving(tiny_llm, parallel=2) as u:
        turn1 = [{"role": "system", "content": "You are a terse assistant. " * 8},
                 {"role": "user", "content": "Name three rivers."}]
        first = chat(u, turn1)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert first["timings"]["prompt_n"] == first["usage"]["prompt_tokens"]
        chat(u, [{"role": "user", "content": "Something else entirely, in the other slot."}])
        turn2 = turn1 + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And three mountains?"}]
        second = chat(u, turn2)
        n1, u2 = first["usage"]["prompt_tokens"], second["usage"]
        cached = u2["prompt_tokens_details"]["cached_tokens"]
        assert cached >= n1  # the whole first prompt, and what of the answer tokenizes the same
        assert second["timings"]["prompt_n"] == u2["prompt_tokens"] - cached  # only the new tokens prefilled
        # streamed answers carry it in their usage chunk too
        body = {"messages": turn2, "max_tokens": 4, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", u + "/v1/chat/completions", json=body, timeout=5 * TIMEOUT) as r:
            usage = [json.loads(x[6:])["usage"] for x in r.iter_lines() if x.startswith("data: {") and '"usage"' in x]
        assert usage[-1]["prompt_tokens_details"]["cached_tokens"] >= cached


def test_a_shared_prefix_is_copied_and_the_other_histories_kept(tiny_llm):
    # b shares only the system prompt with a: it takes a fresh slot with that prefix copied from
    # a's, so a's whole conversation is still there when a's question comes again
    def ask(u, question):
        return chat(u, [{"role": "system", "content": "You are a terse assistant. " * 8},
                        {"role": "user", "content": question}])

    with serving(tiny_llm, parallel=4) as u:
        a = ask(u, "Name three rivers.")
        b = ask(u, "Name three mountains, please.")
        again = ask(u, "Name three rivers.")
    ub = b["usage"]
    cached = ub["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < ub["prompt_tokens"] - 2 and b["timings"]["prompt_n"] == ub["prompt_tokens"] - cached
    # all but the last token (the last two where prompt rows do not compute what decode rows do)
    recompute = recompute_for(tiny_llm.engine)
    assert recompute == (1 if tiny_llm.engine.prompt_rows_as_decode else 2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == a["usage"]["prompt_tokens"] - recompute
    assert again["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    with serving(tiny_llm, parallel=1) as u:  # the copied prefix gives the tokens of a fresh run
        assert ask(u, "Name three mountains, please.")["choices"][0]["message"] == b["choices"][0]["message"]


def test_a_conversation_that_left_every_slot_comes_back_from_the_prompt_cache(tiny_llm):
    # One slot: a's history leaves it when b comes, and waits in the prompt cache; a's question
    # asked again starts from all of it, with a's tokens. Without the cache only what a and b
    # share (the system prompt) is found, in b's history.
    def ask(u, question):
        return chat(u, [{"role": "system", "content": "You are a terse assistant. " * 8},
                        {"role": "user", "content": question}])

    recompute = recompute_for(tiny_llm.engine)
    for cache_ram in (0, None):  # off; the default
        with serving(tiny_llm, parallel=1, **({} if cache_ram is None else {"cache_ram": cache_ram})) as u:
            a = ask(u, "Name three rivers.")
            b = ask(u, "Name three mountains, please.")
            again = ask(u, "Name three rivers.")
            metrics = httpx.get(u + "/metrics", timeout=TIMEOUT).text
        shared = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert again["choices"][0]["message"] == a["choices"][0]["message"]
        assert again["timings"]["prompt_n"] == again["usage"]["prompt_tokens"] - cached
        if cache_ram is None:
            assert cached == a["usage"]["prompt_tokens"] - recompute
            # b's system prompt came from a's kept history too, and both histories are kept
            assert "cflow_prompt_cache_hits 2.0" in metrics and "cflow_prompt_cache_entries 2.0" in metrics
        else:
            assert 0 < cached == shared < a["usage"]["prompt_tokens"] - recompute
            assert "cflow_prompt_cache_hits 0.0" in metrics and "cflow_prompt_cache_entries 0.0" in metrics


def test_the_prompt_cache_keeps_its_budget_and_drops_what_a_newer_history_offers(tiny_llm):
    # PromptCache on the engine's real states: each parked state's KV pages count against the
    # budget; the least recently used go first (a hit makes one the most recent), their states
    # handed back emptied for the slot to go on with; a history holding another's whole prompt
    # replaces it; one larger than the budget is not kept.
    from cflow.engine import kv_bytes_held
    from cflow.server.batcher import PromptCache

    eng = tiny_llm.engine
    histories = {name: list(range(1 + 40 * i, 1 + 40 * i + 30)) for i, name in enumerate("abcd")}

    def state_of(tokens):
        st = eng.new_state()
        eng.forward([st], [tokens])
        return st

    one = kv_bytes_held(eng, 30)
    cache = PromptCache(eng, 3 * one)
    states = {n: state_of(t) for n, t in histories.items()}
    for n in "abc":
        fresh = cache.park(states[n], histories[n], prompt_len=20)
        assert fresh is not states[n] and fresh.pos == 0
    assert len(cache) == 3 and cache.bytes == 3 * one
    cache.hit(states["a"])  # a is now the most recent: b goes first
    back = cache.park(states["d"], histories["d"], prompt_len=20)
    assert back is states["b"] and back.pos == 0 and cache.evicted == 1
    assert set(cache.held()) == {states["a"], states["c"], states["d"]} and cache.bytes == 3 * one
    # c's prompt (its first 20 tokens) with another answer: it replaces c
    c2 = histories["c"][:20] + [7, 7, 7]
    back = cache.park(state_of(c2), c2, prompt_len=20)
    assert back is states["c"] and states["c"] not in cache.held() and len(cache) == 3
    assert [list(t) for t in cache.held().values()][-1] == c2
    # a kept history is whole: a's state goes on as a fresh run of a's tokens does
    assert np.array_equal(eng.forward([states["a"]], [[5]])[0], eng.forward([state_of(histories["a"])], [[5]])[0])
    n = 30
    while kv_bytes_held(eng, n) <= cache.max_bytes:
        n += 30
    big = [1 + i % 400 for i in range(n)]
    st = state_of(big)
    assert cache.park(st, big, prompt_len=n) is st and st not in cache.held() and len(cache) == 3
    with pytest.raises(Exception, match="budget"):
        PromptCache(eng, -1)


def test_kv_caches_that_do_not_fit_fail_at_start(tiny_cflow, capsys):
    from cflow.cli import main

    rc = main(["serve", "-m", str(tiny_cflow), "--parallel", "100000000", "--n-ctx", "4096", "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--parallel 100000000 sequences x n_ctx 4096" in err and "lower --n-ctx or --parallel" in err


def test_the_default_parallel_is_four_where_their_kv_caches_fit(tiny_llm):
    from cflow.engine import AUTO_PARALLEL, auto_parallel, kv_bytes_per_token

    eng = tiny_llm.engine
    one = eng.n_ctx * kv_bytes_per_token(eng)  # a full sequence's KV cache
    assert AUTO_PARALLEL == 4 and auto_parallel(eng, avail=1 << 50) == 4
    assert auto_parallel(eng, avail=2 * 2 * one + one) == 2  # half the memory holds two
    assert auto_parallel(eng, avail=0) == 1
    assert 1 <= auto_parallel(eng) <= 4  # this machine's


def test_a_negative_prompt_cache_is_refused_at_start(tiny_cflow, capsys):
    from cflow.cli import main

    assert main(["serve", "-m", str(tiny_cflow), "--cache-ram", "-1", "--port", "0"]) == 2
    assert "--cache-ram must be >= 0" in capsys.readouterr().err


def _cpu_lines(out: str, phases: int) -> list[tuple[float, ...]]:
    """bench load's cpu lines: (server, engine, event loop, other, load clients, wall seconds) each,
    the host's cores checked."""
    walls = [float(w) for w in re.findall(r"completion tokens in ([0-9.]+) s", out)]
    lines = re.findall(r"  cpu         server ([0-9.]+) cores \(engine ([0-9.]+), event loop ([0-9.]+), other "
                       r"([0-9.]+)\), load clients ([0-9.]+) \(of (\d+):", out)
    assert len(lines) == phases == len(walls), out
    assert all(int(x[5]) == len(os.sched_getaffinity(0)) for x in lines)
    return [(*map(float, x[:5]), w) for x, w in zip(lines, walls)]


def _tick_slack(wall: float, readings: int) -> float:
    """How far apart in cores two sides of a CPU figure may be over a run of `wall` seconds: the
    kernel gives each thread's (and the process's) CPU time in 10 ms ticks, cut short, so a
    difference of two readings is within a tick either way and a side summing k of them within k
    ticks; the report prints the wall to 0.1 s (so it is at least wall - 0.05) and each figure to
    two decimals. Over the 50 ms runs of a tiny model a few ticks are most of a core (a check
    that counted three ticks over the printed wall failed now and then on a fresh clone)."""
    return readings * 0.01 / max(wall - 0.05, 0.001) + 0.02


def test_bench_load_over_parallelism_with_clients_that_leave(tiny_cflow, tmp_path, capsys):
    from cflow.cli import main

    png = tmp_path / "load.png"
    rc = main(["bench", "load", "-m", str(tiny_cflow), "--parallel", "1,2", "--clients", "3", "--requests", "4",
               "--max-tokens", "8", "--stream", "--disconnect", "0.5", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("errors      0 server (5xx or dropped), 0 other") == 2
    assert "abandoned mid-stream by their client" in out and "first token p50" in out and "inter-token p50" in out
    assert out.count(" decode + ") == 2 and "ms forward + " in out and "engine busy " in out
    assert out.count("  prompt cache ") == 2 and " hits; " in out
    # the CPU of the server (a process of its own) and of the clients (this one) over each run:
    # together no more than the host's cores, the server's threads by name adding up to its total,
    # within what the kernel's ticks allow over runs this short (the soak test below reads a longer
    # run's parts): the engine's threads (the batcher and the pool's workers, as many as the cores
    # by default), the event loop and the total are one reading each
    cores = len(os.sched_getaffinity(0))
    for server, engine, loop, other, clients, wall in _cpu_lines(out, phases=2):
        assert server + clients <= cores + _tick_slack(wall, 2), out
        assert abs(engine + loop + other - server) <= _tick_slack(wall, cores + 2), out  # the whole report
    table = out.split("parallel   tok/s")[1].splitlines()[1:3]
    assert [row.split()[0] for row in table] == ["1", "2"]
    assert png.stat().st_size > 0


def test_bench_load_reads_memory_during_a_soak(tiny_cflow, capsys):
    """--rss-every: the server's resident memory read during the run, its growth from the first
    reading under load to the end reported beside the before / after figure. A reading is sure:
    the clients of a --duration run go on until its end, and the event loop wakes the reader
    (due at 0.2 s) on its way there, however slow the host."""
    from cflow.cli import main

    rc = main(["bench", "load", "-m", str(tiny_cflow), "--clients", "2", "--duration", "2", "--rss-every", "0.2",
               "--max-tokens", "8", "--stream", "--disconnect", "0.5"])
    out = capsys.readouterr().out
    assert rc == 0, out
    line = next(x for x in out.splitlines() if x.startswith("  under load  "))
    first, end = (float(x) for x in re.findall(r"([0-9.]+) (?:MiB )?at the (?:first reading|end)", line))
    growth = float(re.search(r"\(([-+][0-9.]+)%;", line).group(1))
    # the line gives MiB to 0.05 and the growth to 0.005 points: the growth from the printed MiB may
    # differ from the printed growth by what those roundings allow (0.1 point at 100 MiB)
    allowed = 100 * 0.05 * (1 / first + (end + 0.05) / (first - 0.05) ** 2) + 0.005
    assert first > 0 and end > 0 and abs(growth - 100 * (end - first) / first) <= allowed
    assert int(re.search(r"; (\d+) readings every 0.2 s", line).group(1)) >= 1
    # two seconds of load: the engine's threads (batcher and pool, by their names) and the event
    # loop each took CPU, the clients too
    [(server, engine, loop, other, clients, wall)] = _cpu_lines(out, phases=1)
    assert engine > 0 and loop > 0 and clients > 0
    assert abs(engine + loop + other - server) <= _tick_slack(wall, len(os.sched_getaffinity(0)) + 2), out
    rc = main(["bench", "load", "-m", str(tiny_cflow), "--clients", "2", "--requests", "2", "--max-tokens", "4",
               "--rss-every", "0"])
    out = capsys.readouterr().out
    assert rc == 0 and "  server RSS  before " in out and "under load" not in out


@pytest.mark.parametrize("stream", [False, True])
def test_bench_load_conversations_carry_their_earlier_turns(tiny_cflow, stream, capsys):
    # --turns 3: a client's second and third requests carry the turns before them, questions and
    # answers (streamed answers gathered from their deltas), and find them in the KV caches
    import re

    from cflow.cli import main

    def prompts(turns):
        argv = ["bench", "load", "-m", str(tiny_cflow), "--clients", "2", "--requests", "3", "--max-tokens", "4",
                "--turns", str(turns)] + (["--stream"] if stream else [])
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "errors      0 server (5xx or dropped), 0 other" in out
        assert ("conversations of 3 turns" in out) == (turns == 3)
        return [int(x) for x in re.search(r"prompts +(\d+) tokens, (\d+) of them", out).groups()]

    (single, single_cached), (chats, chats_cached) = prompts(1), prompts(3)
    assert chats > single and chats_cached > single_cached


def test_bench_load_takes_its_prompts_from_a_file(tiny_cflow, tmp_path, capsys):
    # a line of a long conversation makes the prompts far longer than the built-in questions'
    import json
    import re

    from cflow.cli import main

    def prompt_tokens(extra):
        assert main(["bench", "load", "-m", str(tiny_cflow), "--clients", "2", "--requests", "2", "--max-tokens", "4",
                     "--stream", *extra]) == 0
        out = capsys.readouterr().out
        assert "errors      0 server (5xx or dropped), 0 other" in out and "inter-token p50" in out and " max " in out
        return int(re.search(r"prompts +(\d+) tokens", out).group(1))

    f = tmp_path / "prompts.jsonl"
    long = [{"role": "system", "content": "Read this. " + "The river runs by the mill. " * 40},
            {"role": "user", "content": "What runs by the mill?"}]
    f.write_text(json.dumps("Name a color.") + "\n\n" + json.dumps(long) + "\n")
    assert prompt_tokens(["--prompts", str(f)]) > 2 * 200 + prompt_tokens([])  # client 1 asks the long one twice


def test_bench_load_unstreamed_plots_request_latency(tiny_cflow, tmp_path, capsys):
    # no first-token or inter-token times without streams: the table says "-" and the plot
    # shows request latency (a log axis of nothing used to fail here); the requests carry a
    # frequency penalty, which the server answers without errors
    from cflow.cli import main

    png = tmp_path / "load.png"
    rc = main(["bench", "load", "-m", str(tiny_cflow), "--parallel", "1,2", "--clients", "2", "--requests", "2",
               "--max-tokens", "4", "--plot", str(png), "--frequency-penalty", "0.5"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("frequency_penalty 0.5") == 2 and out.count("errors      0 server (5xx or dropped), 0 other") == 2
    rows = out.split("parallel   tok/s")[1].splitlines()[1:3]
    assert [row.split()[0] for row in rows] == ["1", "2"] and all(" - " in row for row in rows)
    assert "first token p50 " not in out and "  latency     p50" in out and png.stat().st_size > 0


def test_admission_prefers_cached_prompts_but_passes_no_request_over_more_than_the_window(tiny_llm):
    # The batcher's admission on the real engine and states, driven step by step (its thread is
    # not started): one slot, whose last request asked A. Queued in order: B, then A again, then
    # eight more A. The A requests go first, since their prompts are in the slot's cache, until B
    # has been passed over REORDER_WINDOW times; then B goes, and the rest of the A follow.
    import asyncio

    from cflow.generate import Decoder
    from cflow.server.batcher import REORDER_WINDOW, Batcher, Job

    tok = tiny_llm.tokenizer
    a_ids, b_ids = tok.encode("Once upon a time there was a fox"), tok.encode("The capital of France is")

    async def run():
        b = Batcher(tiny_llm.engine, 1, max_queue=64, cache_bytes=0)  # the slot alone: no prompt cache
        slot = b.slots[0]
        tiny_llm.engine.forward([slot.state], [a_ids])  # what A's request left in its cache
        jobs = [Job(b, Decoder(tok, b_ids, max_tokens=1))]
        jobs += [Job(b, Decoder(tok, a_ids, max_tokens=1)) for _ in range(REORDER_WINDOW + 1)]
        for j in jobs:
            b.submit(j)
        order = []
        while b._waiting:
            with b._cv:
                b._admit()
            job = slot.job
            order.append((job, job.cached))
            job.decoder.begin(slot.state, job.cached)
            tiny_llm.engine.forward([slot.state], [job.decoder.prompt[job.decoder.cached:]])  # its prefill
            with b._cv:
                slot.job = None
        return jobs, order

    jobs, order = asyncio.run(run())
    assert [job for job, _ in order] == jobs[1:REORDER_WINDOW + 1] + [jobs[0], jobs[-1]]
    assert all(cached == len(a_ids) for _, cached in order[:REORDER_WINDOW])  # all of A's prompt there
    assert order[-1][1] < len(a_ids) // 2  # after B ran, the slot held B's prompt
    assert jobs[0].passed == REORDER_WINDOW


def test_a_prompt_in_a_running_sequence_is_copied_from_it(tiny_llm):
    # Two slots: the first runs A (its cache holds A's prompt and a generated token); A asked
    # again takes the other slot with all of A's prompt copied from the running one.
    import asyncio

    from cflow.generate import Decoder
    from cflow.server.batcher import Batcher, Job

    tok = tiny_llm.tokenizer
    a_ids = tok.encode("Once upon a time there was a fox")

    async def run():
        b = Batcher(tiny_llm.engine, 2, max_queue=4)
        first, again = Job(b, Decoder(tok, a_ids, max_tokens=8)), Job(b, Decoder(tok, a_ids, max_tokens=8))
        b.submit(first)
        with b._cv:
            b._admit()
        running = first.slot
        first.decoder.begin(running.state, first.cached)
        logits = tiny_llm.engine.forward([running.state], [a_ids])[0]
        tiny_llm.engine.forward([running.state], [[int(logits.argmax())]])
        b.submit(again)
        with b._cv:
            b._admit()
        return running, again

    running, again = asyncio.run(run())
    assert again.slot is not running and again.slot.job is again
    assert again.cached == len(a_ids) and again.slot.state.tokens == a_ids


def test_slots_say_what_each_slot_does(tiny_llm):
    # a job given a slot (and not yet stepped) is prefilling; once it ends the slot is idle and
    # keeps its history; over HTTP, /slots lists them with n_ctx and the queue, behind the API key
    import asyncio

    from cflow.generate import Decoder
    from cflow.server.batcher import END, Batcher, Job

    tok = tiny_llm.tokenizer
    ids = tok.encode("Once upon a time there was a fox")

    async def run():
        b = Batcher(tiny_llm.engine, 2, max_queue=4)
        job = Job(b, Decoder(tok, ids, max_tokens=6, ignore_eos=True, temperature=0))
        b.submit(job)
        with b._cv:
            b._admit()
        before = b.slot_states()
        b.start()
        try:
            while await job.next() is not END:
                pass
        finally:
            b.stop()
        return before, b.slot_states()

    before, after = asyncio.run(run())
    busy = [s for s in before if s["is_processing"]]
    assert len(busy) == 1 and busy[0] == {"id": busy[0]["id"], "is_processing": True, "state": "prefilling",
                                          "n_prompt_tokens": len(ids), "n_cached_tokens": 0, "n_decoded": 0,
                                          "n_remain": 6}
    assert sorted(s["n_past"] for s in after) == [0, len(ids) + 5]  # the last token is drawn, not yet computed
    assert all(s["state"] == "idle" for s in after)
    with serving(tiny_llm, parallel=2, api_key="k") as u:
        assert httpx.get(u + "/slots", timeout=TIMEOUT).status_code == 401
        got = httpx.get(u + "/slots", headers={"Authorization": "Bearer k"}, timeout=TIMEOUT).json()
    assert got["queued"] == 0 and [(s["id"], s["state"], s["n_ctx"]) for s in got["slots"]] == [
        (0, "idle", tiny_llm.n_ctx), (1, "idle", tiny_llm.n_ctx)]


def test_an_unstreamed_answer_is_handed_over_once(tiny_llm):
    # stream=False: the batcher holds a generation's chunks and hands out one at the end, with
    # all the text and tokens of the streamed chunks and the last one's end and usage
    import asyncio

    from cflow.generate import Decoder
    from cflow.server.batcher import END, Batcher, Job

    tok = tiny_llm.tokenizer
    ids = tok.encode("Once upon a time")

    async def run(stream):
        b = Batcher(tiny_llm.engine, 1, max_queue=1)
        b.start()
        try:
            job = Job(b, Decoder(tok, ids, max_tokens=12, ignore_eos=True, temperature=0), stream=stream)
            b.submit(job)
            items = []
            while (item := await job.next()) is not END:
                items.append(item)
            return items
        finally:
            await asyncio.to_thread(b.stop)

    streamed, whole = asyncio.run(run(True)), asyncio.run(run(False))
    assert len(streamed) == 12 and len(whole) == 1
    assert whole[0].text == "".join(c.text for c in streamed)
    assert whole[0].token_ids == [t for c in streamed for t in c.token_ids]
    assert (whole[0].finish_reason, whole[0].usage) == (streamed[-1].finish_reason, streamed[-1].usage)


def test_bench_load_rounds_alternate_and_report_each_ratio(tiny_cflow, tmp_path, capsys):
    # --rounds 2 runs 1,2 then 2,1 (a server each) and prints each round's ratio, its median and range
    from cflow.cli import main

    rc = main(["bench", "load", "-m", str(tiny_cflow), "--parallel", "1,2", "--rounds", "2", "--clients", "2",
               "--requests", "2", "--max-tokens", "4", "--plot", str(tmp_path / "r.png")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "round 1 of 2: --parallel 1,2" in out and "round 2 of 2: --parallel 2,1" in out
    assert out.count("errors      0 server (5xx or dropped), 0 other") == 4
    phases = [line.split("parallel ")[1].split(",")[0] for line in out.splitlines() if line.startswith("load: ")]
    assert phases == ["1", "2", "2", "1"]
    line = out.split("round by round (median, range):")[1].splitlines()[1]
    value, r1, r2, _, median, span = line.split()
    ratios = [float(r1), float(r2)]
    assert value == "2" and all(x > 0 for x in ratios)
    # the median of two rounds is their mean, printed from the unrounded ratios
    assert min(ratios) - 0.005 <= float(median.rstrip("x,")) <= max(ratios) + 0.005
    assert span == f"{min(ratios):.2f}-{max(ratios):.2f}"
    assert "(medians over the rounds)" in out and (tmp_path / "r.png").stat().st_size > 0


def test_bench_load_rounds_need_two_values(tiny_cflow, capsys):
    from cflow.cli import main

    assert main(["bench", "load", "-m", str(tiny_cflow), "--parallel", "8", "--rounds", "3"]) == 2
    assert "--rounds compares --parallel values" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--url", "https://127.0.0.1:8000"], "--url takes http://HOST:PORT"),
    (["--url", "127.0.0.1:8000"], "--url takes http://HOST:PORT"),
    (["--url", "http://127.0.0.1:8000", "--parallel", "1,8"], "leave out --url"),
    (["--disconnect", "0.5"], "add --stream"),
    (["--parallel", "0"], "must be >= 1"),
    (["--frequency-penalty", "2.5"], "--frequency-penalty must be in -2..2"),
    (["--turns", "0"], "--turns must be >= 1"),
    (["--rss-every", "-1"], "--rss-every must be >= 0"),
    (["--n", "17"], "--n must be in 1..16"),
    (["--logprobs", "21"], "--logprobs must be in 0..20"),
    (["--json", "1.5"], "--json is a share of the requests"),
    (["--prompts", "/nonexistent/p.jsonl"], "--prompts: cannot read"),
])
def test_bench_load_refuses_bad_arguments_before_any_request(argv, message, capsys):
    from cflow.cli import main

    assert main(["bench", "load", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ('"ok"\n{"role": "user"}\n', ":2: a string or a list"),
    ('"ok"\n[{"role": "user", "content": 3}]\n', ":2: a string or a list"),
    ('"ok"\n{bad\n', ":2: not JSON"),
    ("\n\n", "no prompts in it"),
])
def test_bench_load_refuses_a_bad_prompts_file(text, message, tmp_path, capsys):
    from cflow.cli import main

    f = tmp_path / "p.jsonl"
    f.write_text(text)
    assert main(["bench", "load", "--prompts", str(f)]) == 2
    assert message in capsys.readouterr().err
