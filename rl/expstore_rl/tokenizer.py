"""A fixed character-level vocabulary for the toy tasks: no downloads, no training.

Special tokens are written literally in text ("<tool>calc 1+2</tool>") and recognised by
``encode``. Producers never re-tokenize what a model generated (token-in, token-out); the
tokenizer only turns prompts and tool observations into ids and ids into text for rewards.
"""

from __future__ import annotations

import re
import string

SPECIALS = ("<pad>", "<bos>", "<eos>", "<tool>", "</tool>", "<obs>", "</obs>")
CHARS = string.digits + "+-*/=() " + string.ascii_lowercase


class CharTokenizer:
    """id 0 <pad>, 1 <bos>, 2 <eos>, 3 <tool>, 4 </tool>, 5 <obs>, 6 </obs>, then CHARS.

    >>> tok = CharTokenizer()
    >>> tok.decode(tok.encode("<tool>calc 12*7</tool>"))
    '<tool>calc 12*7</tool>'
    """

    pieces = SPECIALS + tuple(CHARS)
    vocab_size = len(pieces)  # 51
    pad_id, bos_id, eos_id, tool_id, tool_end_id, obs_id, obs_end_id = range(len(SPECIALS))

    def __init__(self) -> None:
        self._ids = {p: i for i, p in enumerate(self.pieces)}
        self._split = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; raises ValueError on a character outside the vocabulary."""
        ids = []
        for part in self._split.split(text):
            if part in self._ids and part in SPECIALS:
                ids.append(self._ids[part])
                continue
            try:
                ids.extend(self._ids[c] for c in part)
            except KeyError as e:
                raise ValueError(f"character {e.args[0]!r} is not in the CharTokenizer vocabulary") from None
        return ids

    def decode(self, ids) -> str:
        """Text of ``ids``; raises ValueError on an id outside the vocabulary (0-50), e.g.
        a row tokenized by another tokenizer, rather than an IndexError (or, for a
        negative id, a wrong character)."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is not in the CharTokenizer vocabulary (ids 0-{self.vocab_size - 1})")
            out.append(self.pieces[i])
        return "".join(out)
