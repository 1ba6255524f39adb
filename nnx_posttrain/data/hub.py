"""Data files that a ``--data`` value names indirectly: Hugging Face Hub datasets, folders of
Parquet shards, and globs. Each resolves to a sorted list of files, which ``sources`` reads lazily
(one ``ParquetSource`` per shard, concatenated).

- ``hf://ORG/NAME[:SPLIT]`` (also ``hf://datasets/ORG/NAME``, and ``hf://ORG/NAME/SUBSET`` for a
  config / sub-folder): the dataset's Parquet files through the local Hub cache
  (``huggingface_hub.snapshot_download``: downloaded once, then read from the cache; with
  ``HF_HUB_OFFLINE=1`` only the cache is used);
- a folder of Parquet shards in the layout the Hub uses (a downloaded dataset:
  ``data/train-00000-of-00002.parquet``, ``data/test-...``, ``<config>/<split>-...``,
  ``<split>/*.parquet``, ``train.parquet``; or the ``configs:`` / ``data_files`` of its README);
- a glob of files (``'data/train-*.parquet'``, ``'shards/*.jsonl'``).

The split is the one asked for (``:SPLIT``) or the caller's (``train`` for ``--data``; for
``--eval-data`` the first of eval, validation, valid, test, dev, val that exists).
"""

from __future__ import annotations

import glob as glob_lib
import os
import re
from pathlib import Path

from nnx_posttrain.data.errors import DataError

PREFIX = "hf://"
# Names tried, in order, for a split (as Hugging Face ``datasets`` recognises split names).
SPLIT_ALIASES = {
    "train": ("train", "training"),
    "eval": ("eval", "validation", "valid", "test", "dev", "val"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
KNOWN = {name for names in SPLIT_ALIASES.values() for name in names}
_SHARD = re.compile(r"^(?P<split>.+?)-\d{5}-of-\d{5}(?:\.\w+)?\.parquet$")
_ARROW_MARKERS = ("state.json", "dataset_dict.json")


def files(spec: str, split: str) -> list[Path] | None:
    """The files ``spec`` names (see the module docstring), or None when it is not a Hub handle,
    a glob or a folder of Parquet shards (then ``sources`` reads it as a file or Arrow folder)."""
    if spec.startswith(PREFIX):
        return hub_files(spec, split)
    if any(c in spec for c in "*?[") and not Path(spec).exists():
        found = sorted(Path(p) for p in glob_lib.glob(spec, recursive=True) if Path(p).is_file())
        if not found:
            raise DataError(f"{spec}: no files match this pattern")
        return found
    path = Path(spec)
    if path.is_dir() and not _is_arrow_dataset(path) and _parquet_files(path):
        return folder_files(path, split, name=spec)
    return None


def _is_arrow_dataset(path: Path) -> bool:
    return any((path / m).is_file() for m in _ARROW_MARKERS) or any(path.glob("data-*.arrow"))


def _parquet_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.parquet") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


# ----------------------------------------------------------------------------- the Hub


def parse_handle(spec: str) -> tuple[str, str | None, str | None]:
    """``hf://[datasets/]ORG/NAME[/SUBSET][:SPLIT]`` -> (repo id, subset or None, split or None)."""
    body = spec[len(PREFIX):]
    body, _, split = body.partition(":")
    parts = [p for p in body.split("/") if p]
    if parts and parts[0] == "datasets":
        parts = parts[1:]
    if len(parts) < 2:
        raise DataError(f"{spec}: expected hf://ORG/NAME[:SPLIT] (a dataset on the Hugging Face Hub)")
    return "/".join(parts[:2]), "/".join(parts[2:]) or None, split or None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _cache_dir() -> str | None:
    """Read at each call (huggingface_hub reads its variables once, at its import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def snapshot(repo_id: str, spec: str, subset: str | None = None) -> Path:
    """The local folder of the dataset's Parquet files (and README): from the Hub cache, after
    downloading what is missing unless offline."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError)
    except ImportError:  # pragma: no cover - a dependency
        raise DataError(f"{spec}: reading Hub datasets needs huggingface_hub "
                        "(pip install huggingface_hub)") from None
    # fnmatch: '*' also matches '/'
    patterns = ["README.md"] + ([f"{subset}/*.parquet", f"*{subset}*.parquet"] if subset
                                else ["*.parquet"])
    offline = _offline()
    try:
        folder = snapshot_download(repo_id, repo_type="dataset", cache_dir=_cache_dir(),
                                   allow_patterns=patterns, local_files_only=offline)
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise DataError(f"{spec}: the Hub has no dataset {repo_id} that this token may read "
                        f"({type(exc).__name__}); check the name, or log in for a private or "
                        "gated one (hf auth login)") from None
    except LocalEntryNotFoundError:
        where = _cache_dir() or "the default Hugging Face cache (~/.cache/huggingface/hub)"
        why = ("HF_HUB_OFFLINE=1 forbids downloading it" if offline
               else "the Hub could not be reached")
        raise DataError(
            f"{spec}: dataset {repo_id} is not in the local Hub cache ({where}) and {why}. "
            f"Download it once where the Hub is reachable (hf download {repo_id} --repo-type "
            f"dataset, or run without HF_HUB_OFFLINE), point HF_HUB_CACHE / HF_HOME at the cache "
            "that has it, or give --data the folder of its Parquet files") from None
    return Path(folder)


def hub_files(spec: str, split: str) -> list[Path]:
    repo_id, subset, asked = parse_handle(spec)
    root = snapshot(repo_id, spec, subset)
    return folder_files(root, asked or split, name=spec, subset=subset, explicit=asked is not None)


# ----------------------------------------------------------------------------- folders


def folder_files(root: Path, split: str, name: str, subset: str | None = None,
                 explicit: bool = False) -> list[Path]:
    """The Parquet files of ``split`` in a dataset folder (see the module docstring)."""
    declared = _readme_splits(root, subset)
    if declared is not None:
        splits = {s: sorted({p for pat in pats for p in _glob(root, pat)}) for s, pats in declared}
    else:
        base = root / subset if subset else root
        if subset and not base.is_dir():
            raise DataError(f"{name}: no subset or folder {subset!r} in the dataset ({root})")
        shards = _parquet_files(base)
        if not shards:
            raise DataError(f"{name}: no Parquet files in {base} (only Parquet datasets are read "
                            "from a folder or the Hub; give other files as --data FILE)")
        splits = {}
        for f in shards:
            splits.setdefault(_split_of(f.relative_to(base)), []).append(f)
        if not KNOWN & set(splits) and split == "train" and not explicit:
            return shards  # no split names at all: every file is training data (as `datasets`)
    for candidate in SPLIT_ALIASES.get(split, (split,)):
        if splits.get(candidate):
            return splits[candidate]
    tried = ", ".join(SPLIT_ALIASES.get(split, (split,)))
    names = sorted(splits)
    if name.startswith(PREFIX):
        base = PREFIX + name[len(PREFIX):].partition(":")[0]
        how = f"; name one: {base}:{names[0]}" if names else ""
    else:
        how = f"; give a split's files as a glob, e.g. '{root}/**/{names[0]}*.parquet'" if names else ""
    raise DataError(f"{name}: no {split!r} split (tried {tried}); its splits: "
                    f"{', '.join(names) or 'none'}{how}")


def _split_of(rel: Path) -> str:
    """The split a shard belongs to: ``<split>-00000-of-00002.parquet``, a ``<split>/`` folder,
    or ``<split>.parquet``."""
    match = _SHARD.match(rel.name)
    if match:
        return match.group("split")
    for part in rel.parts[:-1]:
        if part.lower() in KNOWN:
            return part.lower()
    stem = rel.stem
    for token in re.split(r"[-._ 0-9]+", stem):
        if token.lower() in KNOWN:
            return token.lower()
    return stem


def _glob(root: Path, pattern: str) -> list[Path]:
    return [Path(p) for p in glob_lib.glob(str(root / pattern), recursive=True)
            if p.endswith(".parquet") and Path(p).is_file()]


def _readme_splits(root: Path, subset: str | None) -> list[tuple[str, list[str]]] | None:
    """The ``configs:`` block of a dataset card (README.md's YAML header): [(split, patterns)] of
    the config named ``subset`` (or the default / first one); None when the card declares none."""
    readme = root / "README.md"
    if not readme.is_file():
        return None
    text = readme.read_text(errors="replace")
    if not text.startswith("---"):
        return None
    header = text[3:].split("\n---", 1)[0]
    try:
        import yaml

        card = yaml.safe_load(header) or {}
    except Exception:
        return None
    configs = card.get("configs") if isinstance(card, dict) else None
    if not isinstance(configs, list) or not configs:
        return None
    chosen = [c for c in configs if isinstance(c, dict) and c.get("config_name") == subset]
    if subset and not chosen:
        return None  # a sub-folder rather than a config name
    chosen = chosen or [c for c in configs if isinstance(c, dict) and c.get("default")] or configs
    data_files = chosen[0].get("data_files") if isinstance(chosen[0], dict) else None
    if isinstance(data_files, (str, list)) and not (isinstance(data_files, list) and data_files
                                                   and isinstance(data_files[0], dict)):
        return [("train", [data_files] if isinstance(data_files, str) else list(data_files))]
    if not isinstance(data_files, list):
        return None
    out = []
    for entry in data_files:
        if isinstance(entry, dict) and "split" in entry and "path" in entry:
            paths = entry["path"]
            out.append((str(entry["split"]), [paths] if isinstance(paths, str) else list(paths)))
    return out or None
