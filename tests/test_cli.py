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


@pytest.mark.parametrize("head", [["serve"], ["generate", "Once"], ["chat"]])
def test_llama_cpp_short_options_mean_the_same(head):
    """llama.cpp's users type -t, -c (and -np for llama-server): the same options here."""
    from cflow.cli import build_parser

    parse, serve = build_parser().parse_args, head == ["serve"]
    short = ["-t", "3", "-c", "512"] + (["-np", "6"] if serve else [])
    spelled = ["--threads", "3", "--ctx-size", "512"] + (["--parallel", "6"] if serve else [])
    a, b = parse(head + short), parse(head + spelled)
    assert (a.threads, a.n_ctx) == (b.threads, b.n_ctx) == (3, 512)
    assert parse(head + ["--n-ctx", "512"]).n_ctx == 512
    if serve:
        assert a.parallel == b.parallel == 6
