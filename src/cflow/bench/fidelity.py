"""`cflow bench fidelity`: how close cflow's logits (each activation setting) and llama.cpp's are to
Hugging Face transformers' on one GGUF and one text.

The text (a built-in English passage, or --text FILE) is tokenized once with the model's tokenizer,
with the BOS token first where the model adds one, and its first --tokens ids are fed unchanged to
every engine: transformers (the reference: the same GGUF dequantized to fp32, fp32 compute), cflow
in each setting of --settings, and llama.cpp (llama-cpp-python, the ids passed as tokens, so it adds
no BOS of its own). Every engine is teacher-forced over the same positions in one prompt pass
(--decode adds a pass that feeds the tokens one at a time, cflow's GEMV path and llama.cpp's
single-token graph), and each is compared with the reference at every position:

  top-1      how often its argmax is the reference's,
  rel. err   ||logits - ref||_2 / ||ref||_2 per position, mean and max over the positions,
  KL         KL(softmax(ref) || softmax(logits)) in nats, mean over the positions.

Needs torch and transformers (the reference) and, for the llama.cpp row, llama-cpp-python; without
it that row is skipped and the report says so.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os

import numpy as np

from cflow.errors import CflowError
from cflow.sampling import log_softmax

# Varied English prose (narrative, explanation, instructions, numbers), long enough that every
# tokenizer here gives 256 tokens without repeating it.
TEXT = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. For forty years "
    "Margaret had climbed its spiral stairs every evening to light the lamp, even after the ships stopped coming. "
    "The village below had grown quiet; the fishermen had moved to the city, and the school had closed. Still, she "
    "believed that somewhere out on the dark water a sailor might need the light.\n\n"
    "Lighthouses were once the most advanced machines on any coast. A first-order Fresnel lens, introduced in the "
    "1820s, bent the light of a single flame into a beam that could be seen more than twenty miles away. Each "
    "station had its own pattern of flashes, so that a captain who counted the seconds between them could tell "
    "exactly which headland he was passing. Keepers wound the clockwork that turned the lens every few hours, "
    "trimmed the wicks, and wrote the weather into a logbook twice a day.\n\n"
    "To make a simple loaf of bread, mix 500 grams of flour with 10 grams of salt and 7 grams of dried yeast. Add "
    "about 320 millilitres of warm water and stir until no dry flour remains. Knead the dough for ten minutes, "
    "until it feels smooth and springs back when pressed, then cover the bowl and leave it somewhere warm for an "
    "hour. Shape it, let it rise again, and bake it at 220 degrees for thirty-five minutes.\n\n"
    "Scientists still argue about why people enjoy stories that make them sad. One explanation is that fiction "
    "lets us rehearse difficult feelings in safety: we can grieve for a character and then close the book. "
    "Another is social. When a group shares a moving story, its members often report feeling closer to one "
    "another afterwards, and small studies have found that their willingness to cooperate rises for a while. "
    "Neither theory explains everything, but both suggest that sadness in art is not simply a cost we pay for "
    "the pleasure of a good plot.\n\n"
    "When the storm finally passed, the harbor was littered with broken oars and tangled nets. Margaret walked "
    "along the sea wall with her grandson, pointing out the places where the old boats used to moor."
)

SETTINGS = (
    "fp32",
    "int8x2",
    "int8",
)  # cflow's --activations values; int8x2 is the default
DEFAULT_SETTING = "int8x2"
KL_ROWS = 32  # positions per chunk of the float64 softmax


def add_arguments(p):
    p.add_argument(
        "-m",
        "--model",
        default="smollm2-135m",
        help="a GGUF: a name known to `cflow pull` or a .gguf path (default smollm2-135m)",
    )
    p.add_argument(
        "--gguf",
        help="the GGUF transformers and llama.cpp read, when -m is a .cflow file",
    )
    p.add_argument(
        "--tokens", type=int, default=256, help="teacher-forced positions (default 256)"
    )
    p.add_argument(
        "--text",
        metavar="FILE",
        help="UTF-8 text to use instead of the built-in passage",
    )
    p.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        metavar="LIST",
        help="cflow activation settings, comma-separated (default fp32,int8x2,int8); int8x2:ROLE+ROLE "
        "takes the second level on those roles only (qkv, attn_output, gate_up, down, head); a suffix "
        "@TYPE (int8x2@q8_0) a KV cache of that type for keys and values",
    )
    p.add_argument(
        "--decode",
        action="store_true",
        help="also feed the tokens one at a time (cflow's decode path, llama.cpp's single-token steps)",
    )
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    p.add_argument(
        "--threads", type=int, default=2, help="threads for every engine (default 2)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON line")


def parse_setting(s: str) -> dict:
    """An --activations value, or int8x2:ROLE+ROLE, -> Engine's fast= and precise=; a suffix @TYPE
    (int8x2@q8_0) keeps keys and values in a KV cache of that type (cache_type_k / cache_type_v)."""
    from cflow.engine import ACTIVATIONS, KV_CACHE_TYPES, ROLES

    if "@" in s:
        s, kv = s.split("@", 1)
        if kv not in KV_CACHE_TYPES:
            raise CflowError(f"unknown KV cache type in {s}@{kv}: {', '.join(KV_CACHE_TYPES)}")
        return {**parse_setting(s), "cache_type_k": kv, "cache_type_v": kv}
    if s in ACTIVATIONS:
        return dict(ACTIVATIONS[s])
    if s.startswith("int8x2:"):
        roles = tuple(r for r in s.split(":", 1)[1].split("+") if r)
        bad = [r for r in roles if r not in ROLES]
        if bad or not roles:
            raise CflowError(f"unknown role in {s!r}: roles are {', '.join(ROLES)}")
        return {"fast": True, "precise": roles}
    raise CflowError(
        f"unknown setting {s!r}: {', '.join(ACTIVATIONS)} or int8x2:ROLE+ROLE"
    )


def compare(logits: np.ndarray, ref: np.ndarray) -> dict:
    """top-1 agreement, relative L2 error per position (mean, max, argmax) and mean KL of one
    engine's (n, vocab) logits against the reference's, over their common vocabulary."""
    v = min(logits.shape[1], ref.shape[1])
    a, b = logits[:, :v].astype(np.float64), ref[:, :v].astype(np.float64)
    rel = np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)
    kl = []
    for i in range(0, len(a), KL_ROWS):
        la, lb = log_softmax(a[i : i + KL_ROWS]), log_softmax(b[i : i + KL_ROWS])
        kl.append((np.exp(lb) * (lb - la)).sum(1))
    top1 = a.argmax(1) == b.argmax(1)
    return {
        "top1": round(float(top1.mean()), 6),
        "top1_misses": [int(i) for i in np.flatnonzero(~top1)],
        "rel_err_mean": float(rel.mean()),
        "rel_err_max": float(rel.max()),
        "rel_err_argmax": int(rel.argmax()),
        "kl_mean": float(np.concatenate(kl).mean()),
    }


def token_ids(tokenizer, text: str, n: int) -> list[int]:
    """The first n ids of text, BOS first where the model adds one (cflow's tokenizer gives the
    token ids of transformers' GGUF tokenizer, tests/test_tokenizer_sentencepiece.py)."""
    ids = tokenizer.encode(text, add_special_tokens=True)
    if len(ids) < n:
        raise CflowError(
            f"the text is {len(ids)} tokens, fewer than --tokens {n}: pass a longer --text or fewer "
            f"--tokens"
        )
    return ids[:n]


def reference_logits(
    gguf: str, ids: list[int], threads: int | None = None
) -> tuple[np.ndarray, dict]:
    """transformers' fp32 logits (n, vocab) of ids, the GGUF dequantized; and what ran."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise CflowError(
            "the reference needs torch and transformers: pip install 'cflow[test]'"
        ) from e
    if threads:
        torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(os.path.abspath(gguf)),
        gguf_file=os.path.basename(gguf),
        torch_dtype=torch.float32,
    ).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids])).logits[0].float().numpy()
    info = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }
    del model
    return out, info


def cflow_logits(
    weights, ids: list[int], setting: str, threads: int, decode: bool = False
) -> tuple[np.ndarray, str]:
    """cflow's native engine over ids in one setting: teacher-forced in one prompt pass, or with
    decode one token a step; and the engine's name of the setting (with @TYPE for a KV cache other
    than its default). weights: an opened model or
    a model argument (a name, a .gguf or .cflow path: GGUF files run their cached conversion)."""
    from cflow.engine import Engine
    from cflow.llm import load_model

    if isinstance(weights, (str, os.PathLike)):
        weights = load_model(str(weights), quiet=True)
    eng = Engine(weights, threads=threads, n_ctx=len(ids) + 8, **parse_setting(setting))
    st = eng.new_state()
    if decode:
        out = np.stack([eng.forward(st, [t]) for t in ids])
    else:
        out = eng.forward(st, ids, all_logits=True)
    return out, eng.activations + ("" if eng.kv_dtype in ("f16", "f32") else f"@{eng.kv_dtype}")


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_logits(
    gguf: str, ids: list[int], threads: int, decode: bool = False, kv: str = "f16"
) -> tuple[np.ndarray, dict]:
    """llama.cpp's logits (n, vocab) of ids (passed as tokens: no BOS of its own), in one batch of
    the whole sequence or, with decode, one token a call, its KV cache of type kv; and what ran."""
    import llama_cpp

    from cflow.bench.decode import LlamaCppRunner

    r = LlamaCppRunner(gguf, threads, max(len(ids) + 8, 512), logits_all=True, cache_types=(kv, kv))
    r.llm.reset()
    if decode:
        for t in ids:
            r.llm.eval([t])
    else:
        r.llm.eval(list(ids))
    out = np.array(r.llm.scores[: len(ids)], dtype=np.float32)
    info = {"llama_cpp_python": llama_cpp.__version__, "extra_bufts": r.extra_bufts, "flash_attn": r.flash_attn}
    r.llm.close()
    return out, info


def quant_mix(gguf: str) -> dict[str, int]:
    """How many of the GGUF's matrices (tensors of two or more dims) each block type holds."""
    import gguf as gg

    from cflow.convert.gguf_file import read_gguf

    g = read_gguf(gguf)
    try:
        c = collections.Counter(
            gg.GGMLQuantizationType(t.type_code).name
            for t in g.tensors
            if len(t.dims) > 1
        )
    finally:
        g.buffer.close()
    return dict(c.most_common())


def _resolve(model: str, gguf: str | None) -> tuple[object, str, str]:
    """(the opened model cflow runs, the GGUF the others read, a name)."""
    from cflow import hub
    from cflow.llm import load_model

    src = str(hub.resolve(model, quiet=True))
    gguf = gguf or (src if src.endswith(".gguf") else None)
    if not gguf:
        raise CflowError(
            f"{model}: the comparison reads a GGUF (transformers and llama.cpp): pass --gguf PATH"
        )
    if not os.path.isfile(gguf):
        raise CflowError(f"no such file: {gguf}")
    return load_model(model, quiet=True), gguf, model


def run(
    model: str,
    *,
    gguf: str | None = None,
    tokens: int = 256,
    text: str | None = None,
    settings=SETTINGS,
    decode: bool = False,
    llama_cpp: bool = True,
    threads: int = 2,
    log=print,
) -> dict:
    """The measurement; returns the --json record (rows: one per engine/setting and pass)."""
    from cflow.tokenizer import Tokenizer

    if tokens < 1 or threads < 1:
        raise CflowError("--tokens and --threads must be positive")
    for s in settings:
        parse_setting(s)
    weights, gguf, name = _resolve(model, gguf)
    tok = Tokenizer(weights.tokenizer_json, weights.special_tokens)
    ids = token_ids(tok, TEXT if text is None else text, tokens)
    rec = {
        "model": name,
        "gguf": os.path.basename(gguf),
        "arch": weights.config.arch,
        "quant_mix": quant_mix(gguf),
        "positions": len(ids),
        "text": "built-in" if text is None else "file",
        "bos_first": tok.add_bos
        and tok.bos_token_id is not None
        and ids[0] == tok.bos_token_id,
        "token_ids_sha": _ids_digest(ids),
        "metric": "rel_err: ||a - ref||_2 / ||ref||_2 per position; "
        "mean and max over the positions; kl: KL(ref || a) in nats, mean over the positions",
        "rows": [],
        "notes": [],
    }
    log(f"{name}: {len(ids)} positions, reference transformers fp32 ...")
    ref, rec["reference"] = reference_logits(gguf, ids, threads)
    passes = ("prefill", "decode") if decode else ("prefill",)
    for s in settings:
        for p in passes:
            out, act = cflow_logits(weights, ids, s, threads, decode=p == "decode")
            row = {
                "engine": "cflow",
                "setting": act,
                "pass": p,
                "default": s == DEFAULT_SETTING,
                **compare(out, ref),
            }
            rec["rows"].append(row)
            log(f"  cflow {act} {p}: top-1 {100 * row['top1']:.1f}%")
    if not llama_cpp:
        rec["notes"].append("llama.cpp left out (--no-llama-cpp)")
    elif not llama_cpp_available():
        rec["notes"].append(
            "llama.cpp skipped: llama-cpp-python is not installed (pip install 'cflow[bench]')"
        )
    else:
        # llama.cpp's own default cache, and each other KV cache type a cflow setting asked for
        kvs = ["f16"] + sorted({s.split("@", 1)[1] for s in settings if "@" in s} - {"f16"})
        for kv in kvs:
            for p in passes:
                out, info = llama_cpp_logits(gguf, ids, threads, decode=p == "decode", kv=kv)
                rec["llama_cpp"] = info
                setting = "q8 activations" + ("" if kv == "f16" else f"@{kv}")
                row = {
                    "engine": "llama.cpp",
                    "setting": setting,
                    "pass": p,
                    "default": False,
                    **compare(out, ref),
                }
                rec["rows"].append(row)
                log(f"  llama.cpp {setting} {p}: top-1 {100 * row['top1']:.1f}%")
    return rec


def _ids_digest(ids: list[int]) -> str:
    import hashlib

    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()[:16]


def report(rec: dict) -> str:
    mix = ", ".join(f"{k} x{v}" for k, v in rec["quant_mix"].items())
    r = rec["reference"]
    labels = [
        f"{row['engine']} {row['setting']}"
        + (" (default)" if row["default"] else "")
        + f", {row['pass']}"
        for row in rec["rows"]
    ]
    # a role subset (int8x2:qkv+attn_output+...) makes a long label
    w = max([34, *map(len, labels)])
    lines = [
        f"{rec['model']} ({rec['gguf']}, {rec['arch']}; matrices {mix})",
        f"{rec['positions']} teacher-forced positions of the {rec['text']} text"
        + (", BOS first" if rec["bos_first"] else ", no BOS")
        + f"; reference transformers {r['transformers']} "
        f"fp32 ({r['attn_implementation']} attention), the same token ids for every engine",
        f"  {'engine / setting':{w}s} {'top-1':>7s} {'rel. err mean':>13s} {'max':>9s} {'KL mean':>9s}",
    ]
    for label, row in zip(labels, rec["rows"]):
        lines.append(
            f"  {label:{w}s} {100 * row['top1']:6.1f}% {row['rel_err_mean']:13.2e} {row['rel_err_max']:9.2e} "
            f"{row['kl_mean']:9.2e}"
        )
    lines.append(
        "  rel. err: ||logits - ref||_2 / ||ref||_2 per position, mean and max over the positions; "
        "KL(ref || logits) in nats"
    )
    lines += [f"  {n}" for n in rec["notes"]]
    return "\n".join(lines)


def main(args) -> int:
    text = None
    if args.text:
        try:
            with open(args.text, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise CflowError(f"--text {args.text}: {e}") from None
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if not settings:
        raise CflowError("--settings is empty")
    rec = run(
        args.model,
        gguf=args.gguf,
        tokens=args.tokens,
        text=text,
        settings=settings,
        decode=args.decode,
        llama_cpp=not args.no_llama_cpp,
        threads=args.threads,
        log=(lambda *a: None) if args.json else print,
    )
    print(json.dumps(rec) if args.json else report(rec))
    return 0
