"""`cflow analyze` reproduces the paper's critical-path figures at its geometry."""

import json
import subprocess
import sys

import pytest

from cflow.analysis.bandwidth import analyze, critical_paths, layer_bytes, MIB
from cflow.cli import main
from cflow.models.presets import PRESETS, preset

PAPER = {"arch1": 9.00, "arch2_4_combined": 4.50, "arch2_4_sync": 4.50, "arch3": 9.00, "arch4_async_experts": 9.00}


@pytest.mark.parametrize("name", list(PAPER))
def test_paper_critical_path(name, capsys):
    assert main(["analyze", "--arch", name, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert set(rec) == {"arch", "total_mb_per_token", "critical_path_mb_per_token", "longest_path_mb_per_token"}
    assert rec["arch"] == name
    assert round(rec["critical_path_mb_per_token"]["vertical_pipeline"], 2) == PAPER[name]
    assert round(rec["critical_path_mb_per_token"]["sequential"], 2) == 9.00
    assert round(rec["total_mb_per_token"], 2) == 16.50


def test_paper_layer_bytes_and_q4_0():
    lb = layer_bytes(preset("arch1"), "q4")
    assert (lb.attn / MIB, lb.dense / MIB, lb.experts / MIB) == (0.5, 1.5, 0.75)
    r = analyze(preset("arch2_4_combined"), "q4_0")
    assert r["critical_path_mb_per_token"]["vertical_pipeline"] == pytest.approx(4.50 * 1.125, abs=1e-3)


def test_post_dense_routing_serialises_experts_behind_dense():
    cp = critical_paths(preset("arch2_4_sync", routing_anchor="post_dense"), layer_bytes(preset("arch1")))
    assert cp["vertical_pipeline"] / MIB == pytest.approx(6 * (1.5 + 0.75) / 2)
    assert cp["sequential"] / MIB == pytest.approx(6 * 2.25)


def test_longest_path_includes_fill_and_drain():
    cp = critical_paths(preset("arch2_4_combined"), layer_bytes(preset("arch1")))
    # D0 -> D2 -> D4 -> E5: three dense FFNs and the last layer's experts
    assert cp["longest_path"] / MIB == pytest.approx(3 * 1.5 + 0.75)


def test_text_output_and_no_torch():
    code = ("import sys; from cflow.cli import main; main(['analyze', '--arch', 'all']);"
            "assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    for name in PRESETS:
        assert name in out
    assert "vertical pipeline 4.50" in out and "vertical pipeline 5.06" in out  # q4 and q4_0


def test_bad_arch_is_a_clear_error(capsys):
    assert main(["analyze", "--arch", "arch7"]) == 2
    assert "unknown arch 'arch7'" in capsys.readouterr().err
