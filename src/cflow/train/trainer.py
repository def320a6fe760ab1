"""Training loop for the pipeline-native models: AdamW, warmup + cosine, clipping, optional bf16
autocast, exact resume, JSON-lines metrics and a loss plot. Runs alone or under torchrun with
DistributedDataParallel (gloo on CPU), or FSDP behind --fsdp for models too large to replicate.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cflow.errors import CflowError
from cflow.models.pnt import PNT
from cflow.models.presets import preset
from cflow.train import checkpoint, data, tokenizer

GEOMETRY = ("d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "n_expert", "top_k", "d_expert")


def make_model(cfg, ternary: bool):
    """The torch model of a config: PNT for the pipeline-native family, else the llama-shaped Dense."""
    if cfg.arch == "pnt":
        return PNT(cfg, ternary=ternary)
    from cflow.models.dense import Dense

    return Dense(cfg, ternary=ternary)


def lr_at(step: int, lr: float, warmup: int, total: int, min_frac: float) -> float:
    """Linear warmup to lr over `warmup` steps, then cosine decay to min_frac * lr at `total`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model, stream: np.ndarray, seq_len: int, batch: int, max_batches: int | None = None,
             autocast=nullcontext) -> dict:
    """Mean next-token loss, perplexity and top-1 accuracy over consecutive non-overlapping
    windows of the held-out stream (all of it, or the first max_batches batches)."""
    n_win = (len(stream) - 1) // seq_len
    if n_win == 0:
        raise CflowError(f"held-out split has {len(stream)} tokens, fewer than seq_len+1={seq_len + 1}")
    starts = np.arange(n_win) * seq_len
    if max_batches is not None:
        starts = starts[: max_batches * batch]
    was = model.training
    model.eval()
    nll = correct = count = 0.0
    for i in range(0, len(starts), batch):
        x, y = data.windows(stream, starts[i:i + batch], seq_len)
        x, y = torch.from_numpy(x).long(), torch.from_numpy(y).long()
        with autocast():
            logits, _ = model(x)
        logits = logits.float()
        nll += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        count += y.numel()
    model.train(was)
    loss = nll / count
    return {"loss": loss, "ppl": math.exp(loss), "acc": correct / count, "tokens": int(count)}


def _dist():
    """(rank, world); initialises the gloo process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), world


def prepare_data(args, rank: int, world: int):
    """Tokenizer (loaded, or trained on the training split and saved) and token streams.

    The streams are cached beside the tokenizer (keyed by the data file's path, size and mtime
    and the tokenizer's content), so runs that share a tokenizer encode the corpus once."""
    tok_path = args.tokenizer or str(Path(args.out) / "tokenizer.json")
    cache = None
    if not args.data.startswith("hf:") and Path(args.data).is_file() and Path(tok_path).is_file():
        st = Path(args.data).stat()
        key = hashlib.sha1(f"{Path(args.data).resolve()}|{st.st_size}|{st.st_mtime_ns}|".encode()
                           + Path(tok_path).read_bytes()).hexdigest()[:16]
        cache = Path(f"{tok_path}.{key}.npz")
        if cache.is_file():
            z = np.load(cache)
            return tokenizer.load(tok_path), z["train"], z["test"]
    train_txt, test_txt = data.split(data.read_texts(args.data))
    if rank == 0:
        tok = tokenizer.load_or_train(tok_path, train_txt, args.vocab_size)
    if world > 1:
        torch.distributed.barrier()
    if rank != 0:
        tok = tokenizer.load(tok_path)
    train_ids, test_ids = data.encode(tok, train_txt), data.encode(tok, test_txt)
    if cache is not None and rank == 0:
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}.npz")
        np.savez(tmp, train=train_ids, test=test_ids)
        os.replace(tmp, cache)
    return tok, train_ids, test_ids


def plot_metrics(metrics_path: Path, png: Path, title: str = "") -> None:
    """Training and held-out loss against step, from a metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(metrics_path)]
    tr = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    va = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if tr:
        ax.plot(*zip(*tr), label="train", lw=1)
    if va:
        ax.plot(*zip(*va), "o-", label="held-out", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = png.with_name(png.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, png)


def train(args) -> dict:
    """Run (or resume) one training job; returns the final held-out metrics (rank 0)."""
    torch.set_num_threads(args.threads)
    rank, world = _dist()
    if args.batch % world:
        raise CflowError(f"--batch {args.batch} is not divisible by the {world} processes")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ck_path = out / "ckpt.pt"
    ck = checkpoint.load(ck_path) if args.resume and ck_path.exists() else None

    tok, train_ids, test_ids = prepare_data(args, rank, world)
    if ck is not None:
        cfg = ck["config"]
        tokenizer.check_vocab(tok, cfg.vocab_size, f"checkpoint {ck_path}")
    else:
        geo = {k: getattr(args, k) for k in GEOMETRY}
        cfg = preset(args.arch, vocab_size=tok.get_vocab_size(), max_seq_len=args.seq_len, **geo)

    ternary = bool(getattr(args, "ternary", False))
    if ck is not None and bool(ck["train_args"].get("ternary", False)) != ternary:
        raise CflowError(f"--ternary must match the checkpoint being resumed ({ck_path}: "
                         f"ternary={bool(ck['train_args'].get('ternary', False))})")
    torch.manual_seed(args.seed)
    model = make_model(cfg, ternary)
    step0 = 0
    if ck is not None:
        model.load_state_dict(ck["model"])
        step0 = ck["step"]
    net = model
    if world > 1:
        if args.fsdp:
            from torch.distributed.fsdp import fully_shard

            for lay in model.layers:
                fully_shard(lay)
            net = fully_shard(model)
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(model, find_unused_parameters=True)  # experts nobody picked get no gradient
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    if ck is not None:
        if world > 1 and args.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(model, opt, ck["optim"], options=StateDictOptions(full_state_dict=True))
        else:
            opt.load_state_dict(ck["optim"])
    use_bf16 = args.dtype == "bf16"
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if use_bf16 else nullcontext

    metrics = out / "metrics.jsonl"
    if rank == 0:  # keep the log consistent with the checkpoint we resume from
        keep = [line for line in open(metrics)] if (ck is not None and metrics.exists()) else []
        keep = [line for line in keep if json.loads(line).get("step", 0) <= step0]
        with open(metrics, "w") as f:
            f.writelines(keep)
            if ck is None:
                f.write(json.dumps({"config": cfg.to_dict(), "params": model.n_params(),
                                    "active_params": model.n_params(active=True),
                                    "train_tokens": len(train_ids), "test_tokens": len(test_ids),
                                    "world": world, "args": _jsonable(args)}) + "\n")
    log = open(metrics, "a") if rank == 0 else None

    bar = None
    if rank == 0 and not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=step0, desc=getattr(cfg, "variant", cfg.arch), mininterval=2.0, file=sys.stderr)
    tokens_per_step = args.batch * args.seq_len
    t_last, s_last = time.perf_counter(), step0
    end = min(args.steps, args.stop_after) if args.stop_after else args.steps
    for step in range(step0, end):
        lr = lr_at(step, args.lr, args.warmup, args.steps, args.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = data.batch_starts(len(train_ids), args.seq_len, args.batch, args.seed, step)[rank::world]
        x, y = data.windows(train_ids, starts, args.seq_len)
        x, y = torch.from_numpy(x).long(), torch.from_numpy(y).long()
        with autocast():
            logits, lb = net(x)
        ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss = ce + args.lb_coef * lb.float()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        done = step + 1
        if done % args.log_every == 0 or done == end:
            vals = torch.tensor([ce.item(), lb.item()])
            if world > 1:
                torch.distributed.all_reduce(vals)
                vals /= world
            now = time.perf_counter()
            tok_s = (done - s_last) * tokens_per_step / max(now - t_last, 1e-9)
            t_last, s_last = now, done
            rec = {"step": done, "loss": round(vals[0].item(), 6), "lb": round(vals[1].item(), 5),
                   "lr": lr, "gnorm": round(float(gnorm), 4), "tok_s": round(tok_s, 1)}
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            if bar:
                bar.set_postfix(loss=f"{rec['loss']:.3f}", ppl=f"{math.exp(rec['loss']):.1f}", tok_s=f"{tok_s:.0f}")
        if bar:
            bar.update(1)
        if args.eval_every and done % args.eval_every == 0 and done != args.steps and rank == 0:
            ev = evaluate(model, test_ids, args.seq_len, args.batch, args.eval_batches, autocast)
            log.write(json.dumps({"step": done, "val_loss": ev["loss"], "val_ppl": ev["ppl"], "val_acc": ev["acc"]}) + "\n")
            log.flush()
        if (args.ckpt_every and done % args.ckpt_every == 0) or done == end:
            _save(ck_path, model, opt, done, cfg, tok, args, rank, world)
    if bar:
        bar.close()
    result = {}
    if end == args.steps and rank == 0:
        ev = evaluate(model, test_ids, args.seq_len, args.batch, args.final_eval_batches or None, autocast)
        result = {"step": args.steps, "test_loss": ev["loss"], "test_ppl": ev["ppl"], "test_acc": ev["acc"],
                  "test_tokens": ev["tokens"], "params": model.n_params(), "active_params": model.n_params(active=True)}
        log.write(json.dumps({"step": args.steps, "val_loss": ev["loss"], "val_ppl": ev["ppl"], "val_acc": ev["acc"], "final": True}) + "\n")
        tmp = out / "final.json.tmp"
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, out / "final.json")
        log.close()
        plot_metrics(metrics, out / "loss.png", f"{getattr(cfg, 'variant', cfg.arch)} (seed {args.seed})")
    elif log:
        log.close()
    if world > 1:
        torch.distributed.barrier()
        # Tear the gloo group down before the interpreter does: left to exit, a rank's gloo
        # threads could still be joinable when destroyed (std::terminate, "terminate called
        # without an active exception", exit code -6; seen once in 2 processes on 2 busy cores).
        torch.distributed.destroy_process_group()
    return result


def _jsonable(args) -> dict:
    return {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))}


def _save(path, model, opt, step, cfg, tok, args, rank, world) -> None:
    if world > 1 and args.fsdp:  # gather full tensors on every rank (collective)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        ms, os_ = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        ms, os_ = model.state_dict(), opt.state_dict()
    if rank == 0:
        checkpoint.save(path, model_state=ms, optim_state=os_, step=step, cfg=cfg,
                        tokenizer_json=tok.to_str(), train_args=_jsonable(args))
