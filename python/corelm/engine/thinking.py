"""Reasoning models' thoughts, as the engine sees them: the tags a chat template writes around a thought
(`<think>...</think>`, Qwen3 and DeepSeek-R1 style) and the thinking budget (SamplingParams.max_thinking_tokens,
llama.cpp's --reasoning-budget), which ends a thought after so many tokens by forcing the tokens of
END_OF_THOUGHT, so that the model goes on to its answer. corelm.openai.reasoning splits the output text.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

OPEN, CLOSE = "<think>", "</think>"
END_OF_THOUGHT = "\n" + CLOSE + "\n\n"      # what Qwen3's and DeepSeek-R1's templates write after a thought
PROMPT_TAIL_TOKENS = 16     # prompt tokens decoded to see whether the prompt opened a thought

_START, _THINK, _FORCING, _DONE = range(4)


def prompt_opens_thought(prompt_tail: str) -> bool:
    """Whether a rendered prompt (its end) leaves a thought open, so the output starts inside it."""
    i = prompt_tail.rfind(OPEN)
    return i >= 0 and prompt_tail.rfind(CLOSE) < i


class ThinkingBudget:
    """One sequence's thought, followed token by token: it opens where the prompt left one open or where the
    output starts with OPEN; after `budget` tokens inside it without CLOSE, `forced()` names the tokens of
    END_OF_THOUGHT one step at a time; after CLOSE (written or forced) it has nothing more to do."""

    def __init__(self, budget: int, end_ids: Sequence[int], in_thought: bool):
        self.budget = budget
        self.end_ids = list(end_ids)
        self.used = 0                   # tokens inside the thought
        self.text = ""                  # undecided start of the output, or the thought's last characters
        self.pending: List[int] = []    # END_OF_THOUGHT's tokens still to force
        self.state = _START
        if in_thought:
            self._open()

    @classmethod
    def for_prompt(cls, budget: int, tokenizer, prompt_ids: Sequence[int]) -> "ThinkingBudget":
        tail = tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        return cls(budget, tokenizer.encode(END_OF_THOUGHT, add_special_tokens=False), prompt_opens_thought(tail))

    def _open(self) -> None:
        self.state, self.text = _THINK, ""
        if self.budget <= 0:
            self._force()

    def _force(self) -> None:
        self.state, self.pending = _FORCING, list(self.end_ids)
        if not self.pending:
            self.state = _DONE

    def forced(self) -> Optional[int]:
        """The token the next step must take (None: the model chooses)."""
        return self.pending[0] if self.state == _FORCING else None

    def advance(self, token: int, text: str) -> None:
        """After each step: the token taken and the text it completed."""
        if self.state == _FORCING:
            self.pending.pop(0)
            if not self.pending:
                self.state = _DONE
        elif self.state == _START:
            self.text += text
            head = self.text.lstrip()
            if head.startswith(OPEN):
                rest = head[len(OPEN):]
                self._open()
                if rest and self.state == _THINK:
                    self._think(rest)
            elif not OPEN.startswith(head):     # not a thought: the budget has nothing to do
                self.state = _DONE
        elif self.state == _THINK:
            self.used += 1
            self._think(text)

    def _think(self, text: str) -> None:
        self.text += text
        if CLOSE in self.text:
            self.state = _DONE
        elif self.used >= self.budget:
            self._force()
        else:
            self.text = self.text[-(len(CLOSE) - 1):]       # enough to see a CLOSE split across tokens
