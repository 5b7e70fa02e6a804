"""The kestrel-tiny corpus: the Python standard library's own `*.py` source.

Every machine that runs kestrel has it, so training and evaluation need no download. A file is held
out for evaluation when the CRC-32 of its path relative to the stdlib root (POSIX form) is 0 mod 20:
the split of a path never depends on the Python version, the machine or hash randomization.

Only `site-packages` / `dist-packages` (third-party code, different on every machine) are left out.
The stdlib's own test packages stay in: they are ordinary Python and about half the corpus; files that
are not valid UTF-8 (a few deliberate encoding fixtures) are skipped.
"""

from __future__ import annotations

import functools
import sysconfig
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

EVAL_MODULUS = 20
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class SourceFile:
    root: Path
    rel: str  # relative POSIX path, e.g. "json/decoder.py"

    @property
    def path(self) -> Path:
        return self.root / self.rel

    def read(self) -> str | None:
        """The file's text decoded as UTF-8 (newlines untouched), or None when it is not UTF-8."""
        try:
            return self.path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            return None


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def path_hash(rel: str) -> int:
    """A hash of the relative POSIX path that is the same in every process and on every machine."""
    return zlib.crc32(rel.encode("utf-8"))


def is_eval_path(rel: str) -> bool:
    """True when the relative POSIX path belongs to the held-out evaluation split."""
    return path_hash(rel) % EVAL_MODULUS == 0


def all_files(root: Path | None = None) -> list[SourceFile]:
    """Every `*.py` under the stdlib root outside the excluded directories, sorted by relative path."""
    return list(_scan(root if root is not None else stdlib_root()))


@functools.lru_cache(maxsize=4)
def _scan(base: Path) -> tuple[SourceFile, ...]:
    found = []
    for path in base.rglob("*.py"):
        rel = path.relative_to(base)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        found.append(SourceFile(base, rel.as_posix()))
    return tuple(sorted(found, key=lambda f: f.rel))


def train_files(root: Path | None = None) -> list[SourceFile]:
    return [f for f in all_files(root) if not is_eval_path(f.rel)]


def eval_files(root: Path | None = None) -> list[SourceFile]:
    return [f for f in all_files(root) if is_eval_path(f.rel)]


def select_evenly(files: list[SourceFile], count: int | None) -> list[SourceFile]:
    """At most `count` files spread evenly over the sorted list (all of them when count is None)."""
    if count is None or count >= len(files):
        return list(files)
    if count <= 0:
        return []
    return [files[i * len(files) // count] for i in range(count)]


def iter_texts(files: list[SourceFile]) -> Iterator[tuple[SourceFile, str]]:
    """(file, text) for each file that decodes as UTF-8 and is not empty, in the given order."""
    for f in files:
        text = f.read()
        if text:
            yield f, text


def texts(files: list[SourceFile]) -> list[str]:
    return [text for _, text in iter_texts(files)]


def calibration_token_ids(tokenizer, num_samples: int, seq_len: int, source_texts: Iterable[str] | None = None,
                          token_ids: Iterable[int] = ()) -> list[list[int]]:
    """Up to `num_samples` sequences of `seq_len` tokens: `token_ids`, then `source_texts` encoded with
    `tokenizer` (by default training-split files spread evenly: the built-in calibration set of `kestrel quantize`
    and of the accuracy benchmark), until enough tokens are there."""
    ids = list(token_ids)
    if source_texts is None:
        source_texts = texts(select_evenly(train_files(), 4 * num_samples))
    for text in source_texts:
        if len(ids) >= num_samples * seq_len:
            break
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
    return [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)][:num_samples]
