"""`cflow eval`: held-out perplexity and top-1 accuracy of a training checkpoint."""

HELP = "test perplexity and top-1 accuracy of a training checkpoint on a corpus's held-out split"


def add_arguments(p):
    p.add_argument("checkpoint", help="ckpt.pt (or its run folder)")
    p.add_argument("--data", required=True, help="corpus; its held-out split is evaluated")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one saved in the checkpoint)")
    p.add_argument("--seq-len", type=int, default=0, help="window length (default: the training one)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--split", choices=("test", "train"), default="test")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    import json

    import torch

    from cflow.train import checkpoint, data, tokenizer
    from cflow.train.trainer import evaluate, make_model

    torch.set_num_threads(args.threads)
    ck = checkpoint.load(args.checkpoint)
    cfg = ck["config"]
    tok = tokenizer.load(args.tokenizer) if args.tokenizer else tokenizer.from_json(ck["tokenizer"])
    tokenizer.check_vocab(tok, cfg.vocab_size, f"checkpoint {args.checkpoint}")
    train_txt, test_txt = data.split(data.read_texts(args.data))
    stream = data.encode(tok, test_txt if args.split == "test" else train_txt)
    model = make_model(cfg, bool(ck["train_args"].get("ternary", False)))
    model.load_state_dict(ck["model"])
    seq = args.seq_len or ck["train_args"].get("seq_len", cfg.max_seq_len)
    ev = evaluate(model, stream, min(seq, cfg.max_seq_len), args.batch)
    rec = {"arch": getattr(cfg, "variant", cfg.arch), "step": ck["step"], "split": args.split, "ppl": ev["ppl"], "acc": ev["acc"],
           "loss": ev["loss"], "tokens": ev["tokens"]}
    if args.json:
        print(json.dumps(rec))
    else:
        print(f"{getattr(cfg, 'variant', cfg.arch)} step {ck['step']}: {args.split} perplexity {ev['ppl']:.3f}  top-1 accuracy "
              f"{100 * ev['acc']:.2f}%  ({ev['tokens']} tokens)")
    return 0
