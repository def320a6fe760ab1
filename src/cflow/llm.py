"""cflow.LLM: load a model by name or path and generate text (the Python API of API.md)."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from cflow.errors import CflowError
from cflow.generate import Chunk, bias_arrays, check_budget, generate_step
from cflow.sampling import check_logprobs, generation_defaults, make_sampler
from cflow.tokenizer import Tokenizer
from cflow.structured import grammar as json_grammar
from cflow.tools import AnswerStream, calling_for

# used when a model carries no chat template of its own
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def family_chat(arch: str, tok: Tokenizer) -> str | None:
    """The chat template of the model's architecture family (None: ChatML), for a file that
    carries none; the family's end-of-turn tokens join tok's end-of-sequence ids."""
    from cflow import models

    family = models.get(arch)
    for text in family.end_of_turn:
        i = tok.backend.token_to_id(text)
        if i is not None:
            tok.eos_token_ids.add(i)
    return family.chat_template


def _have_writer() -> bool:
    try:
        from cflow.format import CflowWriter  # noqa: F401
    except ImportError:
        return False
    return True


def converted_path(src: Path, cache=None) -> Path:
    """Where the conversion of a GGUF file / HF directory lives in the cache."""
    from cflow import hub

    src = src.resolve()
    for name, m in hub.KNOWN_MODELS.items():
        if src == (hub.model_dir(name, cache) / m.file).resolve():
            return hub.model_dir(name, cache) / "model.cflow"
    st = src.stat()
    key = hashlib.sha256(f"{src}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return hub.cache_dir(cache) / "converted" / f"{src.name}-{key}.cflow"


def _outdated(f) -> bool:
    """Whether an open cached conversion was written by an older cflow, to convert again: an
    older format version (version 3 reordered q6_k's planes), or a matrix in whole blocks whose
    type today's converter writes in a faster layout (the planes pack gained Q5_0, Q4_K and Q6_K
    after files that hold them were cached; ternary matrices gained whole-row tiles; experts
    gained checksums)."""
    from cflow.convert.write import tensor_layout
    from cflow.format.spec import VERSION

    if f.preamble.version < VERSION:
        return True
    if any(e.crc32c is None for e in f.experts.values()):  # experts gained checksums (the expert tier's)
        return True
    for t in f.tensors.values():
        lay = tensor_layout(t.type.name, len(t.shape), cols=t.shape[1] if len(t.shape) == 2 else None)
        if t.pack != lay["pack"] or tuple(lay.get("tile", t.tile)) != tuple(t.tile):
            return True
    return False


def _open_cached(path: Path):
    """The cached conversion at path, or None where an older cflow wrote it in a form this one
    refuses (q6_k planes before version 3), to convert again. Any other error is raised: a
    damaged cache file is reported, not silently replaced."""
    from cflow.errors import CflowFormatError
    from cflow.format import CflowFile
    from cflow.format.spec import PREAMBLE, VERSION

    try:
        return CflowFile(path)
    except CflowFormatError:
        with open(path, "rb") as fh:
            head = fh.read(PREAMBLE.size)
        if len(head) == PREAMBLE.size and 1 <= PREAMBLE.unpack(head)[1] < VERSION:
            return None
        raise


def load_model(model: str, *, cache=None, quiet: bool = False):
    """A model argument -> an open CflowFile (converting GGUF / HF sources into the cache once).

    Without the .cflow writer available, GGUF / HF sources are read in memory instead.
    """
    from cflow import hub
    from cflow.convert import load_source, source_kind
    from cflow.format import CflowFile

    path = hub.resolve(model, cache=cache, quiet=quiet)
    kind = source_kind(path)
    if kind == "cflow":
        return CflowFile(path)
    if not _have_writer():
        return load_source(path)
    out = converted_path(path, cache)
    if out.is_file():  # the cached conversion, opened once: checked, then returned
        f = _open_cached(out)
        if f is not None and not _outdated(f):
            return f
        if f is not None:
            f.close()
    from cflow.convert import convert

    out.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"converting {path} -> {out}", file=sys.stderr)
    convert(path, out, progress=not quiet)
    return CflowFile(out)


ENGINES = ("native", "ref")


def make_engine(src, *, threads=None, n_ctx=None, fast=True, engine: str | None = None, precise: bool = True,
                **native):
    """The engine for an opened model: "native" (the default; also CFLOW_ENGINE) or "ref", the numpy
    interpreter of the same plan. fast / precise: the native engine's activations
    (cflow.engine.ACTIVATIONS); the reference engine always runs fp32 activations. native: the
    native engine's other options (schedule, all_experts, ram_budget, expert_policy, io_threads,
    cache_type_k, cache_type_v: cflow.engine.Engine); the reference engine runs op by op from
    memory and takes only the cache types of them."""
    choice = engine or os.environ.get("CFLOW_ENGINE") or "native"
    if choice not in ENGINES:
        raise CflowError(f"engine must be one of {', '.join(ENGINES)}, got {choice!r}")
    if choice == "ref":
        from cflow.engine_ref import RefEngine

        return RefEngine(src, threads=threads, n_ctx=n_ctx, cache_type_k=native.get("cache_type_k"),
                         cache_type_v=native.get("cache_type_v"))
    from cflow.engine import Engine

    return Engine(src, threads=threads, n_ctx=n_ctx, fast=fast, precise=precise, **native)


class LLM:
    """A loaded model: tokenizer, chat template and engine; generation shares one generator.

    model: a name known to `cflow pull` (pulled on first use), a .cflow path, a .gguf path, an HF
    directory (converted into the cache on first use) or hf://owner/repo/file.
    native: the native engine's options (cflow.engine.Engine): schedule, all_experts, the KV cache's
    cache_type_k and cache_type_v ("f16", "q8_0", "f32"), and the expert tier's ram_budget (bytes or
    "8G"), expert_policy ("mmap", "sync", "staged"), io_threads.
    """

    def __init__(self, model: str = "smollm2-135m", *, threads=None, n_ctx=None, fast=True,
                 engine: str | None = None, cache=None, quiet: bool = False, precise: bool = True, **native):
        self.name = model
        self.file = load_model(model, cache=cache, quiet=quiet)
        self.config = self.file.config
        self.tokenizer = Tokenizer(self.file.tokenizer_json, self.file.special_tokens)
        self.chat_template = self.file.chat_template or family_chat(self.config.arch, self.tokenizer)
        # what complete / generate / stream / chat sample with when a setting is not passed:
        # the source's generation_config.json, else llama.cpp's ("model" / "llama.cpp")
        self.generation_defaults, self.generation_defaults_source = generation_defaults(
            getattr(self.file, "generation", None))
        self.engine = make_engine(self.file, threads=threads, n_ctx=n_ctx, fast=fast, engine=engine, precise=precise,
                                  **native)
        self.n_ctx = self.engine.n_ctx
        self._template = None

    # ------------------------------------------------------------------ prompts
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The model's own chat template (jinja2, sandboxed) applied to messages; `tools` (OpenAI's
        function tools) for a template that renders them (cflow.tools)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise CflowError("messages must be a list of {'role': ..., 'content': ...} dicts")
        if self._template is None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise CflowError(f"chat template: {msg}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            try:
                self._template = env.from_string(self.chat_template or CHATML_TEMPLATE)
            except TemplateError as e:
                raise CflowError(f"the model's chat template does not parse: {e}") from None
        tok = self.tokenizer
        bos = tok.token_text(tok.bos_token_id) if tok.bos_token_id is not None else ""
        eos = tok.token_text(min(tok.eos_token_ids)) if tok.eos_token_ids else ""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos or "", eos_token=eos or "", tools=tools)
        except CflowError:
            raise
        except Exception as e:  # noqa: BLE001 - the template is the model file's code: any failure is its
            # (the sandbox raises SecurityError for attribute tricks, OverflowError for huge ranges)
            raise CflowError(f"the model's chat template failed: {type(e).__name__}: {str(e)[:200]}") from None

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = [int(i) for i in prompt]
        if any(not 0 <= i < self.config.vocab_size for i in ids):
            raise CflowError(f"prompt token ids must be in 0..{self.config.vocab_size - 1}")
        return ids

    # ------------------------------------------------------------------ generation
    def complete(self, prompt: str | list[int], *, max_tokens: int = 256, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                 repetition_penalty: float | None = None, frequency_penalty: float = 0.0,
                 presence_penalty: float = 0.0, seed: int | None = None, stop: list[str] | None = None,
                 ignore_eos: bool = False, logprobs: int | None = None, prompt_logprobs: int | None = None,
                 logit_bias: dict[int, float] | None = None, json_object: bool = False, json_schema=None,
                 grammar: str | None = None, block_grammar=None, state=None) -> Iterator[Chunk]:
        """Generate from a prompt (text or token ids): one Chunk per token, the last with
        finish_reason, usage and timings. Raises CflowError now (before any chunk) when the prompt
        plus max_tokens does not fit the context. Close the generator to cancel.

        Sampling settings left at None take `generation_defaults`; temperature=0 is greedy. With a
        seed the draws repeat from call to call; without one they differ. frequency_penalty and
        presence_penalty are OpenAI's (-2..2 there; any finite value here): a token the answer
        holds c times loses frequency_penalty x c + presence_penalty from its logit.

        state: reuse an engine state across calls (prompt cache: the common prefix of the prompt
        and the tokens the state holds is kept, the rest recomputed).

        logprobs: None, or n in 0..20: each Chunk's `logprobs` holds its tokens' log-probabilities
        under the model (its raw logits' softmax, before penalties, temperature and filters) and
        the n most likely tokens of each step (cflow.sampling.TokenLogprob).
        prompt_logprobs: None, or n: the first Chunk's `prompt_logprobs` holds the prompt's tokens'
        (None for the first token); max_tokens may then be 0, to score a text without generating.
        The whole prompt is computed again then (a reused state holds no logits).
        logit_bias: {token id: value in -100..100} added to those logits before every draw.
        json_object: the answer is one JSON object (cflow.structured: each draw among the tokens
        that keep it one; the generation ends when it closes, or unfinished at max_tokens).
        json_schema: a JSON schema (a dict, or its JSON text) the answer follows, likewise;
        CflowError now for one that cannot be followed.
        grammar: a grammar of cflow.structured (`grammar()`, `lark_grammar()`) the answer follows,
        instead of json_object / json_schema.
        block_grammar: a cflow.structured.BlockGrammar: the answer is free but for the blocks its
        trigger token opens, each kept to its grammar (tool calls under "auto").
        """
        ids = self.encode_prompt(prompt)
        check_budget(len(ids), max_tokens, self.n_ctx, scoring=prompt_logprobs is not None)
        given = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                     repetition_penalty=repetition_penalty)
        sampling = {k: self.generation_defaults[k] if v is None else v for k, v in given.items()}
        sampling.update(seed=seed, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty)
        make_sampler(**sampling)  # bad settings fail here, not at the first token
        if logit_bias:
            bias_arrays(logit_bias)  # bad values fail here too
            if any(not 0 <= int(i) < self.config.vocab_size for i in logit_bias):
                raise CflowError(f"logit_bias: token ids must be in 0..{self.config.vocab_size - 1}")
            sampling["logit_bias"] = logit_bias
        if grammar is not None and (json_object or json_schema is not None):
            raise CflowError("give a grammar or json_object / json_schema, not both")
        g = grammar if grammar is not None else json_grammar(json_object, json_schema)
        if g is not None:
            sampling["grammar"] = g
        if block_grammar is not None:
            sampling["block_grammar"] = block_grammar
        for key, n in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if n is not None:
                check_logprobs(n)  # as must a bad n
                sampling[key] = n
        cached = 0
        if state is None:
            state = self.engine.new_state()
        else:
            held = state.tokens
            while cached < min(len(held), len(ids)) and held[cached] == ids[cached]:
                cached += 1
        return self._run(state, ids, max_tokens, stop, cached, ignore_eos, sampling)

    def _run(self, state, ids, max_tokens, stop, cached, ignore_eos, sampling) -> Iterator[Chunk]:
        yield from generate_step(self.engine, state, self.tokenizer, ids, max_tokens=max_tokens, stop=stop,
                                 cached=cached, ignore_eos=ignore_eos, **sampling)

    def stream(self, prompt, **sampling) -> Iterator[str]:
        """Text pieces only."""
        for c in self.complete(prompt, **sampling):
            if c.text:
                yield c.text

    def generate(self, prompt, **sampling) -> str:
        return "".join(self.stream(prompt, **sampling))

    def chat(self, messages: list[dict], *, stream: bool = False, tools: list[dict] | None = None,
             tool_choice=None, parallel_tool_calls: bool = True, **sampling):
        """Reply to a conversation with the model's chat template; a str, or an iterator of pieces.

        tools (OpenAI's function tools; `tool_choice` "none", "auto" (the default), "required" or
        {"type": "function", "function": {"name": ...}}; `parallel_tool_calls`, as the server takes
        them, docs/SERVER.md "Tool calls"): the reply is a message, {"role": "assistant", "content":
        str | None} with "tool_calls" when it calls some ([{"id", "type": "function", "function":
        {"name", "arguments": JSON text}}]), to append to `messages` as it is, each call's result
        after it as {"role": "tool", "tool_call_id": id, "content": ...}; streamed, an iterator of
        deltas as the server's: {"content": piece}, {"tool_calls": [...]} (a call's index, id,
        type and name, then pieces of its arguments; cflow.tools.AnswerStream)."""
        calling = calling_for(tools, tool_choice, parallel_tool_calls, self.chat_template)
        if calling is None:
            ids = self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False)
            pieces = self.stream(ids, **sampling)
            if tools is None:
                return pieces if stream else "".join(pieces)
            return ({"content": p} for p in pieces) if stream else {"role": "assistant", "content": "".join(pieces)}
        text = self.render_chat(calling.messages(messages), tools=calling.template_tools())
        chunks = self.complete(self.tokenizer.encode(text, add_special_tokens=False),
                               grammar=calling.grammar(self.tokenizer),
                               block_grammar=calling.block_grammar(self.tokenizer), **sampling)
        reader = AnswerStream(calling, calling.calls_constrained(self.tokenizer))
        deltas = _tool_deltas(reader, chunks)
        if stream:
            return deltas
        content = "".join(d.get("content", "") for d in deltas)
        message = {"role": "assistant", "content": content or None}
        if reader.calls:
            message["tool_calls"] = reader.calls
        return message

    def logits(self, token_ids: list[int]) -> np.ndarray:
        """(len, vocab) float32 logits of a teacher-forced sequence, on a fresh state."""
        ids = self.encode_prompt(list(token_ids))
        check_budget(len(ids), 0 + 1, self.n_ctx + 1)
        return self.engine.forward(self.engine.new_state(), ids, all_logits=True)


def _tool_deltas(reader: AnswerStream, chunks: Iterator[Chunk]) -> Iterator[dict]:
    """The deltas of an answer under tools (LLM.chat): its content and calls as
    cflow.tools.AnswerStream lets them go."""
    try:
        for c in chunks:
            piece, calls = reader.feed(c.text)
            if c.finish_reason is not None:
                rest, _, more, _ = reader.end(c.finish_reason)
                piece, calls = piece + rest, calls + more
            if piece:
                yield {"content": piece}
            if calls:
                yield {"tool_calls": calls}
    finally:
        chunks.close()  # a reader that stops early cancels the generation
