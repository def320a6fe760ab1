"""`cflow claims` and `cflow bench disk-tier` end to end on tiny models: the page and its plot are
written from the run, a claim's verdict follows its numbers, and the disk-tier benchmark runs each
policy in a memory-limited child process (where this machine lets a cgroup be made)."""

import json
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from cflow.analysis import claims as C  # noqa: E402
from cflow.bench import disk_tier  # noqa: E402
from cflow.cli import main  # noqa: E402
from cflow.errors import CflowError  # noqa: E402
from pnt_util import make, tok  # noqa: E402,F401 (tok: a fixture)


@pytest.fixture(scope="module")
def work(tmp_path_factory, tok):
    """A claims work folder holding tiny models under the names make_models looks for."""
    d = tmp_path_factory.mktemp("claims")
    for name in ("arch2_4_combined", "arch1"):
        _, path = make(d, tok, name, "q4_0", d_model=128, d_ff=256, d_expert=128)
        os.replace(path, d / f"{name}-q4_0.cflow")
    return d


def test_claims_write_the_page_from_the_run(work, tmp_path):
    out = tmp_path / "docs" / "CLAIMS.md"
    got = C.run_claims(out=out, work=work, threads=2, only=[1, 3], log=lambda *a: None)
    assert [c.number for c in got] == [1, 3]
    assert all(c.verdict == C.PROVEN for c in got)  # top-k bytes are exactly E / k of all; the engines agree
    page = out.read_text()
    assert "## 1. Conditional expert loading: proven" in page and "## 3." in page and "## 2." not in page
    ratio = dict(got[0].rows)["ratio (n_expert / top_k expected)"]
    assert ratio == "2.000 (2.000)" and ratio in page  # 4 experts, top-2: the numbers on the page are the run's
    assert (out.parent / "img" / "claims-1.png").stat().st_size > 1000
    assert json.loads((work / "claims.json").read_text())[0]["verdict"] == "proven"
    assert (work / "arch2_4_combined-q4_0.vflow").exists() and (work / "arch2_4_combined-q4_0-reversed.cflow").exists()


def test_reordered_copy_holds_the_same_model(work):
    from cflow.engine import Engine

    a = Engine(str(work / "arch2_4_combined-q4_0.cflow"), threads=1)
    b = Engine(str(work / "arch2_4_combined-q4_0-reversed.cflow"), threads=1)
    ids = list(range(3, 40))
    assert (a.forward(a.new_state(), ids) == b.forward(b.new_state(), ids)).all()
    names = list(b.file.tensors)
    assert names.index("output") < names.index("tok_embd")  # really another file order


def test_claims_cli_refuses_bad_numbers(capsys):
    assert main(["claims", "--only", "9"]) != 0
    assert "claim numbers 1..8" in capsys.readouterr().err


def cgroup_ok() -> bool:
    try:
        disk_tier.MemoryLimit(1 << 30).close()
        return True
    except (CflowError, OSError):
        return False


@pytest.mark.skipif(not cgroup_ok(), reason="no writable cgroup and no systemd-run here")
def test_bench_disk_tier_runs_each_policy_under_a_limit(work, tmp_path, capsys):
    path = str(work / "arch2_4_combined-q4_0.cflow")
    budget = os.path.getsize(path) - 2 * 4096 * 20  # fewer slots than experts
    js = tmp_path / "disk.json"
    assert main(["bench", "disk-tier", "-m", path, "--memory-limit", "2G", "--ram-budget", str(budget),
                 "--tokens", "4", "--warm-tokens", "4", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "overlap model" in out
    rec = json.loads(js.read_text())
    for pol in ("mmap", "sync", "staged"):
        assert "error" not in rec["runs"][pol], rec["runs"][pol]
        assert rec["runs"][pol]["phases"]["warm"]["tok_s"] > 0
    assert rec["runs"]["staged"]["phases"]["warm"]["slots"] > 0
    assert rec["runs"]["sync"]["phases"]["warm"]["prediction_accuracy"] is None
    assert rec["overlap"]["measured_ratio"] > 0
