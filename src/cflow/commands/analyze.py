"""`cflow analyze`: weight bytes per token and critical-path bytes of a pipeline-native arch."""

HELP = "per-token weight bandwidth and critical path of a pipeline-native architecture (no torch)"

GEOMETRY = ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "n_expert", "top_k", "d_expert")


def add_arguments(p):
    p.add_argument("--arch", default=None, help="preset name (arch1, arch2_4_combined, ...) or 'all'")
    p.add_argument("--model", default=None, help="a pipeline-native .cflow/.vflow file: its config and block type "
                                                 "(instead of --arch and --quant)")
    for name in GEOMETRY:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="default: the paper's geometry")
    p.add_argument("--delta-d", type=int, default=None, help="override the preset's dense delay")
    p.add_argument("--delta-e", type=int, default=None, help="override the preset's expert delay")
    p.add_argument("--routing-anchor", choices=("pre_dense", "post_dense"), default=None)
    p.add_argument("--quant", default="q4", help="q4 (0.5 B/param, the paper's count), q4_0, q8_0, f16, f32")
    p.add_argument("--json", action="store_true", help="one JSON line per arch")


def main(args) -> int:
    import json

    from cflow.analysis.bandwidth import analyze, critical_paths, head_mb, layer_bytes, unique_mb, MIB
    from cflow.models.presets import PRESETS, preset

    from cflow.errors import CflowError

    if (args.arch is None) == (args.model is None):
        raise CflowError("give --arch PRESET (or all) or --model FILE")
    over = {k: getattr(args, k) for k in GEOMETRY + ("delta_d", "delta_e", "routing_anchor")}
    if args.model is not None:
        from cflow.analysis.bandwidth import file_quant
        from cflow.format import CflowFile
        from cflow.models.pipeline_native import PNTConfig

        with CflowFile(args.model) as f:
            cfg = f.config
            if not isinstance(cfg, PNTConfig):
                raise CflowError(f"{args.model} is a {cfg.arch} model: analyze reads pipeline-native models")
            args.quant = file_quant(f)
        configs = [(cfg.variant or "pnt", cfg)]
    else:
        configs = [(name, preset(name, **over)) for name in (list(PRESETS) if args.arch == "all" else [args.arch])]
    for name, cfg in configs:
        rec = analyze(cfg, args.quant)
        if args.json:
            print(json.dumps(rec))
            continue
        lb = layer_bytes(cfg, args.quant)
        cp = rec["critical_path_mb_per_token"]
        print(f"{name}: {PRESETS[name][0] if name in PRESETS else ''}  (delta_d={cfg.delta_d} delta_e={cfg.delta_e} "
              f"anchor={cfg.routing_anchor} combine={cfg.combine} layers={cfg.n_layer}x{cfg.n_iter})")
        print(f"  per layer at {args.quant}: attention {lb.attn / MIB:.3f}  dense {lb.dense / MIB:.3f}  "
              f"top-{cfg.top_k} experts {lb.experts / MIB:.3f} MiB (router {lb.router / MIB:.4f}, not counted)")
        print(f"  total {rec['total_mb_per_token']:.2f} MB/token (unique weights {unique_mb(cfg, args.quant):.2f}, "
              f"output head {head_mb(cfg, args.quant):.2f} not counted)")
        lp = critical_paths(cfg, lb)["longest_path"] / MIB
        print(f"  critical path: sequential {cp['sequential']:.2f}  vertical pipeline {cp['vertical_pipeline']:.2f} MB/token"
              f"  (one token's longest path, with fill and drain: {lp:.2f})")
        if args.quant == "q4":
            r0 = analyze(cfg, "q4_0")
            c0 = r0["critical_path_mb_per_token"]
            print(f"  at Q4_0 as stored (0.5625 B/param): total {r0['total_mb_per_token']:.2f}  "
                  f"sequential {c0['sequential']:.2f}  vertical pipeline {c0['vertical_pipeline']:.2f}")
    return 0
