"""Reasoning models: the thought a chat template asks for (`<think>...</think>`, Qwen3 and DeepSeek-R1 style)
returned apart from the answer, as `reasoning_content`, like vLLM's `--reasoning-parser qwen3` and
llama.cpp's `--reasoning-format deepseek`.

Parsing is on for a model whose chat template mentions `<think>`. The thought is the text between `<think>`
and `</think>`; the opening tag may be the output's first text or the prompt's last (a template that opens
the thought itself). With `chat_template_kwargs={"enable_thinking": false}` Qwen3's template closes an empty
thought in the prompt, the output opens none, and all of it is content. A thought never closed (max_tokens
reached) is all reasoning. Whitespace around the thought is trimmed, as the templates write it back.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from ..engine.thinking import CLOSE, OPEN, PROMPT_TAIL_TOKENS, prompt_opens_thought  # noqa: F401 (the tags, once)

_START, _THINK, _AFTER, _CONTENT = range(4)


def template_thinks(template: Optional[str]) -> bool:
    """Whether a chat template writes thoughts (then the model's output is parsed for them)."""
    return bool(template) and OPEN in template


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: the tag may be split)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    """Splits output text, fed as it streams, into (reasoning, content) pieces. Text that may be part of a
    tag (or whitespace that may end the thought) is held until it is decided or the output ends, so any
    split of the same text gives the same pieces joined, and nothing is lost or sent twice."""

    def __init__(self, in_thought: bool = False):
        self.state = _THINK if in_thought else _START
        self.buf = ""
        self.thought_started = False    # reasoning text seen (its leading whitespace is trimmed)

    def feed(self, text: str, final: bool = False) -> Tuple[str, str]:
        """Adds `text`; returns the (reasoning, content) it decided. `final`: the output ended, flush all."""
        self.buf += text
        reasoning: List[str] = []
        content: List[str] = []
        while True:
            buf = self.buf
            if self.state == _START:
                s = buf.lstrip()
                if s.startswith(OPEN):
                    self.state, self.buf = _THINK, s[len(OPEN):]
                elif not final and OPEN.startswith(s):      # nothing yet, or a part of "<think>"
                    break
                else:
                    self.state = _CONTENT
            elif self.state == _THINK:
                if not self.thought_started:
                    buf = self.buf = buf.lstrip()
                i = buf.find(CLOSE)
                if i >= 0:
                    reasoning.append(buf[:i].rstrip())
                    self.state, self.buf = _AFTER, buf[i + len(CLOSE):]
                    continue
                keep = len(buf) if final else len(buf) - _partial_tail(buf, CLOSE)
                out = buf[:keep] if final else buf[:keep].rstrip()
                if out:
                    self.thought_started = True
                    reasoning.append(out)
                self.buf = buf[len(out):]
                break
            elif self.state == _AFTER:
                self.buf = buf.lstrip()
                if not self.buf and not final:
                    break
                self.state = _CONTENT
            else:
                content.append(buf)
                self.buf = ""
                break
        return "".join(reasoning), "".join(content)


def split_reasoning(text: str, in_thought: bool = False) -> Tuple[str, str]:
    """A whole output -> (reasoning, content)."""
    return ReasoningParser(in_thought).feed(text, final=True)
