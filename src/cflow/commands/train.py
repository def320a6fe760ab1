"""`cflow train`: train a pipeline-native preset on a text corpus (alone or under torchrun)."""

HELP = "train a pipeline-native model (AdamW, cosine, checkpoints, resume; DDP under torchrun)"


def add_arguments(p):
    p.add_argument("--arch", required=True, help="preset: arch1, arch2_4_combined, arch2_4_sync, arch3, arch4_async_experts, arch5; "
                   "or a llama-shaped baseline: llama, bitnet (BitNet b1.58's shape)")
    p.add_argument("--data", required=True, help="*.txt (<|endoftext|> separated), *.jsonl ({\"text\":...}), .xz/.gz, or hf:NAME")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", default="runs/train", help="run folder: ckpt.pt, metrics.jsonl, loss.png, final.json")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json to use, or to create if missing; 'gpt2' (default: OUT/tokenizer.json)")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size when a tokenizer is trained")
    g = p.add_argument_group("model geometry (default: the paper's)")
    for name in ("d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "n_expert", "top_k", "d_expert"):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    o = p.add_argument_group("optimisation")
    o.add_argument("--batch", type=int, default=16, help="global batch (sequences per step, split across processes)")
    o.add_argument("--seq-len", type=int, default=256)
    o.add_argument("--lr", type=float, default=3e-3)
    o.add_argument("--min-lr-frac", type=float, default=0.1, help="cosine decays to this fraction of --lr")
    o.add_argument("--warmup", type=int, default=50)
    o.add_argument("--weight-decay", type=float, default=0.1)
    o.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip")
    o.add_argument("--lb-coef", type=float, default=0.01, help="weight of the load-balancing loss")
    o.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast matmuls to bfloat16")
    o.add_argument("--ternary", action="store_true",
                   help="quantization-aware training as BitNet b1.58: absmean ternary weights and per-token int8 "
                        "activations, straight-through gradients (export writes the ternary weights)")
    o.add_argument("--seed", type=int, default=0)
    r = p.add_argument_group("run")
    r.add_argument("--threads", type=int, default=1, help="torch threads per process")
    r.add_argument("--log-every", type=int, default=10)
    r.add_argument("--eval-every", type=int, default=0, help="held-out loss every N steps (0: only at the end)")
    r.add_argument("--eval-batches", type=int, default=8, help="batches in the periodic held-out loss")
    r.add_argument("--final-eval-batches", type=int, default=0, help="batches of the final held-out evaluation (0: the whole split)")
    r.add_argument("--ckpt-every", type=int, default=100)
    r.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt if present")
    r.add_argument("--stop-after", type=int, default=0, help="stop (with a checkpoint) after this step, e.g. to test resume")
    r.add_argument("--fsdp", action="store_true", help="shard parameters with FSDP instead of replicating (DDP)")
    r.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args) -> int:
    import json
    import os
    import sys

    from cflow.train.trainer import train

    res = train(args)
    if res:
        print(json.dumps(res))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A rank of a torchrun job leaves here, its files closed and its gloo group destroyed:
        # the interpreter's own teardown could still meet gloo's or DDP's native threads
        # (std::terminate, "terminate called without an active exception", exit code -6, now
        # and then on 2 busy cores), so the rank skips it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
