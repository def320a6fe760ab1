"""A model file that changes on disk while it is served (docs/ENGINE.md, "Model file changed on
disk"): truncated or written in place, the requests that need it get a clear error and the
process lives on; replaced by a rename, the old file keeps being served.

Every test works on its own copy of the tiny model (conftest), made to look old (a fixed past
mtime), so that any later write shows in its modification time whatever the clock's granularity.
Truncations happen either between requests or from inside a step (a wrapper of the engine's
_forward truncates, then runs the step): no test depends on timing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import httpx
import numpy as np
import pytest
from server_util import serving

from cflow import _core
from cflow.cli import main
from cflow.errors import ModelFileChanged
from cflow.llm import LLM

pytestmark = pytest.mark.skipif(not _core.map_guard_supported(), reason="the SIGBUS guard is Linux-only")

OLD = 1_000_000_000 * 10**9  # mtime_ns of the copies: 2001
SHORT = 8192  # truncated length: the preamble page and one page of weights; the rest is gone
HI = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture
def model(tiny_cflow, tmp_path):
    path = tmp_path / "model.cflow"
    shutil.copyfile(tiny_cflow, path)
    os.utime(path, ns=(OLD, OLD))
    return path


def load(path) -> LLM:
    return LLM(str(path), n_ctx=256, quiet=True, threads=1)


def truncate_in_next_step(engine, path, size=SHORT):
    """The engine's next step starts, then the file is truncated under it (after forward's
    check of the file, before the native call reads the weights)."""
    run = engine._forward

    def forward(*args, **kw):
        os.truncate(path, size)
        return run(*args, **kw)

    engine._forward = forward


def lost(llm) -> bool:
    return llm.file._mapping.lost


def chat(url, **kw):
    return httpx.post(url + "/v1/chat/completions", json=dict(HI, **kw), timeout=60)


# ---------------------------------------------------------------- the mapping

_READ_TRUNCATE_READ = """
import os, sys
import numpy as np
{setup}
m = {mapping}
assert int(m[SIZE // 2:].sum()) > 0  # paged in
os.truncate(sys.argv[1], 8192)
print(int(m[SIZE // 2:].sum()), flush=True)
"""


def _run(model, setup="", mapping="np.memmap(sys.argv[1], np.uint8, 'r')", flags=()):
    code = _READ_TRUNCATE_READ.format(setup=setup, mapping=mapping).replace("SIZE", str(os.path.getsize(model)))
    return subprocess.run([sys.executable, *flags, "-c", code, str(model)], capture_output=True, text=True, timeout=120)


def test_a_file_truncated_under_a_plain_mapping_kills_the_process(model):
    """Why the guard exists: numpy's mapping (what the reader used) dies of SIGBUS."""
    assert _run(model).returncode == -signal.SIGBUS


def test_a_guarded_mapping_reads_zeros_past_the_new_end(model):
    m = _core.MappedFile(str(model))
    a = m.array()
    assert not a.flags.writeable and m.guarded and not m.lost
    head, tail = int(a[:SHORT].sum()), int(a[SHORT:].sum())
    assert tail > 0
    os.truncate(model, SHORT)
    assert int(a[SHORT:].sum()) == 0 and m.lost
    assert int(a[:SHORT].sum()) == head  # the pages still in the file are still the file's
    assert m.stat()[2] == SHORT and m.opened[2] == len(a)


@pytest.mark.parametrize("flags", [(), ("-X", "faulthandler")], ids=["default", "faulthandler"])
def test_a_fault_outside_guarded_ranges_still_kills(model, tmp_path, flags):
    """The guard chains: a SIGBUS in a mapping it does not guard gets the previous handler
    (Python's faulthandler, or the default action), as without it."""
    other = tmp_path / "guarded.cflow"
    shutil.copyfile(model, other)
    setup = f"from cflow import _core\nkeep = _core.MappedFile({str(other)!r})  # installs the handler"
    r = _run(model, setup=setup, flags=flags)
    assert r.returncode == -signal.SIGBUS, r.stderr
    if flags:
        assert "Bus error" in r.stderr  # faulthandler's traceback, once
    shutil.copyfile(other, model)  # whole again
    guarded = _run(model, setup="from cflow import _core", mapping="_core.MappedFile(sys.argv[1]).array()",
                   flags=flags)
    assert guarded.returncode == 0 and guarded.stdout.strip() == "0", guarded.stderr


# ---------------------------------------------------------------- the engine and the CLI

def test_generate_refuses_a_truncated_file(model):
    llm = load(model)
    before = llm.generate("hello", max_tokens=3, temperature=0)
    assert llm.engine.weights_error() is None
    os.truncate(model, SHORT)
    with pytest.raises(ModelFileChanged, match=r"changed on disk while in use \(now 8192 bytes, was \d+\)"):
        llm.generate("hello", max_tokens=3, temperature=0)
    assert not lost(llm)  # found by the size check before any read of the missing pages
    with pytest.raises(ModelFileChanged):  # and from then on
        llm.generate("hello", max_tokens=3, temperature=0)
    assert before


def test_a_step_that_reads_a_truncated_file_raises(model):
    llm = load(model)
    truncate_in_next_step(llm.engine, model)
    with pytest.raises(ModelFileChanged, match="changed on disk while in use"):
        llm.generate("hello", max_tokens=3, temperature=0)
    assert lost(llm)  # the step faulted in the mapping, read zeros, and lived
    st = llm.engine.new_state()
    with pytest.raises(ModelFileChanged):
        llm.engine.forward(st, [1, 2])
    assert st.pos == 0


def test_generate_refuses_a_file_written_in_place(model):
    llm = load(model)
    with open(model, "r+b") as fh:  # same size, other bytes: visible through the mapping at once
        fh.seek(4096)
        fh.write(bytes(4096))
    with pytest.raises(ModelFileChanged, match="written in place while in use"):
        llm.generate("hello", max_tokens=3, temperature=0)


def test_cli_prints_one_line_and_exits_2(model, monkeypatch, capsys):
    from cflow.engine import Engine

    run = Engine._forward

    def forward(self, *args):
        os.truncate(model, SHORT)
        return run(self, *args)

    monkeypatch.setattr(Engine, "_forward", forward)
    assert main(["generate", "hi", "-m", str(model), "-n", "3", "--temperature", "0", "-t", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cflow generate: error: model file ") and "restart" in err[0]


# ---------------------------------------------------------------- the server

def test_server_truncated_while_serving(model):
    llm = load(model)
    with serving(llm) as url:
        assert chat(url).status_code == 200
        truncate_in_next_step(llm.engine, model)
        r = chat(url)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "model_file_changed" and err["type"] == "server_error"
        assert "changed on disk while in use" in err["message"] and str(model) in err["message"]
        assert lost(llm)
        # the process and the server live on, and say why they cannot serve
        h = httpx.get(url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "error"
        assert h.json()["error"]["code"] == "model_file_changed"
        for stream in (False, True):
            r = chat(url, stream=stream)
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_file_changed"
        assert httpx.get(url + "/v1/models").status_code == 200


def test_server_file_written_in_place(model):
    llm = load(model)
    with serving(llm) as url:
        assert chat(url).status_code == 200 and httpx.get(url + "/health").status_code == 200
        with open(model, "r+b") as fh:
            fh.seek(4096)
            fh.write(bytes(64 * 1024))
        assert httpx.get(url + "/health").status_code == 503  # seen before any request
        r = chat(url)
        assert r.status_code == 503 and "written in place" in r.json()["error"]["message"]


def test_server_file_replaced_by_rename_keeps_serving(model):
    llm = load(model)
    with serving(llm) as url:
        first = chat(url).json()["choices"][0]["message"]["content"]
        new = model.with_suffix(".new")
        data = bytearray(model.read_bytes())
        data[4096:4096 + 64 * 1024] = bytes(64 * 1024)  # another model's weights
        new.write_bytes(data)
        os.replace(new, model)  # the path names the new file; the mapping holds the old inode
        r = chat(url)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == first
        assert httpx.get(url + "/health").json()["status"] == "ok"
        assert llm.engine.weights_error() is None and not lost(llm)


def test_plain_weights_have_no_file_to_check():
    """Weights that are not a mapped CflowFile (checkpoints, test doubles) never report a change."""
    from types import SimpleNamespace

    from cflow.engine import EngineBase

    eng = EngineBase.__new__(EngineBase)
    eng.file = SimpleNamespace(buffer=np.zeros(1, np.uint8))
    assert eng.weights_error() is None
    eng.check_weights()
