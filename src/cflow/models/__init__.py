"""Model families and the registry of architectures.

Every module of this package that defines `ARCH` (an Architecture, cflow.models.base) at top
level is an architecture family; the registry is what those modules say, and it is the only
list of architectures: conversion, the engines, the config check, the CLI's help and the docs
table (docs/MODELS.md, `python -m cflow.models`) read it. Adding an architecture is adding its
module. Modules are found by reading their source for `ARCH =`, so the registry imports only
the families (no torch: cflow.models.pnt, the torch model, is not one of them).

    from cflow import models
    models.names()                   # ('gemma3', 'llama', 'phi3', 'pnt', 'qwen2', 'qwen3')
    arch = models.get(cfg.arch)      # UnsupportedError naming the known ones
    plan = arch.build(builder, cfg)  # the forward pass as ops (cflow.plan)
    models.check_model(cfg, tensors) # config and tensors agree (CflowFormatError if not)
    models.for_hf("mistral").name    # 'llama'
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re

from cflow.errors import CflowError, UnsupportedError

_ARCH_LINE = re.compile(r"^ARCH\s*(:[^=\n]*)?=", re.M)
_registry: dict | None = None
_discovering = False


def _discover() -> dict:
    from cflow.models.base import Architecture

    global _discovering
    if _discovering:
        raise CflowError("an architecture module used the registry while it was being built (at import time)")
    _discovering = True
    try:
        return _find(Architecture)
    finally:
        _discovering = False


def _find(Architecture) -> dict:

    found: dict[str, Architecture] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.ispkg:
            continue
        name = f"{__name__}.{info.name}"
        spec = importlib.util.find_spec(name)
        source = spec.loader.get_source(name) if spec is not None and hasattr(spec.loader, "get_source") else None
        if source is not None and not _ARCH_LINE.search(source):
            continue
        arch = getattr(importlib.import_module(name), "ARCH", None)
        if arch is None:
            continue
        if not isinstance(arch, Architecture) or not arch.name:
            raise CflowError(f"{name}.ARCH must be a named Architecture, got {arch!r}")
        if arch.name in found:
            raise CflowError(f"architecture {arch.name!r} is defined twice ({name})")
        found[arch.name] = arch
    for key in ("hf_model_types", "gguf_archs"):
        seen: dict[str, str] = {}
        for arch in found.values():
            for v in getattr(arch, key):
                if seen.setdefault(v, arch.name) != arch.name:
                    raise CflowError(f"{key} {v!r} is claimed by both {seen[v]} and {arch.name}")
    return found


def architectures() -> dict:
    """{name: Architecture}, by name."""
    global _registry
    if _registry is None:
        _registry = _discover()
    return _registry


def names() -> tuple[str, ...]:
    return tuple(architectures())


def get(name: str):
    """The Architecture called `name`; UnsupportedError listing the known ones."""
    arch = architectures().get(name)
    if arch is None:
        raise UnsupportedError(f"unsupported architecture {name!r}; supported: {', '.join(names())}")
    return arch


def _by(key: str, value, what: str):
    for arch in architectures().values():
        if value in getattr(arch, key):
            return arch
    raise UnsupportedError(f"unsupported {what} {value!r}; supported: " + supported_sources(key))


def supported_sources(key: str) -> str:
    """"arch: value, ...; ..." for key "hf_model_types" or "gguf_archs", architectures that have any."""
    return "; ".join(f"{n}: {', '.join(getattr(a, key))}" for n, a in architectures().items() if getattr(a, key))


def for_hf(model_type: str):
    """The Architecture that reads a Hugging Face config.json of this model_type."""
    return _by("hf_model_types", model_type, "model_type")


def for_gguf(gguf_arch: str):
    """The Architecture that reads a GGUF file of this general.architecture."""
    return _by("gguf_archs", gguf_arch, "GGUF architecture")


def check_model(cfg, tensors: dict) -> None:
    """The one check of a model's config against its tensors ({name: entry with .shape}), made
    before anything uses either: by `cflow convert` (GGUF and Hugging Face sources), by `cflow
    verify`, and by both engines on load. CflowFormatError naming the tensor that disagrees.
    (The config's own values are checked when it is built: ModelConfig.validate.)"""
    get(cfg.arch).check_tensors(cfg, tensors)


def supported(engine: str) -> tuple[str, ...]:
    """Names of the architectures `engine` ("native", "ref") runs."""
    return tuple(n for n, a in architectures().items() if engine in a.engines)


def docs_table() -> str:
    """The architecture table of docs/MODELS.md."""
    rows = ["| arch | HF model_type | GGUF architecture | models, traits | engines |",
            "|------|--------------|-------------------|----------------|---------|"]
    for n, a in architectures().items():
        cells = [f"`{n}`", ", ".join(a.hf_model_types) or "-", ", ".join(a.gguf_archs) or "-", a.summary,
                 ", ".join(a.engines) or "- (torch model only)"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"
