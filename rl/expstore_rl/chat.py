"""How an episode's text becomes token ids: the ``ChatFormat`` the agent loop speaks, and
``HFChat``, the format of a Hugging Face tokenizer with a chat template.

Token-in, token-out: ids are produced in exactly four places, and each piece of text is
encoded once, never decoded and encoded again.

- ``prompt_ids(prompt)``: the first user message (or a list of messages) with the
  template's generation prompt: ``apply_chat_template(..., tokenize=True,
  add_generation_prompt=True)``.
- the engine's output: stored as generated, the stop token that ended a turn included.
- ``observation_ids(text, role, after)``: a tool result (role "tool") or an environment's
  non-final observation (role "user"): the template's framing around it (the end of the
  assistant turn unless ``after``, the turn's last id, already is it; the observation's
  header; its footer; the next assistant header) as ids computed once per role, and the
  text encoded once between them.
- ``turn_ids(text, final)``: an assistant turn as a model would generate it (supervised
  warm-up only).

``decode`` is only for parsing tool calls, for the environment's ``step`` and for
rewards; it leaves special tokens out, so an environment sees "84", not "84<|im_end|>".

The framing comes from rendering, once per role, a conversation with placeholder
contents, ``[user U, assistant A, ROLE O]`` with the generation prompt. The text between
A and O is what closes the assistant turn and opens the observation; the text after O
closes it and opens the next assistant turn. Its first id, when it is a special token
(``<|im_end|>``, ``<|eot_id|>``), is the template's end of turn: generation stops there,
at the tokenizer's eos and at the eos ids of the model's ``generation_config.json``
(Qwen2.5 lists ``<|endoftext|>`` too); after a turn that ended on the end of turn, that
id is not appended again. A template that cannot render a role, or that does not keep
the placeholders in order, is refused with an error naming it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Protocol, Sequence

_USER, _ASSISTANT, _OBSERVATION = "xqUSERxq", "xqASSISTANTxq", "xqOBSERVATIONxq"
"""Placeholder contents: plain words, so templates that strip or escape content keep them."""


class ChatFormat(Protocol):
    """What the agent loop needs of a tokenizer (CharTokenizer and HFChat implement it)."""

    pad_id: int

    def prompt_ids(self, prompt: str | list[dict]) -> list[int]:
        """Ids of the episode's prompt, ending where the policy's first turn begins."""

    def observation_ids(self, text: str, role: str, after: int | None) -> list[int]:
        """Ids appended after an assistant turn: ``text`` as a ``role`` message ("tool"
        or "user") framed by the format; ``after``: the turn's last id (None: empty)."""

    def stop_ids(self, tools: bool) -> tuple[int, ...]:
        """Ids that end a turn (``tools``: the environment has tools)."""

    def turn_ids(self, text: str, final: bool) -> list[int]:
        """An assistant turn as the policy should generate it (for supervised warm-up)."""

    def decode(self, ids) -> str:
        """The text of ``ids`` (HFChat leaves special tokens out; CharTokenizer's are text)."""


class HFChat:
    """The ChatFormat of a Hugging Face tokenizer with a chat template (see the module
    docstring). ``name`` names the tokenizer in errors (its directory); ``stops``: more
    ids that end a turn (the model's generation eos ids)."""

    def __init__(self, tokenizer, name: str = "the tokenizer", stops: Sequence[int] = ()) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{name} has no chat template: the producer needs one to frame prompts and "
                             "observations (docs/rl.md, 'Your own model')")
        self.tokenizer, self.name = tokenizer, name
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos_id or 0)
        self._framing: dict[str, tuple[list[int], list[int]]] = {}
        head, _ = self._frame("user")
        special = set(tokenizer.all_special_ids)
        self.end_of_turn = head[0] if head and head[0] in special else None
        """The template's end-of-turn id (the first id after an assistant message), if special."""
        stops = {i for i in (self.eos_id, self.end_of_turn, *stops) if i is not None}
        if not stops:
            raise ValueError(f"{name}: neither an eos token nor a special end-of-turn token in its chat template; "
                             "generation would never stop")
        self._stops = tuple(sorted(stops))

    @classmethod
    def from_pretrained(cls, path: str) -> "HFChat":
        """The format of the tokenizer saved in the model directory ``path``, stopping also
        at the eos ids of its generation_config.json if it has one (no downloads)."""
        import transformers

        stops: list[int] = []
        if os.path.isfile(os.path.join(path, "generation_config.json")):
            eos = transformers.GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
            stops = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(transformers.AutoTokenizer.from_pretrained(path, local_files_only=True), f"tokenizer of {path}",
                   stops)

    # -- the ChatFormat ---------------------------------------------------------------

    def prompt_ids(self, prompt: str | list[dict]) -> list[int]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return list(self._ids(self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)))

    def observation_ids(self, text: str, role: str, after: int | None) -> list[int]:
        head, tail = self._frame(role)
        if after is not None and after == self.end_of_turn and head[:1] == [after]:
            head = head[1:]  # the turn ended on the template's end of turn
        return head + self.encode(text) + tail

    def stop_ids(self, tools: bool) -> tuple[int, ...]:
        return self._stops

    def turn_ids(self, text: str, final: bool) -> list[int]:
        return self.encode(text) + [self.end_of_turn if self.end_of_turn is not None else self.eos_id]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of plain text (no special tokens added around it)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    # -- framing ----------------------------------------------------------------------

    def _frame(self, role: str) -> tuple[list[int], list[int]]:
        """(ids before, ids after) an observation of ``role``, computed once per role."""
        if role not in self._framing:
            self._framing[role] = self._render_frame(role)
        head, tail = self._framing[role]
        return list(head), list(tail)

    def _render_frame(self, role: str) -> tuple[list[int], list[int]]:
        convo = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT},
                 {"role": role, "content": _OBSERVATION}]
        try:
            text = self.tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja raises anything; the template is the user's
            raise ValueError(f"{self.name}: its chat template cannot render a {role!r} message after an "
                             f"assistant turn: {e}") from None
        a = text.find(_ASSISTANT)
        o = text.find(_OBSERVATION, a + len(_ASSISTANT)) if a >= 0 else -1
        if a < 0 or o < 0:
            raise ValueError(f"{self.name}: its chat template does not render an assistant turn followed by a "
                             f"{role!r} message verbatim, so observations cannot be framed: {text!r}")
        return self.encode(text[a + len(_ASSISTANT):o]), self.encode(text[o + len(_OBSERVATION):])

    @staticmethod
    def _ids(out) -> Sequence[int]:
        """apply_chat_template's ids: a list, or (transformers 5) a BatchEncoding."""
        return out["input_ids"] if isinstance(out, Mapping) else out
