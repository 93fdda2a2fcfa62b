"""A fixed character-level vocabulary for the toy tasks: no downloads, no training.

Special tokens are written literally in text ("<tool>calc 1+2</tool>") and recognised by
``encode``. Producers never re-tokenize what a model generated (token-in, token-out); the
tokenizer only turns prompts and tool observations into ids and ids into text for rewards.
It is the toy model's ``chat.ChatFormat``: a prompt is <bos> and its text, a tool result
is written ``<obs>RESULT</obs>`` (lowercased, characters outside the vocabulary dropped),
a turn ends at <eos>, and, in an environment with tools, at </tool>.
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

    # -- chat.ChatFormat ----------------------------------------------------------------

    def prompt_ids(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise ValueError("CharTokenizer prompts are text; a list of messages needs a chat template (--model)")
        return [self.bos_id] + self.encode(prompt)

    def observation_ids(self, text: str, role: str, after: int | None = None) -> list[int]:
        """A tool result as ``<obs>RESULT</obs>`` in the vocabulary; other text as it is."""
        if role == "tool":
            return self.encode("<obs>" + "".join(c for c in text.lower() if c in CHARS) + "</obs>")
        return self.encode(text)

    def stop_ids(self, tools: bool) -> tuple[int, ...]:
        return (self.eos_id, self.tool_end_id) if tools else (self.eos_id,)

    def turn_ids(self, text: str, final: bool) -> list[int]:
        return self.encode(text) + ([self.eos_id] if final else [])

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
