"""Session fixtures: a tiny real model (built once per test session) and cflow.LLM over it."""

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two test workers share the machine's cores: one thread each for torch and for the engine
    # (tests that pass threads= explicitly still run the thread pool).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("CFLOW_THREADS", "1")

N_CTX = 4096  # room for a generation long enough to still be running when a test cancels it


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    from tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_cflow(tiny_hf):
    """The tiny model converted with `cflow convert`."""
    from cflow.cli import main

    out = tiny_hf.parent / "tiny-llama.cflow"
    assert main(["convert", str(tiny_hf), "-o", str(out), "--quiet"]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_llm(tiny_cflow):
    from cflow.llm import LLM

    return LLM(str(tiny_cflow), n_ctx=N_CTX, quiet=True)
