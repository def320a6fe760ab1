"""The CLI dispatcher and the native core's ISA dispatch."""

import subprocess
import sys

import pytest

from cflow.cli import main


def test_info_reports_a_supported_isa(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    path = out.split("kernel path: ")[1].split()[0]
    assert path in ("scalar", "avx2", "avx512")
    assert f"{path:7s} yes" in out


def test_unknown_verb_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        main(["no-such-verb"])
    assert e.value.code == 2


@pytest.mark.parametrize("verb", ["generate", "chat"])
def test_sampling_help_names_the_defaults(verb, capsys):
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "default: the model's generation_config.json, else llama.cpp's: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05" in out
    assert "0: greedy (default: the model's, else 0.8)" in out


def test_cli_does_not_import_torch():
    code = "import sys; from cflow.cli import main; main(['info']); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
