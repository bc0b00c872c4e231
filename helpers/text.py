"""Real text for the GPT, with nothing to download: byte-level tokens from a corpus every Python install carries.

The corpus is the topic pages of Python's own reference documentation (``pydoc_data.topics``: the text behind
``help("assert")`` and friends), ~0.46 MB of English prose and code, in every CPython (python.org, Debian's
``libpython3.X-stdlib``, conda, Colab, Kaggle). Its bytes are the same for every learner on the same Python minor
version (``corpus_info`` says which, with a sha256, so two learners can compare). Tokens are the UTF-8 bytes
(vocabulary 256): no tokenizer to install, and any text file can stand in (``COURSE_CORPUS=/path/to/file.txt``).

Introduced in notebooks/09-memory.ipynb; used by 10-11, 16-19, the capstone (21-22) and 23-25.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch

VOCAB_SIZE = 256  # one token per byte value


class CorpusMissing(RuntimeError):
    """The corpus could not be read, or is empty; the message names where it looked and the fix.

    Introduced in notebooks/09-memory.ipynb.
    """


def _stdlib_topics() -> tuple[bytes, str]:
    try:
        from pydoc_data import topics
    except ImportError as e:
        raise CorpusMissing(
            f"no corpus: Python's reference topics (pydoc_data.topics) are not installed in {sys.prefix} ({e}). "
            "Fix: install your Python's full standard library (Debian/Ubuntu: `apt install "
            f"libpython3.{sys.version_info.minor}-stdlib`), or point COURSE_CORPUS at any UTF-8 text file "
            "of at least a few hundred kB."
        ) from None
    # sorted by topic name: the same bytes whatever order the dict was written in
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return text.encode("utf-8"), f"pydoc_data.topics of Python {version} ({topics.__file__})"


def load_corpus(path: str | os.PathLike | None = None) -> tuple[bytes, str]:
    """The corpus's bytes and where they came from: ``path``, else $COURSE_CORPUS, else Python's reference topics.

    Raises CorpusMissing (naming the place it looked and the fix) when the file is missing or empty.
    Introduced in notebooks/09-memory.ipynb.
    """
    path = path if path is not None else os.environ.get("COURSE_CORPUS") or None
    if path is None:
        data, where = _stdlib_topics()
    else:
        p = Path(path).expanduser()
        if not p.is_file():
            raise CorpusMissing(
                f"no corpus at {p} (from {'COURSE_CORPUS' if path == os.environ.get('COURSE_CORPUS') else 'path='}): "
                "no such file. Fix: point it at an existing UTF-8 text file, or unset COURSE_CORPUS to use "
                "Python's own reference documentation."
            )
        data, where = p.read_bytes(), str(p)
    if len(data) == 0:
        raise CorpusMissing(f"the corpus at {where} is empty. Fix: use a text file of at least a few hundred kB, "
                            "or unset COURSE_CORPUS to use Python's own reference documentation.")
    return data, where


def corpus_info(data: bytes, where: str) -> str:
    """One line a learner can compare with another's: size, sha256 prefix, source.

    Introduced in notebooks/09-memory.ipynb.
    """
    return f"{len(data):,} bytes, sha256 {hashlib.sha256(data).hexdigest()[:12]}, from {where}"


def decode(tokens) -> str:
    """Bytes back to text (a cut in the middle of a UTF-8 character shows as �).

    Introduced in notebooks/09-memory.ipynb.
    """
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def encode(text: str) -> torch.Tensor:
    """Text to byte tokens (UTF-8), int64: decode's inverse.

    09 writes it on its page (``torch.tensor(list(b"The "))``).
    Machinery behind decode's round-trip test; no notebook calls it directly.
    """
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


# ---- exported from notebooks/09-memory.ipynb: edit it there, then run `make export` ----
def byte_splits(data: bytes, held_out: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) token tensors (uint8 → int64): the last ``held_out`` share of the bytes is held out.

    Introduced in notebooks/09-memory.ipynb.
    """
    if not 0 < held_out < 1:
        raise ValueError(f"held_out={held_out}: a share strictly between 0 and 1")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()  # a token per byte
    n = int(len(tokens) * (1 - held_out))
    return tokens[:n], tokens[n:]


def random_windows(tokens: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator | None = None):
    """A batch of (input, target) windows: ``batch`` random starts, targets shifted by one byte.

    Introduced in notebooks/09-memory.ipynb.
    """
    if len(tokens) <= seq_len + 1:
        raise ValueError(f"{len(tokens)} tokens cannot hold a window of {seq_len} + 1")
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=generator)
    w = tokens[starts[:, None] + torch.arange(seq_len + 1)]  # batch rows of seq_len + 1 consecutive bytes
    return w[:, :-1], w[:, 1:]
# ---- end of export from notebooks/09-memory.ipynb ----
