"""The fuzzer (cflow.fuzz) and its corpus: every mutant that ever made a loader fail, replayed
through the real loaders, verify, inspect, convert and generate in worker processes.

Each entry of tests/data/fuzz-corpus.jsonl once gave a traceback, a non-finite logit or a
multi-line error; now each must end in a clear one-line error or a model with finite logits.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cflow.fuzz import bases as fuzz_bases
from cflow.fuzz import run as fuzz
from cflow.fuzz.mutate import mutate

CORPUS = Path(__file__).parent / "data" / "fuzz-corpus.jsonl"


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-bases")


def test_the_bases_are_good_models(bases):
    paths = fuzz_bases.make(bases)
    w = fuzz.Worker(bases, timeout=300)
    try:
        for kind, path in paths.items():
            targets = w.check(kind, path)
            assert all(v[0] == "ok" for v in targets.values()), (kind, targets)
            assert "logits" in targets
    finally:
        w.close()


def test_the_corpus_replays_to_clear_errors_or_good_models(bases):
    entries = fuzz.read_corpus(CORPUS)
    assert len(entries) >= 50
    outcomes = fuzz.replay(entries, bases_dir=bases, jobs=2, timeout=300)
    assert len(outcomes) == len(entries)
    bad = [(o.what, o.targets) for o in outcomes if o.failed]
    assert not bad, bad
    assert {o.result for o in outcomes} <= {"ok", "error"}


def test_a_short_run_is_clean_and_reaches_both_outcomes(bases, tmp_path):
    outcomes = fuzz.run(30, seed=3, jobs=2, timeout=300, bases_dir=bases, failures=tmp_path / "failures")
    assert [o.index for o in outcomes] == list(range(30))
    assert {o.kind for o in outcomes} == set(fuzz_bases.KINDS)
    bad = [(o.what, o.targets) for o in outcomes if o.failed]
    assert not bad, bad
    results = {o.result for o in outcomes}
    assert "error" in results and "ok" in results  # the mutants reach past the first check, and some are rejected
    assert not (tmp_path / "failures").exists()
    lines = fuzz.summary(outcomes, 1.0)
    assert lines[-1].startswith("30 mutants in")


def test_mutants_are_fixed_by_seed_and_index(bases):
    paths = fuzz_bases.make(bases)
    changed = 0
    for i in range(30):
        kind = fuzz_bases.KINDS[i % 3]
        a = mutate(kind, paths[kind], random.Random(f"5:{i}"))
        b = mutate(kind, paths[kind], random.Random(f"5:{i}"))
        assert a == b
        changed += a[1] != fuzz.base_bytes(kind, a[0], paths)
    assert changed >= 25  # a few mutations write a field's own value back


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.data())
def test_corpus_edits_give_back_the_mutant(base, data):
    mutant = data.draw(st.one_of(
        st.binary(max_size=300),
        st.lists(st.tuples(st.integers(0, max(len(base) - 1, 0)), st.integers(0, 255)), max_size=6).map(
            lambda flips: bytes(_flip(base, flips)))))
    entry = fuzz.diff(base, mutant)
    assert fuzz.undiff(base, entry) == mutant


def _flip(base: bytes, flips) -> bytearray:
    out = bytearray(base)
    for at, v in flips:
        if at < len(out):
            out[at] = v
    return out
