"""`cflow serve`: the OpenAI-compatible API and the chat page over HTTP (docs/SERVER.md)."""

HELP = "serve a model over an OpenAI-compatible HTTP API, with a chat page at /"


def add_arguments(p):
    from cflow.commands.generate import add_activation_arguments
    from cflow.engine import AUTO_PARALLEL, CACHE_RAM_MIB, DEFAULT_MAX_CTX

    p.add_argument("-m", "--model", default=None,
                   help="model name known to `cflow pull`, .cflow / .gguf path or HF directory (default: the built-in default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    p.add_argument("-t", "--threads", type=int, default=None, help="engine threads (default: all cores)")
    add_activation_arguments(p)
    p.add_argument("-c", "--n-ctx", "--ctx-size", dest="n_ctx", type=int, default=None,
                   help=f"context length in tokens of each sequence (default: the model's own, capped at "
                        f"{DEFAULT_MAX_CTX}; a value you give is used as given, beyond the model's own too). Per "
                        "sequence: llama-server's -c is the total its slots share")
    p.add_argument("-np", "--parallel", "--max-concurrency", dest="parallel", type=int, default=None,
                   help="sequences decoded together, one engine step for all (continuous batching); later "
                        "requests queue, in arrival order but for those whose prompts are cached. Their KV "
                        "caches (parallel x n_ctx tokens) must fit in memory (default: auto, "
                        f"{AUTO_PARALLEL} as llama-server's slots, fewer where their KV caches would take more "
                        "than half the available memory; a lone request runs as fast either way)")
    p.add_argument("--max-queue", type=int, default=256, help="requests allowed to wait; more get 503 (default %(default)s)")
    p.add_argument("--cache-ram", type=int, default=CACHE_RAM_MIB, metavar="MIB",
                   help="MiB of memory for the prompt cache: the KV caches of histories that left the slots, "
                        "so that a conversation coming back starts from its earlier turns; 0 turns it off "
                        "(default %(default)s)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /metrics, /slots and the tokenizer endpoints (default: $CFLOW_API_KEY, else open)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def main(args) -> int:
    import os

    from cflow.errors import CflowError

    try:
        import uvicorn

        from cflow.server import create_app
    except ImportError as e:
        raise CflowError(f"the server needs the serve extra: pip install 'cflow[serve]' ({e})") from e
    from cflow.engine import auto_parallel
    from cflow.llm import LLM

    if args.parallel is not None and args.parallel < 1:
        raise CflowError("--parallel must be at least 1")
    if args.cache_ram < 0:
        raise CflowError("--cache-ram must be >= 0 (MiB; 0 turns the prompt cache off)")
    from cflow.commands.generate import activation_kwargs

    kw = dict(threads=args.threads, n_ctx=args.n_ctx, **activation_kwargs(args))
    llm = LLM(args.model, **kw) if args.model else LLM(**kw)
    api_key = args.api_key or os.environ.get("CFLOW_API_KEY") or None
    parallel = auto_parallel(llm.engine) if args.parallel is None else args.parallel
    app = create_app(llm, parallel=parallel, api_key=api_key, max_queue=args.max_queue, cache_ram=args.cache_ram)
    loop, http = http_stack()
    kv = llm.engine.kv_dtype
    print(f"cflow serve: {llm.name} (n_ctx {llm.n_ctx}{'' if kv in ('f16', 'f32') else f', KV cache {kv}'}) on "
          f"http://{args.host}:{args.port}/  "
          f"[{parallel} parallel sequence(s){' (auto)' if args.parallel is None else ''}, prompt cache "
          f"{f'{args.cache_ram} MiB' if args.cache_ram else 'off'}{', API key required' if api_key else ''}, "
          f"{loop} + {http}]", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                loop=loop, http=http)
    return 0


def http_stack() -> tuple[str, str]:
    """uvicorn's event loop and HTTP implementation: uvloop and httptools (C; the serve extra
    installs them where they build) when importable, else asyncio and h11. With them the event
    loop spends a quarter less CPU a streamed token and holds the GIL less while the batcher
    hands tokens out (docs/SERVER.md)."""
    from importlib.util import find_spec

    return ("uvloop" if find_spec("uvloop") else "asyncio"), ("httptools" if find_spec("httptools") else "h11")
