"""`cflow generate [-m MODEL] "prompt"`: stream a continuation to stdout, speed to stderr."""

HELP = "generate text from a prompt (streams to stdout; speed summary on stderr)"


def add_sampling_arguments(p):
    from cflow.engine import DEFAULT_MAX_CTX
    from cflow.llm import ENGINES
    from cflow.sampling import LLAMA_CPP_DEFAULTS

    p.add_argument("-m", "--model", default="smollm2-135m", help="model name, .cflow/.gguf path, HF directory or hf://...")
    p.add_argument("-n", "--max-tokens", type=int, default=256)
    d = LLAMA_CPP_DEFAULTS
    s = p.add_argument_group(
        "sampling", f"default: the model's generation_config.json, else llama.cpp's: temperature {d['temperature']}, "
                    f"top-k {d['top_k']}, top-p {d['top_p']}, min-p {d['min_p']}")
    s.add_argument("--temperature", "--temp", type=float, default=None,
                   help=f"0: greedy (default: the model's, else {d['temperature']})")
    s.add_argument("--top-k", type=int, default=None, help=f"0: off (default: the model's, else {d['top_k']})")
    s.add_argument("--top-p", type=float, default=None, help=f"1: off (default: the model's, else {d['top_p']})")
    s.add_argument("--min-p", type=float, default=None, help=f"0: off (default: the model's, else {d['min_p']})")
    s.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"1: off (default: the model's, else {d['repetition_penalty']:g})")
    s.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="OpenAI's: a token's logit loses this times its count in the answer (default 0: off)")
    s.add_argument("--presence-penalty", type=float, default=0.0,
                   help="OpenAI's: a token's logit loses this once it is in the answer (default 0: off)")
    s.add_argument("--seed", type=int, default=None, help="repeat a sampled run (default: a new draw each run)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--json", action="store_true",
                   help="answer with one JSON object (JSON mode: each token keeps the answer JSON; it ends when "
                        "the object closes)")
    p.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="answer with JSON that this JSON schema accepts (a file, or the schema's JSON text; "
                        "structured outputs, as OpenAI's response_format json_schema)")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("-c", "--n-ctx", "--ctx-size", dest="n_ctx", type=int, default=None,
                   help=f"context length in tokens (default: the model's own, capped at {DEFAULT_MAX_CTX}; "
                        "a value you give is used as given, beyond the model's own too)")
    p.add_argument("--engine", choices=ENGINES, default=None,
                   help="engine: native (default), ref (the numpy interpreter of the same plan, fp32)")
    add_activation_arguments(p)


def add_activation_arguments(p):
    from cflow.engine import ACTIVATIONS, KV_CACHE_TYPES

    p.add_argument("--activations", choices=tuple(ACTIVATIONS), default="int8x2",
                   help="what the weights are multiplied with: int8x2, two-level int8 (about 14 bits; "
                        "the default), int8, one level as llama.cpp's q8 (the fastest), fp32 (the parity path)")
    p.add_argument("--exact", dest="activations", action="store_const", const="fp32", help="--activations fp32")
    p.add_argument("--schedule", choices=("sequential", "pipeline"), default="sequential",
                   help="sequential: every thread on every op (the default); pipeline: the attention, dense and "
                        "expert streams on their own threads, overlapping where the model's delays allow "
                        "(the same output)")
    p.add_argument("--all-experts", action="store_true",
                   help="multiply every expert of a mixture-of-experts layer, keep the chosen ones (the same "
                        "output, every expert byte read: the A/B of conditional expert loading)")
    p.add_argument("--ram-budget", metavar="SIZE", default=None,
                   help="RAM the weights may use (8G, 512M, ...): a mixture-of-experts model larger than that keeps "
                        "its experts on disk and a cache of them in the rest (the same output)")
    p.add_argument("--expert-policy", choices=("mmap", "sync", "staged"), default=None,
                   help="where experts come from: mmap (the page cache decides; the default within the budget), "
                        "sync (read with O_DIRECT when a layer needs them), staged (read as soon as the router "
                        "chooses, the next layer's predicted experts read ahead; the default beyond the budget)")
    p.add_argument("--io-threads", type=int, default=4, metavar="N",
                   help="expert reads in flight with --expert-policy staged (default 4)")
    p.add_argument("--io", choices=("pread", "uring"), default="pread",
                   help="how staged reads reach the disk: pread threads (the default) or one io_uring")
    for short, which in (("-ctk", "k"), ("-ctv", "v")):
        p.add_argument(f"--cache-type-{which}", short, choices=KV_CACHE_TYPES, default=None,
                       help=f"how the KV cache stores {'keys' if which == 'k' else 'values'}: f16 (the default; "
                            "f32 with --exact), q8_0 (llama.cpp's blocks of 32 int8 and a scale: 17/32 of the memory "
                            "and of the bytes attention reads), f32")


def activation_kwargs(args) -> dict:
    """fast=, precise=, schedule=, all_experts=, the KV cache's types and the expert tier's options of
    LLM / Engine for --activations, --schedule, --all-experts, --cache-type-k / -v, --ram-budget,
    --expert-policy and --io-threads."""
    from cflow.engine import ACTIVATIONS

    kw = dict(ACTIVATIONS[args.activations], schedule=args.schedule, all_experts=args.all_experts)
    for name in ("cache_type_k", "cache_type_v"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.ram_budget is not None or args.expert_policy is not None:
        kw.update(ram_budget=args.ram_budget, expert_policy=args.expert_policy, io_threads=args.io_threads,
                  io_backend=args.io)
    return kw


def add_arguments(p):
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_arguments(p)


def sampling_kwargs(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                presence_penalty=args.presence_penalty, seed=args.seed, stop=args.stop,
                ignore_eos=args.ignore_eos, json_object=args.json, json_schema=schema_arg(args.json_schema))


def schema_arg(value: str | None) -> str | None:
    """--json-schema: the schema's JSON text, given inline (it starts with '{') or as a file."""
    from pathlib import Path

    from cflow.errors import CflowError

    if value is None or value.lstrip().startswith("{"):
        return value
    try:
        return Path(value).read_text()
    except OSError as e:
        raise CflowError(f"--json-schema: cannot read {value}: {e.strerror}") from None


def load_llm(args):
    from cflow.llm import LLM

    return LLM(args.model, threads=args.threads, n_ctx=args.n_ctx, engine=args.engine, **activation_kwargs(args))


def speed_line(llm, final) -> str:
    t, u = final.timings, final.usage
    gbs = llm.engine.bytes_per_token * t.decode_tok_s / 1e9
    return (f"prompt {u.prompt_tokens} tok, {t.prompt_tok_s:.1f} tok/s | decode {u.completion_tokens} tok, "
            f"{t.decode_tok_s:.1f} tok/s, {gbs:.2f} GB/s | finish: {final.finish_reason}")


def stream_to_stdout(gen):
    """Print chunks as they come; return (text, final chunk). Ctrl-C closes the generator."""
    import sys

    final, text = None, []
    try:
        for c in gen:
            if c.text:
                sys.stdout.write(c.text)
                sys.stdout.flush()
                text.append(c.text)
            final = c
    finally:
        gen.close()
    return "".join(text), final


def main(args) -> int:
    import sys

    llm = load_llm(args)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.encode(llm.render_chat([{"role": "user", "content": prompt}]))
    _, final = stream_to_stdout(llm.complete(prompt, **sampling_kwargs(args)))
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(speed_line(llm, final), file=sys.stderr)
    return 0
