"""How the console decodes a table's tokens: the table's ``metadata.tokenizer``.

Two forms (docs/console.md#tokenizers):

- ``MODULE:CALLABLE``: ``CALLABLE()`` returns an object with ``decode(ids) -> str``
  (``expstore_rl.tokenizer:CharTokenizer``). Only modules the console was started with
  (``--tokenizer-module``; by default ``expstore_rl.tokenizer``) are imported: metadata is
  written by whoever creates tables, and importing or calling whatever it names would
  let them run code in the console.
- ``hf:DIR``: a Hugging Face tokenizer saved in directory DIR on the console's machine,
  loaded with ``transformers.AutoTokenizer`` from local files only and without remote code.

A tokenizer that cannot be loaded, or an id it cannot decode, is not an error: the
viewer shows ids and says why. Loaded tokenizers are cached (at most ``CACHE``).
"""

from __future__ import annotations

import importlib
import threading
from collections import OrderedDict
from typing import Any, Sequence

DEFAULT_MODULES = ("expstore_rl.tokenizer",)
CACHE = 8
KEY = "tokenizer"  # the table metadata entry


class TokenizerError(Exception):
    """A tokenizer spec the console will not or cannot load."""


class Tokenizers:
    def __init__(self, modules: Sequence[str] = DEFAULT_MODULES) -> None:
        self.modules = tuple(modules)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()

    def get(self, spec: str) -> Any:
        """The decoder ``spec`` names (TokenizerError saying why not)."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        tok = self._load(spec)
        with self._lock:
            self._cache[spec] = tok
            while len(self._cache) > CACHE:
                self._cache.popitem(last=False)
        return tok

    def _load(self, spec: str) -> Any:
        if spec.startswith("hf:"):
            return _hf(spec[3:])
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise TokenizerError(f"{spec!r} is neither MODULE:CALLABLE nor hf:DIR")
        if module_name not in self.modules:
            raise TokenizerError(f"module {module_name!r} is not one the console may import "
                                 f"(--tokenizer-module; allowed: {', '.join(self.modules) or 'none'})")
        try:
            factory = getattr(importlib.import_module(module_name), attr, None)
        except ImportError as e:
            raise TokenizerError(f"cannot import {module_name}: {e}") from None
        if not callable(factory):
            raise TokenizerError(f"{module_name} has no callable {attr!r}")
        try:
            tok = factory()
        except Exception as e:
            raise TokenizerError(f"{spec}() raised {type(e).__name__}: {e}") from None
        if not callable(getattr(tok, "decode", None)):
            raise TokenizerError(f"{spec}() has no decode(ids) method")
        return tok


def _hf(directory: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenizerError("hf: tokenizers need the transformers package") from None
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # OSError for a missing dir, ValueError for an unknown format, ...
        raise TokenizerError(f"cannot load the Hugging Face tokenizer in {directory!r}: "
                             f"{' '.join(str(e).split())[:300]}") from None


def decode_pieces(tok: Any, ids: Sequence[int]) -> tuple[list[str | None], str | None]:
    """Each id decoded alone (None where the tokenizer refuses it), and the first refusal."""
    pieces: list[str | None] = []
    problem = None
    for i in ids:
        try:
            pieces.append(str(tok.decode([int(i)])))
        except Exception as e:
            pieces.append(None)
            problem = problem or f"{type(e).__name__}: {e}"
    return pieces, problem


def decode_text(tok: Any, ids: Sequence[int]) -> str | None:
    """``ids`` decoded together (what the model wrote), or None if the tokenizer refuses."""
    try:
        return str(tok.decode([int(i) for i in ids]))
    except Exception:
        return None
