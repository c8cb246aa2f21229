"""The training corpus: the running interpreter's Python standard library.

Every `.py` file under `sysconfig.get_paths()["stdlib"]` (site-packages excluded), read in
sorted order of its path relative to that folder, so the corpus is the same on every
machine with the same Python. A file is in the validation split when the first 8 hex digits
of sha256(relative posix path), read as an integer, are divisible by 50 (about 2% of files);
the split depends on the path only, never on file order or the machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sysconfig
from pathlib import Path

VALIDATION_MODULUS = 50  # 1 file in 50 (~2%) is held out


@dataclasses.dataclass(frozen=True, slots=True)
class SourceFile:
    rel_path: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_validation(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.encode()).hexdigest()
    return int(digest[:8], 16) % VALIDATION_MODULUS == 0


def iter_stdlib_files(root: Path | None = None) -> list[SourceFile]:
    """All stdlib .py files in deterministic order. Undecodable bytes become U+FFFD."""
    root = root or stdlib_root()
    paths = sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    files = []
    for path in paths:
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue  # unreadable file (permissions, broken link): not part of the corpus
        files.append(SourceFile(path.relative_to(root).as_posix(), text))
    return files


def split_files(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not is_validation(f.rel_path)]
    val = [f for f in files if is_validation(f.rel_path)]
    return train, val
