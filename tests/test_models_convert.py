"""Conversion: GGUF blocks kept bit-identical, clear errors for what is not supported, no partial
files when a conversion fails part way."""

import json

import numpy as np
import pytest

from cflow import hub, models
from cflow.convert import Checkpoint, Tensor, load_source
from cflow.errors import CflowError, CflowFormatError, UnsupportedError


@pytest.fixture(scope="module")
def smol():
    return hub.pull("smollm2-135m", quiet=True)


@pytest.fixture(scope="module")
def smol_cflow(smol, tmp_path_factory):
    from cflow.convert import convert

    out = tmp_path_factory.mktemp("conv") / "smol.cflow"
    convert(smol, out, progress=False)
    return out


def test_keep_is_bit_identical_to_gguf(smol, smol_cflow):
    import gguf

    from cflow.convert.gguf import _unpermute
    from cflow.format import CflowFile

    r = {t.name: t for t in gguf.GGUFReader(smol).tensors}
    with CflowFile(smol_cflow, verify=True) as f:
        assert f.config.arch == "llama" and f.config.tie_embeddings and "output" not in f.tensors
        assert f.tensor("tok_embd").type.name == "q8_0"
        assert np.array_equal(f.row_blocks("tok_embd"), r["token_embd.weight"].data)
        assert np.array_equal(f.row_blocks("blk.3.ffn_down"), r["blk.3.ffn_down.weight"].data)
        qkv = f.tensor("blk.3.attn_qkv")
        assert [p.name for p in qkv.parts] == ["blk.3.attn_q", "blk.3.attn_k", "blk.3.attn_v"]
        rows = f.row_blocks("blk.3.attn_qkv")  # stacked: [q; k; v], q/k rows in HF (neox) order
        assert np.array_equal(rows[:576], _unpermute(np.asarray(r["blk.3.attn_q.weight"].data), 9))
        assert np.array_equal(rows[768:], r["blk.3.attn_v.weight"].data)
        assert f.tokenizer_json and "<|im_start|>" in f.chat_template
        assert f.special_tokens["eos_token_ids"] == [2]


def test_requantize_to_q8_0(tmp_path, smol_cflow):
    from cflow.convert import requantize
    from cflow.format import CflowFile

    with CflowFile(smol_cflow) as f:
        w = f.dequantize("blk.0.attn_output")
    ck = load_source(hub.pull("smollm2-135m", quiet=True))
    q8 = requantize(ck, "q8_0")
    assert q8.tensors["blk.0.attn_output"].type == "q8_0" and q8.tensors["blk.0.attn_norm"].type == "f32"
    assert np.abs(q8.dequantize("blk.0.attn_output") - w).max() < 0.05 * np.abs(w).max()
    with pytest.raises(UnsupportedError, match="supported: keep, q4_0"):
        requantize(ck, "q3_k")


def test_convert_writes_every_planes_type_in_planes():
    from cflow.convert.write import tensor_layout

    for name in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"):
        assert tensor_layout(name, 2) == {"interleave": 16, "pack": "planes"}, name
        assert tensor_layout(name, 2, "blocks") == tensor_layout(name, 1) == {"interleave": 1, "pack": "blocks"}
    for name in ("f16", "bf16", "f32"):
        assert tensor_layout(name, 2) == {"interleave": 1, "pack": "blocks"}, name


def test_a_cached_conversion_in_an_older_layout_is_made_again(tmp_path, smol, smol_cflow):
    # a conversion cached before its types had the planes pack is converted again on load
    from cflow.convert import convert
    from cflow.format import CflowFile
    from cflow.llm import _outdated, converted_path, load_model

    cached = converted_path(smol, tmp_path)
    cached.parent.mkdir(parents=True)
    convert(smol, cached, progress=False, pack="blocks")
    with CflowFile(cached) as old, CflowFile(smol_cflow) as new:
        assert _outdated(old) and not _outdated(new)
    load_model(str(smol), cache=tmp_path, quiet=True)
    with CflowFile(cached) as f:
        assert f.tensors["blk.0.attn_output"].pack == "planes"


def test_failed_write_leaves_no_file(tmp_path, smol):
    from cflow.convert.write import write_cflow

    ck = load_source(smol)
    bad = dict(ck.tensors)
    bad["zz.last"] = Tensor("q4_0", (4, 33), np.zeros((4, 18), np.uint8))  # 33 columns: not whole blocks
    out = tmp_path / "m.cflow"
    with pytest.raises(CflowError):
        write_cflow(Checkpoint(ck.config, bad, ck.tokenizer_json), out, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_truncated_gguf_is_a_format_error(tmp_path, smol):
    bad = tmp_path / "cut.gguf"
    with open(smol, "rb") as f:
        bad.write_bytes(f.read(3_000_000))
    with pytest.raises(CflowFormatError, match="truncated or malformed GGUF"):
        load_source(bad)


def test_unsupported_architecture_and_tensor_type(tmp_path):
    import gguf

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UnsupportedError, match="model_type 'bert'; supported: ") as e:
        load_source(tmp_path / "hf")
    assert all(f"{a.name}: {', '.join(a.hf_model_types)}" in str(e.value)
               for a in models.architectures().values() if a.hf_model_types)
    for arch, ttype in (("mamba", gguf.GGMLQuantizationType.F32), ("llama", gguf.GGMLQuantizationType.Q2_K)):
        p = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(str(p), arch)
        for k, v in (("block_count", 1), ("embedding_length", 256), ("feed_forward_length", 256),
                     ("attention.head_count", 2), ("context_length", 64)):
            w.add_uint32(f"{arch}.{k}", v)
        data = np.zeros((256, 84), np.uint8) if ttype == gguf.GGMLQuantizationType.Q2_K else np.zeros((256, 256), np.float32)
        w.add_tensor("blk.0.ffn_down.weight", data, raw_dtype=ttype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        err = "architecture 'mamba'; supported: .*llama: llama" if arch == "mamba" else "Q2_K.*supported: F32"
        with pytest.raises(UnsupportedError, match=err):
            load_source(p)


def test_gguf_sampling_keys_become_the_generation_defaults(smol_cflow):
    from cflow.convert.gguf import gguf_generation
    from cflow.format import CflowFile

    m = {"general.sampling.temp": np.float32(0.6).item(), "general.sampling.top_k": 20,
         "general.sampling.top_p": np.float32(0.95).item(), "general.sampling.penalty_repeat": 1.05,
         "general.sampling.min_p": 3.0}  # out of range: left out
    assert gguf_generation(m) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05}
    with CflowFile(smol_cflow) as f:
        assert f.generation == {}  # SmolLM2's GGUF carries none


def test_hub_references_parse(tmp_path):
    assert hub.parse_hf_ref("hf://Qwen/Qwen3-0.6B-GGUF/Qwen3-0.6B-Q8_0.gguf") == ("Qwen/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q8_0.gguf", None)
    assert hub.parse_hf_ref("hf://o/r@main") == ("o/r", None, "main")
    assert hub.parse_hf_ref("hf://o/r/sub/dir/f.gguf@v1") == ("o/r", "sub/dir/f.gguf", "v1")
    for bad in ("hf://", "hf://onlyowner", "hf://o//f", "hf://o/r/../x", "hf://o/r@", "http://o/r"):
        with pytest.raises(CflowError):
            hub.parse_hf_ref(bad)


def test_cache_dir_and_list(tmp_path, monkeypatch, smol):
    monkeypatch.setenv("CFLOW_CACHE", str(tmp_path / "c"))
    assert hub.cache_dir() == tmp_path / "c"
    assert hub.cache_dir(tmp_path / "x") == tmp_path / "x"
    assert hub.list_cached() == []
    monkeypatch.delenv("CFLOW_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.cache_dir() == tmp_path / "xdg" / "cflow"
    rows = hub.list_cached(smol.parent.parent.parent)
    assert any(r["name"] == "smollm2-135m" and r["bytes"] == smol.stat().st_size for r in rows)


def test_pull_twice_is_instant_and_prints_the_path_last(capsys, smol):
    import time

    from cflow.cli import main

    t = time.perf_counter()
    assert main(["pull", "smollm2-135m"]) == 0
    assert time.perf_counter() - t < 5
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(smol)
