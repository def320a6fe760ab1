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


def test_cli_does_not_import_torch():
    code = "import sys; from cflow.cli import main; main(['info']); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
