"""`.vflow`: the stage-major layout of the `.cflow` container (docs/FORMAT.md, section 7).

A `.cflow` file holds a model layer by layer. A `.vflow` file holds the same tensors grouped by
the **pipeline stage** that consumes them: stage k is what the vertical pipeline streams once the
residual h[k] exists, across layers,

    stage k = attention of layer k  +  dense FFN of layer k + delta_d  +  experts of layer k

(stage 0 also holds the embedding and the dense FFNs of layers 0 .. delta_d, which all read h[0];
the last stage, n_layer, holds the output norm and head). Each stage is one section, `stage.{k}`,
in stage order, its tensors in the order attention, dense, experts, each expert 4096-aligned
behind the expert offset table as in `.cflow`. The header says `"layout": "stage-major"` and
lists the stages; the reader checks that each tensor sits in the stage the config's delta_d
gives it, so a `.vflow` whose stages disagree with its header's delays does not load.

`write_vflow(src, out)` lays an existing `.cflow` out stage-major by copying each tensor's tiled
bytes unchanged (no re-encoding: the engine computes the same logits from either file).
"""

from __future__ import annotations

import os
import re

from cflow.errors import CflowFormatError

LAYOUT = "stage-major"
_NAME = re.compile(r"blk\.(\d+)\.(?:exp\.\d+\.)?(.+)$")
_DENSE = ("ffn_norm", "ffn_gate_up", "ffn_gate", "ffn_up", "ffn_down", "ffn_post_norm")
_EXPERTS = ("exp_norm", "ffn_gate_inp", "exp_post_norm", "exp_gain")
STREAM_ORDER = ("embed", "attention", "dense", "experts", "head")


def placement(name: str, delta_d: int, n_layer: int) -> tuple[int, str, int]:
    """(stage, stream, layer) of a tensor: where the vertical pipeline consumes it. Layer
    tensors are named blk.{l}.*; experts' own tensors blk.{l}.exp.{e}.*."""
    if name == "tok_embd":
        return 0, "embed", -1
    if name in ("output_norm", "output"):
        return n_layer, "head", n_layer
    m = _NAME.match(name)
    if not m:
        raise CflowFormatError(f"tensor {name!r} has no place in a stage-major file (not a layer tensor)")
    layer, rest = int(m[1]), m[2]
    if ".exp." in name or rest in _EXPERTS or rest.startswith("shexp."):
        return layer, "experts", layer
    if rest in _DENSE:
        return max(0, layer - delta_d), "dense", layer
    return layer, "attention", layer


def stage_order(names, delta_d: int, n_layer: int) -> list[list[str]]:
    """The tensors per stage 0 .. n_layer, each stage in consumption order (stream, then layer,
    then the order given)."""
    stages: list[list[tuple]] = [[] for _ in range(n_layer + 1)]
    for i, n in enumerate(names):
        st, stream, layer = placement(n, delta_d, n_layer)
        stages[st].append((STREAM_ORDER.index(stream), layer, i, n))
    return [[n for *_, n in sorted(s)] for s in stages]


def check_stages(h: dict, tensors: dict) -> list[dict]:
    """The header's `stages` of a stage-major file against its tensors and its config's delays:
    [{"stage", "section", "tensors"}] in stage order, each tensor in the stage delta_d gives it and
    inside that stage's section. CflowFormatError naming the first disagreement."""
    stages = h.get("stages")
    cfg = h["config"]
    where = "header.stages"
    if h.get("layout") != LAYOUT or not isinstance(stages, list):
        raise CflowFormatError(f"{where}: a stage-major file has \"layout\": \"{LAYOUT}\" and a list of stages")
    n_layer, delta_d = cfg.get("n_layer"), cfg.get("delta_d", 0)
    if type(n_layer) is not int or type(delta_d) is not int or not 0 <= delta_d < max(1, n_layer):
        raise CflowFormatError(f"{where}: the config's n_layer / delta_d ({n_layer!r} / {delta_d!r}) are not a model's")
    if len(stages) != n_layer + 1:
        raise CflowFormatError(f"{where}: {len(stages)} stages, the config's {n_layer} layers need {n_layer + 1}")
    seen = set()
    for k, s in enumerate(stages):
        if not isinstance(s, dict) or s.get("stage") != k or not isinstance(s.get("section"), str) \
                or not isinstance(s.get("tensors"), list) or not all(isinstance(n, str) for n in s["tensors"]):
            raise CflowFormatError(f"{where}[{k}]: must be {{\"stage\": {k}, \"section\": str, \"tensors\": [str]}}")
        for n in s["tensors"]:
            t = tensors.get(n)
            if t is None:
                raise CflowFormatError(f"{where}[{k}]: no tensor {n!r}")
            if n in seen:
                raise CflowFormatError(f"{where}[{k}]: tensor {n!r} is in two stages")
            seen.add(n)
            want = placement(n, delta_d, n_layer)[0]
            if want != k:
                raise CflowFormatError(f"{where}[{k}]: tensor {n!r} belongs to stage {want} with delta_d={delta_d}: "
                                       "the stages disagree with the header's delays")
            if t.section != s["section"]:
                raise CflowFormatError(f"{where}[{k}]: tensor {n!r} lies in section {t.section!r}, not {s['section']!r}")
    if missing := set(tensors) - seen:
        raise CflowFormatError(f"{where}: tensor {sorted(missing)[0]!r} is in no stage")
    return stages


def copy_tensors(src, w, names: list[str], section: str, done=lambda n: None) -> None:
    """Copy tensors `names` of an open CflowFile `src` into writer `w`, in that order, their tiled
    bytes unchanged: an expert's tensors together, as one range of the expert table (at its first
    tensor's place). done(nbytes) after each tensor."""
    owner = {n: key for key, e in src.experts.items() for n in e.tensors}  # expert tensor -> (layer, expert)
    copied = set()
    for name in names:
        key = owner.get(name)
        if key is None:
            w.copy_tensor(src.tensor(name), src.tensor_bytes(name), section=section)
            done(src.tensor(name).nbytes)
            continue
        if key in copied:
            continue
        copied.add(key)
        with w.expert(*key, section=section):  # the expert's tensors, together
            for n in src.experts[key].tensors:
                w.copy_tensor(src.tensor(n), src.tensor_bytes(n), section=section)
                done(src.tensor(n).nbytes)


def write_vflow(src, out: str | os.PathLike, *, progress: bool = False) -> None:
    """Write the stage-major copy of an open CflowFile `src` (its tiled bytes unchanged) to `out`,
    atomically."""
    from tqdm import tqdm

    from cflow.format.writer import CflowWriter

    cfg = src.config
    delta_d = getattr(cfg, "delta_d", 0)
    order = stage_order(list(src.tensors), delta_d, cfg.n_layer)
    with CflowWriter(out, cfg, tokenizer_json=src.tokenizer_json, chat_template=src.chat_template,
                     special_tokens=src.special_tokens, metadata=src.metadata, generation=src.generation,
                     layout=LAYOUT) as w, \
            tqdm(total=src.size, desc=f"vflow {os.path.basename(os.fspath(out))}"[:40], unit="B", unit_scale=True,
                 disable=not progress, leave=False) as bar:
        for k, names in enumerate(order):
            section = f"stage.{k}"
            copy_tensors(src, w, names, section, bar.update)
            w.stage(k, section, names)
