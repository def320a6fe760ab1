"""`cflow chat [-m MODEL]`: an interactive multi-turn chat with the model's own template."""

HELP = "interactive multi-turn chat (/reset clears the history, /quit or Ctrl-D leaves)"


def add_arguments(p):
    from cflow.commands.generate import add_sampling_arguments

    p.add_argument("--system", default=None, help="a system message")
    add_sampling_arguments(p)
    p.set_defaults(max_tokens=512)


def main(args) -> int:
    import sys

    from cflow.commands.generate import load_llm, sampling_kwargs, speed_line, stream_to_stdout

    llm = load_llm(args)
    base = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(base)
    state = llm.engine.new_state()  # the conversation's KV cache, reused turn to turn
    print(f"chatting with {llm.name} (/reset, /quit)", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/quit", "/exit"):
            return 0
        if line.strip() == "/reset":
            messages, state = list(base), llm.engine.new_state()
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = llm.tokenizer.encode(llm.render_chat(messages))
        kw = sampling_kwargs(args)
        kw["max_tokens"] = min(kw["max_tokens"], llm.n_ctx - len(ids))
        if kw["max_tokens"] < 1:
            print("context full: /reset to start over", file=sys.stderr)
            messages.pop()
            continue
        try:
            reply, final = stream_to_stdout(llm.complete(ids, state=state, **kw))
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": reply})
        print(speed_line(llm, final), file=sys.stderr)
