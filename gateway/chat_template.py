"""The model's chat template, rendered so that text from a request stays data.

A special-token string such as "<|im_end|>" typed into a prompt or a message is encoded as
ordinary text, never as the control token: only the chat template's own markers become control
tokens (`prompt_token_ids` is the way to send exact ids). The template is rendered once with
each message's content replaced by a stand-in, the output is cut at the stand-ins and at the
template's special tokens, and each run of text between two special tokens is encoded with
special tokens left unparsed. apply_chat_template encodes the same runs, since the tokenizer
splits at special tokens before anything else, so ordinary content gets the ids it gives
(`ChatTemplate.check` proves it at start on a probe conversation).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence

from kvmesh.gateway.tools import ToolRequest, tool_schemas

# an ordinary conversation rendered once at start: the template must show each content exactly
# once and the split tokenization must give apply_chat_template's ids for it
_PROBE_CONVERSATION = (
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Spain?"},
)


def text_token_ids(tokenizer, text: str) -> list[int]:
    """Ids of text from a request; a special-token string in it becomes ordinary tokens."""
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


class ChatTemplate:
    """A tokenizer's chat template (transformers' `apply_chat_template`), whose own markers are
    the only control tokens of a conversation it renders. `model_name` names it in errors."""

    def __init__(self, tokenizer, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        # message i's content renders as f"{mark}{i}z": letters and digits, which templates
        # pass through unchanged; random, so no template's own text contains it
        self._content_mark = "kvmesh" + secrets.token_hex(8)
        self._content_mark_re = re.compile(re.escape(self._content_mark) + r"(\d+)z")
        # the special added tokens, matched as the tokenizer matches them (longest first,
        # single_word ones only between non-word characters)
        self._markers = {t.content: (i, t) for i, t in sorted(tokenizer.added_tokens_decoder.items()) if t.special}
        alternatives = [
            rf"(?<!\w){re.escape(content)}(?!\w)" if t.single_word else re.escape(content)
            for content, (_, t) in sorted(self._markers.items(), key=lambda kv: -len(kv[0]))
        ]
        self._marker_re = re.compile("(" + "|".join(alternatives) + ")") if alternatives else None

    @property
    def renders_tools(self) -> bool:
        """The chat template renders a `tools` list (it names the variable)."""
        return "tools" in (self.tokenizer.chat_template or "")

    def check_tools_text(self, tools: ToolRequest) -> None:
        """ValueError when a tool's text holds a special token's text: the template renders tools
        as its own text, where such a string would become the control token."""
        if self._marker_re is None:
            return
        found = self._marker_re.search(json.dumps(tool_schemas(tools), ensure_ascii=False))
        if found:
            raise ValueError(f"tools must not hold the special token {found.group(0)!r}: remove it from the tool")

    def token_ids(self, conversation: Sequence[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
        """Ids of the conversation ({"role", "content"} dicts) through the chat template, where
        only the template's own markers are control tokens: a special-token string inside a
        message's content is text. `tools`: OpenAI's list of function tools, for a template that
        renders them. Raises ValueError when the template does not show each content exactly
        once and in order for this conversation.
        """
        pieces = self._render(conversation, tools)
        ids: list[int] = []
        run: list[str] = []  # text since the last marker
        strip_next = False  # the last marker has rstrip: it takes the whitespace after it
        for k, piece in enumerate(pieces):
            if k % 2:
                run.append(conversation[int(piece)]["content"])
                continue
            parts = self._marker_re.split(piece) if self._marker_re else [piece]
            for j, part in enumerate(parts):
                if not j % 2:
                    run.append(part)
                    continue
                marker_id, marker = self._markers[part]
                text = "".join(run)
                text = text.rstrip() if marker.lstrip else text
                ids += text_token_ids(self.tokenizer, text.lstrip() if strip_next else text)
                ids.append(marker_id)
                run, strip_next = [], marker.rstrip
        text = "".join(run)
        return ids + text_token_ids(self.tokenizer, text.lstrip() if strip_next else text)

    def _render(self, conversation: Sequence[dict[str, str]], tools: list[dict] | None) -> list[str]:
        """The template's text with each content's stand-in cut out: [template, i, template, j,
        ..., template], message indexes at the odd places. ValueError when they are not 0, 1, ...
        in order (a content dropped, repeated, reordered or rewritten)."""
        stand_ins = [{**m, "content": f"{self._content_mark}{i}z"} for i, m in enumerate(conversation)]
        rendered = self.tokenizer.apply_chat_template(
            stand_ins, add_generation_prompt=True, tokenize=False, **({"tools": tools} if tools else {})
        )
        pieces = self._content_mark_re.split(rendered)
        if [int(i) for i in pieces[1::2]] != list(range(len(conversation))):
            raise ValueError(
                f"the chat template of model {self.model_name!r} does not show each message's "
                f"content exactly once and in order for roles {[m['role'] for m in conversation]}; "
                f"send a plain prompt or prompt_token_ids"
            )
        return pieces

    def _template_token_ids(self, conversation: Sequence[dict[str, str]]) -> list[int]:
        """apply_chat_template's own ids, special-token strings in content parsed as control tokens."""
        ids = self.tokenizer.apply_chat_template(
            list(conversation), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def check(self) -> None:
        """Raises ValueError when the chat template drops, repeats, reorders or rewrites message
        content, or when splitting its output at the content changes the ids of an ordinary
        conversation: a bad template fails at start rather than on every chat request."""
        try:
            split_ids = self.token_ids(_PROBE_CONVERSATION)
        except ValueError:
            raise ValueError(
                f"the chat template of model {self.model_name!r} does not show each message's content "
                f"exactly once and in order, so content cannot be kept apart from control tokens; "
                f"use a template that renders message['content'] as it is"
            ) from None
        template_ids = self._template_token_ids(_PROBE_CONVERSATION)
        if split_ids != template_ids:
            raise ValueError(
                f"tokenizing the chat template of model {self.model_name!r} piece by piece gives "
                f"{split_ids}, not apply_chat_template's {template_ids}, for an ordinary conversation; "
                f"this tokenizer cannot keep message content apart from control tokens"
            )
