"""Session fixtures: a tiny real model (built once per test session) and cflow.LLM over it."""

import pytest


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    from tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_hf):
    from cflow.llm import LLM

    return LLM(str(tiny_hf), n_ctx=256)
