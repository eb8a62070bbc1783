"""Chat templates (sandboxed jinja2) and the token-level format of a multi-turn tool conversation.

Token-in/token-out: the ids a policy is trained on must be exactly the ids it was sampled from. So a
conversation is tokenised once as a prompt, and every later turn only appends: the model's own generated ids
(never re-tokenised from text) and the *suffix* ids of the messages that follow them (tool results and the
next generation prompt). The suffix is cut from a render of a short dummy conversation, not the real one,
so its cost does not grow with the conversation and templates that rewrite earlier turns (e.g. dropping
`<think>` blocks) cannot change ids the model has already seen.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from agentrl.chat.unicode import encodable

TEMPLATE_DIR = Path(__file__).with_name("templates")
DEFAULT_TEMPLATE = "chatml_tools"
TOOL_CALL_END = "</tool_call>"
# The tags a tool conversation's template writes around calls and results (Qwen2.5's and agentrl's ChatML).
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Stand-ins for the dummy conversation the suffix is cut from; plain words so no template reshapes them.
_DUMMY_USER = "agentrl dummy question"
_DUMMY_ASSISTANT = "agentrl dummy answer"

__all__ = ["ChatFormat", "render", "select_template", "compile_template", "SecurityError", "TemplateError"]


class _Sandbox(ImmutableSandboxedEnvironment):
    # jinja2's sandbox turns an unsafe attribute into an Undefined that prints as "" and only fails when
    # used further; a template probing internals should fail loudly at the access itself.
    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} is not allowed")


class _GenerationBlock(Extension):
    # Some model templates wrap assistant text in `{% generation %}` (used elsewhere to build masks); our masks
    # come from token positions, so the block just renders its body.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise(message):
    raise TemplateError(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes <, >, & for HTML, which would show the model `\u003c` in schemas.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def compile_template(source: str):
    """A compiled template in the sandbox, with the helpers chat templates expect."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def builtin_template(name: str) -> str:
    path = TEMPLATE_DIR / f"{name}.jinja"
    if not path.is_file():
        known = sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja"))
        raise ValueError(f"unknown chat template {name!r}; built in: {known}")
    return path.read_text()


def supports_tools(source: str | None) -> bool:
    """Whether a template renders tool schemas (its source reads a `tools` variable)."""
    return bool(source) and re.search(r"\btools\b", source) is not None


def select_template(tokenizer, template: str | None = None) -> tuple[str, str]:
    """(source, label): `template` as a built-in name, a .jinja path or jinja source; else the tokenizer's
    own template if it supports tools; else ours."""
    if template is not None:
        if "{{" in template or "{%" in template:
            return template, "custom"
        if template.endswith(".jinja") and Path(template).is_file():
            return Path(template).read_text(), template
        return builtin_template(template), template
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # tokenizers may ship named templates; the tool one is what we need
        own = own.get("tool_use") or own.get("default")
    if isinstance(own, str) and supports_tools(own):
        return own, "tokenizer"
    return builtin_template(DEFAULT_TEMPLATE), DEFAULT_TEMPLATE


def render(source: str, messages: list[dict], tools: list[dict] | None = None, *,
           add_generation_prompt: bool = False, **variables) -> str:
    """Render a template source in the sandbox."""
    return compile_template(source).render(messages=messages, tools=tools or None,
                                           add_generation_prompt=add_generation_prompt, **variables)


class ChatFormat:
    """How one tokenizer + template + tool list turns a conversation into token ids, turn by turn.

    `prompt_ids(messages)` opens a rollout; after the model generates `generated_ids` and its tool calls run,
    `suffix_ids(tool_messages, generated_ids)` are the ids to append before generating again.
    """

    def __init__(self, tokenizer, tools_schema: list[dict] | None = None, template: str | None = None, *,
                 template_kwargs: dict | None = None, eos_token_ids: list[int] | None = None,
                 text_tags: tuple[str, ...] = ()):
        """`text_tags`: strings spelled as ordinary text pieces wherever the rendered text holds them, even where
        the tokenizer has them as added tokens (`model.tool_tags=text`: a model that never emits its tool-call
        tag tokens may still copy the tags written as text)."""
        self.tokenizer = tokenizer
        self._text_tags = {tag: self._text_pieces(tag) for tag in text_tags}
        self._tag_split = re.compile("(" + "|".join(map(re.escape, text_tags)) + ")") if text_tags else None
        self.tools = list(tools_schema or [])
        self.source, self.template_name = select_template(tokenizer, template)
        self.template_kwargs = dict(template_kwargs or {})
        self._compiled = compile_template(self.source)
        self.end_of_turn = self._end_of_turn_text()
        # Only a generated id that *is* the template's end-of-turn text makes re-rendering it redundant; an
        # eos of another kind (e.g. <|endoftext|>) was seen by the model, and the template's close follows it.
        self.end_of_turn_id: int | None = self._single_token(self.end_of_turn)
        ids = list(eos_token_ids) if eos_token_ids is not None else []
        if eos_token_ids is None:
            if tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
            if self.end_of_turn_id is not None and self.end_of_turn_id not in ids:
                ids.append(self.end_of_turn_id)
        self.eos_token_ids: list[int] = ids
        # Stopping right after a call keeps a small model from writing the tool's answer itself; the text
        # form is the reliable one where `</tool_call>` is several BPE pieces that may be sampled differently.
        self.stop_strings: list[str] = [TOOL_CALL_END] if self.tools else []
        self.stop_sequences: list[list[int]] = [self.encode(TOOL_CALL_END)] if self.tools else []

    # ---- rendering ---------------------------------------------------------------------------------

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        tok = self.tokenizer
        variables = {"bos_token": tok.bos_token or "", "eos_token": tok.eos_token or "",
                     "pad_token": tok.pad_token or "", "unk_token": getattr(tok, "unk_token", None) or ""}
        variables.update(self.template_kwargs)
        return self._compiled.render(messages=messages, tools=self.tools or None,
                                     add_generation_prompt=add_generation_prompt, **variables)

    def encode(self, text: str) -> list[int]:
        # The template writes every special token itself (bos included), so the tokenizer must add none. A lone
        # surrogate (from a tool's output, JSON a model wrote, a data file) would make the tokenizer raise.
        text = encodable(text)
        if self._tag_split is None:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        # An added token already splits the text the tokenizer sees, so cutting at the tags changes nothing else.
        ids: list[int] = []
        for part in self._tag_split.split(text):
            if part in self._text_tags:
                ids += self._text_tags[part]
            elif part:
                ids += self.tokenizer.encode(part, add_special_tokens=False)
        return ids

    def decode(self, ids: list[int], *, strip_eos: bool = True) -> str:
        """Text of generated ids with special tokens kept (they carry the tool-call tags), minus a final eos."""
        ids = list(ids)
        while strip_eos and ids and ids[-1] in self.eos_token_ids:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ---- token-in/token-out --------------------------------------------------------------------------

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Ids of the opening conversation, tools included, ending with the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def suffix_text(self, new_messages: list[dict], ended_with_eos: bool) -> str:
        """Text that follows the model's generated text: end of its turn, `new_messages`, next prompt."""
        dummy = self._dummy_prefix()
        text = self.render(dummy + list(new_messages), add_generation_prompt=True)
        at = text.rfind(_DUMMY_ASSISTANT)
        if at == -1:
            raise TemplateError(f"template {self.template_name!r} does not render assistant content verbatim")
        suffix = text[at + len(_DUMMY_ASSISTANT):]
        if ended_with_eos and self.end_of_turn and suffix.startswith(self.end_of_turn):
            suffix = suffix[len(self.end_of_turn):]  # the model already emitted it, as a generated id
        return suffix

    def suffix_ids(self, tool_messages: list[dict], generated_ids: list[int]) -> list[int]:
        """Ids to append after `generated_ids` so the model reads `tool_messages` and answers again.

        Works whether generation ended on the end-of-turn token (already in `generated_ids`, so it is not
        repeated) or stopped on `</tool_call>` / the length limit (the end of the turn is closed here).
        """
        ended = bool(generated_ids) and generated_ids[-1] == self.end_of_turn_id
        return self.encode(self.suffix_text(tool_messages, ended))

    # ---- helpers -------------------------------------------------------------------------------------

    def _dummy_prefix(self) -> list[dict]:
        return [{"role": "user", "content": _DUMMY_USER}, {"role": "assistant", "content": _DUMMY_ASSISTANT}]

    def _end_of_turn_text(self) -> str:
        # What the template writes right after an assistant's content when the conversation ends there, up
        # to the first newline: "<|im_end|>" for ChatML. Found by rendering, so any template works.
        text = self.render(self._dummy_prefix())
        at = text.rfind(_DUMMY_ASSISTANT)
        tail = text[at + len(_DUMMY_ASSISTANT):] if at != -1 else ""
        return tail.split("\n", 1)[0]

    def _text_pieces(self, tag: str) -> list[int]:
        """The ids of `tag` as the tokenizer's BPE spells ordinary text, bypassing its added-token match."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("model.tool_tags=text needs a fast (tokenizers-backed) tokenizer")
        text = backend.normalizer.normalize_str(tag) if backend.normalizer is not None else tag
        words = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
        return [token.id for word, _ in words for token in backend.model.tokenize(word)]

    def _single_token(self, text: str) -> int | None:
        if not text:
            return None
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None
