"""Hostile model files: the real SmolLM2 GGUF and its .cflow conversion with one field edited.

Every case ends in a one-line error and exit status 2 from the CLI (convert, verify, generate,
serve), never a traceback, a hang or a lost file. The edits keep each file's own checksums right
(the .cflow header CRC is fixed up), as a deliberate forger would.

Each module keeps one working copy per format and puts the edited bytes back after each test, so
no test copies the 100 MB files again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from cflow import hub
from cflow.cli import main
from cflow.format.spec import PREAMBLE, Preamble, crc32

SMOL = "smollm2-135m"
TOKENS, TOKEN_TYPES, MERGES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"


class StillRunning(BaseException):
    """A command ran past its deadline (a BaseException: no `except Exception` swallows it)."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail, instead of hanging, when the block runs longer than `seconds`."""
    def expire(*_):
        raise StillRunning(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_cli(capsys, *argv, seconds: float = 60) -> tuple[int, str]:
    """(exit status, stderr) of `cflow ARGV` run in this process."""
    capsys.readouterr()
    with deadline(seconds):
        rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def expect_error(capsys, match: str, *argv, seconds: float = 60) -> str:
    """`cflow ARGV` fails with exit status 2 and one line naming the problem (`match`, a regex)."""
    rc, err = run_cli(capsys, *argv, seconds=seconds)
    *before, last = err.strip().splitlines()
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and all(line.startswith("converting ") for line in before), err  # progress only
    assert last.startswith(f"cflow {argv[0]}: error: "), err
    assert re.search(match, last), (match, err)
    return last


def digest(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Conversions of a GGUF by `generate` / `serve` go to a cache of the test's own."""
    monkeypatch.setenv("CFLOW_CACHE", str(tmp_path / "cache"))


# ---------------------------------------------------------------------------- GGUF


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """A working copy of the real SmolLM2 GGUF, and where its fields are."""
    src = hub.pull(SMOL, quiet=True)
    path = tmp_path_factory.mktemp("hostile-gguf") / "smol.gguf"
    shutil.copyfile(src, path)
    return GGUFFields(path)


class GGUFFields:
    """Byte offsets of a GGUF file's metadata values and tensor index entries, found by the
    encoded key (u64 length + bytes), which occurs once in the header."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            self.head = f.read(4 << 20)  # SmolLM2's header (tokenizer included) is 1.8 MB
        self.digest = digest(path)

    def _string(self, s: str) -> int:
        enc = struct.pack("<Q", len(s)) + s.encode()
        pos = self.head.index(enc)
        assert self.head.find(enc, pos + 1) < 0, s
        return pos + len(enc)

    def value(self, key: str) -> int:
        """Offset of the key's value (after its u32 value type)."""
        return self._string(key) + 4

    def array(self, key: str) -> tuple[int, int]:
        """(offset of the element type, offset of the first element) of an array value."""
        at = self.value(key)
        return at, at + 12

    def tensor_offset(self, name: str) -> int:
        """Offset of the u64 data offset in the tensor's index entry."""
        at = self._string(name)
        n_dims = struct.unpack_from("<I", self.head, at)[0]
        return at + 4 + 8 * n_dims + 4

    @contextlib.contextmanager
    def edited(self, edits: dict[int, bytes]):
        """The file with bytes replaced at these offsets; put back afterwards."""
        with open(self.path, "r+b") as f:
            saved = {}
            for off, b in edits.items():
                f.seek(off)
                saved[off] = f.read(len(b))
                f.seek(off)
                f.write(b)
        try:
            yield self.path
        finally:
            with open(self.path, "r+b") as f:
                for off, b in saved.items():
                    f.seek(off)
                    f.write(b)


u32, u64, f32 = (lambda v: struct.pack("<I", v)), (lambda v: struct.pack("<Q", v)), (lambda v: struct.pack("<f", v))

# name -> (edits as a function of GGUFFields, expected message)
GGUF_CASES = {
    "tensor_count claims 2^60": (lambda g: {8: u64(1 << 60)}, r"1152921504606846976 tensors .*bytes"),
    "kv_count claims 2^60": (lambda g: {16: u64(1 << 60)}, r"1152921504606846976 metadata keys .*bytes"),
    "token_type claims 2^31 elements": (lambda g: {g.array(TOKEN_TYPES)[0] + 4: u64(1 << 31)},
                                        r"tokenizer\.ggml\.token_type.*2147483648 values of 4 bytes.*left"),
    "token_type claims 2^62 elements": (lambda g: {g.array(TOKEN_TYPES)[0] + 4: u64(1 << 62)},
                                        r"tokenizer\.ggml\.token_type.*4611686018427387904 values"),
    "token_type claims 2^64-1 elements": (lambda g: {g.array(TOKEN_TYPES)[0] + 4: u64((1 << 64) - 1)},
                                          r"tokenizer\.ggml\.token_type.*18446744073709551615 values"),
    "array of arrays": (lambda g: {g.array(TOKEN_TYPES)[0]: u32(9)}, r"tokenizer\.ggml\.token_type.*arrays of arrays"),
    "unknown element type": (lambda g: {g.array(TOKEN_TYPES)[0]: u32(13)},
                             r"tokenizer\.ggml\.token_type.*unknown value type 13"),
    "unknown value type": (lambda g: {g.value("llama.block_count") - 4: u32(99)},
                           r"llama\.block_count.*unknown value type 99"),
    "token string past the end": (lambda g: {g.array(TOKENS)[1]: u64(1 << 63)},
                                  r"tokenizer\.ggml\.tokens'\[0\].*9223372036854775808 bytes.*left"),
    "key length past the end": (lambda g: {g.value("llama.block_count") - 4 - len("llama.block_count") - 8: u64(1 << 40)},
                                r"key.*1099511627776 bytes.*left"),
    "invalid UTF-8 in a token": (lambda g: {g.array(TOKENS)[1] + 8: b"\xff"}, r"tokenizer\.ggml\.tokens'\[0\].*not valid UTF-8"),
    "flipped merge": (lambda g: {g.array(MERGES)[1] + 8: "t Ġ".encode()}, r"tokenizer.*merge"),
    "merge without a space": (lambda g: {g.array(MERGES)[1] + 8: "Ġ_t".encode()},
                              r"tokenizer\.ggml\.merges\[0\] 'Ġ_t' is not two tokens"),
    "no tokens": (lambda g: {g.value(TOKENS) - 4 - 1: b"x"}, r"lacks tokenizer\.ggml\.tokens"),
    "head_count 0": (lambda g: {g.value("llama.attention.head_count"): u32(0)},
                     r"llama\.attention\.head_count=0 must be an integer in 1\.\."),
    "head_count_kv 0": (lambda g: {g.value("llama.attention.head_count_kv"): u32(0)},
                        r"llama\.attention\.head_count_kv=0 must be an integer in 1\.\."),
    "head_count_kv that does not divide the shapes": (
        lambda g: {g.value("llama.attention.head_count_kv"): u32(9)},
        r"tensor 'blk\.0\.attn_k' has shape \(192, 576\), expected \(576, 576\)"),
    "block_count one short": (lambda g: {g.value("llama.block_count"): u32(29)},
                              r"tensor 'blk\.29\.\S+' .*n_layer=29"),
    "block_count one over": (lambda g: {g.value("llama.block_count"): u32(31)}, r"no tensor 'blk\.30\."),
    "NaN norm_eps": (lambda g: {g.value("llama.attention.layer_norm_rms_epsilon"): f32(float("nan"))},
                     r"norm_eps=nan must be a finite number"),
    "infinite norm_eps": (lambda g: {g.value("llama.attention.layer_norm_rms_epsilon"): f32(float("inf"))},
                          r"norm_eps=inf must be a finite number"),
    "negative norm_eps": (lambda g: {g.value("llama.attention.layer_norm_rms_epsilon"): f32(-1e-5)},
                          r"norm_eps=-[0-9.e-]+ is outside"),
    "infinite rope_theta": (lambda g: {g.value("llama.rope.freq_base"): f32(float("inf"))},
                            r"rope_theta=inf must be a finite number"),
    "tensor offset wraps around": (lambda g: {g.tensor_offset("output_norm.weight"): u64((1 << 64) - 32)},
                                   r"tensor 'output_norm\.weight'.*18446744073709551584.*outside"),
    "misaligned tensor offset": (lambda g: {g.tensor_offset("output_norm.weight"): None},
                                 r"tensor 'output_norm\.weight'.*not a multiple of the alignment 32"),
}


def gguf_edits(g: GGUFFields, case: str) -> dict[int, bytes]:
    edits = GGUF_CASES[case][0](g)
    for off, b in edits.items():
        if b is None:  # the tensor's offset moved by 16 bytes: still inside the file, not aligned
            edits[off] = u64(struct.unpack_from("<Q", g.head, off)[0] + 16)
    return edits


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_hostile_gguf_convert(case, gguf, tmp_path, capsys):
    out = tmp_path / "out.cflow"
    with gguf.edited(gguf_edits(gguf, case)) as path:
        expect_error(capsys, GGUF_CASES[case][1], "convert", path, "-o", out, "--quiet", seconds=30)
    assert not out.exists() and not list(tmp_path.glob("*.tmp-*"))


@pytest.mark.parametrize("verb", ["generate", "serve"])
@pytest.mark.parametrize("case", ["token_type claims 2^62 elements", "head_count 0", "tensor offset wraps around"])
def test_hostile_gguf_generate_and_serve(verb, case, gguf, capsys):
    with gguf.edited(gguf_edits(gguf, case)) as path:
        argv = ["generate", "-m", path, "hi", "-n", "1"] if verb == "generate" else ["serve", "-m", path, "--port", "1"]
        expect_error(capsys, GGUF_CASES[case][1], *argv)


def test_the_working_copies_are_put_back(gguf):
    assert digest(gguf.path) == gguf.digest


# ---------------------------------------------------------------------------- reading and writing files


def test_unreadable_source(gguf, tmp_path, capsys, monkeypatch):
    src = tmp_path / "locked.gguf"
    shutil.copyfile(gguf.path, src)
    os.chmod(src, 0)
    if os.geteuid() == 0:  # permissions do not bind root: refuse the open as the kernel would for others
        import builtins

        real_open = builtins.open

        def refusing_open(file, *a, **kw):
            if isinstance(file, (str, os.PathLike)) and os.path.abspath(file) == str(src):
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *a, **kw)

        monkeypatch.setattr(builtins, "open", refusing_open)
    expect_error(capsys, rf"cannot read {re.escape(str(src))}: Permission denied", "convert", src, "-o", tmp_path / "o.cflow")
    expect_error(capsys, rf"cannot read {re.escape(str(src))}: Permission denied", "generate", "-m", src, "hi")


def test_output_into_a_missing_directory(gguf, tmp_path, capsys):
    out = tmp_path / "no" / "such" / "m.cflow"
    expect_error(capsys, rf"cannot write {re.escape(str(out))}: No such file or directory", "convert", gguf.path, "-o", out, "-q")


def test_output_into_a_read_only_directory(gguf, tmp_path, capsys):
    d = tmp_path / "ro"
    d.mkdir()
    os.chmod(d, 0o555)
    if os.geteuid() == 0:  # permissions do not bind root; sysfs refuses new files to everyone
        d = Path("/sys")
    out = d / "m.cflow"
    expect_error(capsys, rf"cannot write {re.escape(str(out))}: Permission denied", "convert", gguf.path, "-o", out, "-q")


def test_output_onto_a_directory(gguf, tmp_path, capsys):
    (tmp_path / "d").mkdir()
    expect_error(capsys, rf"cannot write {re.escape(str(tmp_path / 'd'))}: it is a directory", "convert", gguf.path, "-o",
                 tmp_path / "d", "-q")
    assert list((tmp_path / "d").iterdir()) == []


def test_output_onto_a_full_disk(gguf, tmp_path, capsys):
    """A file size limit fails the writes as a full disk does (EFBIG instead of ENOSPC)."""
    import resource

    out = tmp_path / "m.cflow"
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, limits[1]))
    try:
        expect_error(capsys, rf"cannot write {re.escape(str(out))}: File too large", "convert", gguf.path, "-o", out, "-q")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, old)
    assert list(tmp_path.glob("m.cflow*")) == []


def test_output_that_is_the_input_is_refused(gguf, tmp_path, capsys):
    link = tmp_path / "link.gguf"
    link.symlink_to(gguf.path)
    for out in (gguf.path, link, tmp_path / ".." / tmp_path.name / "link.gguf"):
        expect_error(capsys, r"is the input file", "convert", gguf.path, "-o", out, "-q")
        expect_error(capsys, r"is the input file", "convert", link, "-o", out, "-q")
    assert digest(gguf.path) == gguf.digest and link.is_symlink()


def test_sigterm_during_convert_leaves_no_temporary_file(gguf, tmp_path):
    """SIGTERM arrives while the tensors are written (sent by the process to itself at the tenth
    tensor, so the moment is certain): the temp file goes, as on Ctrl-C; status 128 + 15."""
    out = tmp_path / "m.cflow"
    script = (
        "import os, signal, sys\n"
        "from cflow.format.writer import CflowWriter\n"
        "add, calls = CflowWriter.add_tensor, []\n"
        "def add_tensor(self, *a, **kw):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 10:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return add(self, *a, **kw)\n"
        "CflowWriter.add_tensor = add_tensor\n"
        "from cflow.cli import main\n"
        f"sys.exit(main(['convert', {str(gguf.path)!r}, '-o', {str(out)!r}, '-q']))\n"
    )
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 143, (r.returncode, r.stderr)
    assert r.stderr.strip() == "cflow convert: terminated"
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- .cflow


@pytest.fixture(scope="module")
def cflow(tmp_path_factory):
    """A working copy of SmolLM2's .cflow conversion (the cached one `cflow pull` users get)."""
    from cflow.llm import load_model

    with load_model(SMOL, quiet=True) as f:
        src = f.path
    path = tmp_path_factory.mktemp("hostile-cflow") / "smol.cflow"
    shutil.copyfile(src, path)
    return path


def read_header(path) -> tuple[Preamble, bytes]:
    with open(path, "rb") as f:
        pre = Preamble.unpack(f.read(PREAMBLE.size), os.path.getsize(path))
        f.seek(pre.header_offset)
        return pre, f.read()


def write_header(path, pre: Preamble, raw: bytes) -> None:
    """Replace the header (the file's last bytes) and fix up the preamble's sizes and checksums."""
    with open(path, "r+b") as f:
        f.truncate(pre.header_offset)
        f.seek(pre.header_offset)
        f.write(raw)
        f.seek(0)
        f.write(Preamble(pre.version, 0, pre.header_offset + len(raw), pre.header_offset, len(raw), crc32(raw),
                         pre.alignment).pack())


@contextlib.contextmanager
def header_edited(path, edit):
    """The .cflow file with edit(header dict) applied to its header; put back afterwards."""
    pre, raw = read_header(path)
    h = json.loads(raw)
    edit(h)
    write_header(path, pre, json.dumps(h).encode())
    try:
        yield path
    finally:
        write_header(path, pre, raw)


def config(**fields):
    return lambda h: h["config"].update(fields)


def gate_up(h) -> dict:
    return next(t for t in h["tensors"] if t["name"] == "blk.0.ffn_gate_up")


CFLOW_CASES = {
    "NaN norm_eps": (config(norm_eps=float("nan")), r"norm_eps=nan must be a finite number"),
    "infinite norm_eps": (config(norm_eps=float("inf")), r"norm_eps=inf must be a finite number"),
    "negative norm_eps": (config(norm_eps=-1e-5), r"norm_eps=-1e-05 is outside"),
    "NaN embed_scale": (config(embed_scale=float("nan")), r"embed_scale=nan must be a finite number"),
    "infinite rope_theta": (config(rope_theta=float("inf")), r"rope_theta=inf must be a finite number"),
    "huge attn_scale": (config(attn_scale=1e30), r"attn_scale=1e\+30 is outside"),
    "n_layer one short": (config(n_layer=29), r"tensor 'blk\.29\.\S+' .*n_layer=29"),
    "n_kv_head that disagrees with the tensors": (config(n_kv_head=9),
                                                  r"tensor 'blk\.0\.attn_qkv' has shape \(960, 576\), expected \(1728, 576\)"),
    "odd head_dim": (config(head_dim=63), r"head_dim=63 must be even"),
    "stripe_rows the engine cannot use": (lambda h: gate_up(h).update(stripe_rows=8),
                                          r"tensor 'blk\.0\.ffn_gate_up': stripe_rows 8 is not a multiple of the interleave 16"),
    "boolean vocab_size": (config(vocab_size=True), r"vocab_size=True must be a positive integer"),
    "float version": (lambda h: h.update(version=2.0), r"format/version fields are 'cflow'/2\.0"),
}


@pytest.mark.parametrize("case", list(CFLOW_CASES))
def test_hostile_cflow_verify_and_load(case, cflow, capsys):
    edit, match = CFLOW_CASES[case]
    with header_edited(cflow, edit) as path:
        verified = expect_error(capsys, match, "verify", path)
        loaded = expect_error(capsys, match, "generate", "-m", path, "hi", "-n", "1")
    assert verified.split("error: ", 1)[1].endswith(loaded.split("error: ", 1)[1])  # one check, one message


def test_the_cflow_copy_still_verifies(cflow, capsys):
    rc, _ = run_cli(capsys, "verify", cflow)
    assert rc == 0


# ---------------------------------------------------------------- Hugging Face config.json
HF_CASES = {
    "no attention heads": ({"num_attention_heads": 0}, r"config\.json num_attention_heads=0 must be an integer in 1\.\."),
    "no KV heads": ({"num_key_value_heads": 0}, r"num_key_value_heads=0 must be an integer"),
    "a missing size": ({"hidden_size": None}, r"config\.json lacks 'hidden_size'"),
    "a size as text": ({"intermediate_size": "big"}, r"intermediate_size='big' must be an integer"),
    "a boolean layer count": ({"num_hidden_layers": True}, r"num_hidden_layers=True must be an integer"),
    "eps as text": ({"rms_norm_eps": "small"}, r"rms_norm_eps='small' must be a number"),
    "heads that do not divide the shapes": ({"num_attention_heads": 5}, r"shape|divide|head"),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hostile_hf_config_convert(case, tiny_hf, tmp_path, capsys):
    edit, match = HF_CASES[case]
    src = tmp_path / "hf"
    shutil.copytree(tiny_hf, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update({k: v for k, v in edit.items() if v is not None})
    for k in [k for k, v in edit.items() if v is None]:
        cfg.pop(k, None)
    (src / "config.json").write_text(json.dumps(cfg))
    expect_error(capsys, match, "convert", src, "-o", tmp_path / "out.cflow")
    assert not (tmp_path / "out.cflow").exists()


# ---------------------------------------------------------------------------- chat templates


@pytest.mark.parametrize("template, match", [
    ("{{ ''.__class__.__mro__ }}", r"chat template failed: SecurityError"),
    ("{% for i in range(10**9) %}x{% endfor %}", r"chat template failed: OverflowError"),
    ("{{ messages[0]['content'] / 0 }}", r"chat template failed: "),
    ("{{ raise_exception('no system role') }}", r"chat template: no system role"),
    ("{% for %}", r"chat template does not parse"),
])
def test_a_hostile_chat_template_is_a_clear_error(tiny_llm, template, match):
    import copy

    from cflow.errors import CflowError

    llm = copy.copy(tiny_llm)  # the session's model keeps its own template
    llm.chat_template, llm._template = template, None
    with pytest.raises(CflowError, match=match):
        llm.render_chat([{"role": "user", "content": "hi"}])
