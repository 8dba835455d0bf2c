"""What the commands share on the terminal: which exceptions are the user's to fix (printed as
"error: ..." with status 1, never a traceback), closing an engine stream, the speed line, and text
streams that survive characters the terminal cannot encode."""
from __future__ import annotations

import sys
from typing import Any, Dict

from ... import ModelLoadError

# Exceptions a user can cause with their input; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, ModelLoadError, OSError)


def close_stream(stream) -> None:
    """Closing the engine's generator stops generation now, not whenever it is garbage-collected."""
    close = getattr(stream, "close", None)
    if close is not None:
        close()


def _rate(tokens: float, seconds: float) -> str:
    return f"{tokens / seconds:.1f}" if seconds > 0 else "-"


def format_stats(m: Dict[str, Any]) -> str:
    """'prompt: N tokens, X tok/s | generation: M tokens, Y tok/s'. Tokens reused from the KV cache
    are not read again, so the prompt rate counts only the ones that were."""
    pt, cached = int(m.get("prompt_tokens", 0)), int(m.get("cached_prompt_tokens", 0) or 0)
    gt = int(m.get("generated_tokens", 0))
    prompt = f"prompt: {pt} tokens"
    if cached:
        prompt += f" ({cached} cached)"
    out = (f"{prompt}, {_rate(pt - cached, m.get('prompt_time_s', 0.0))} tok/s | "
           f"generation: {gt} tokens, {_rate(gt, m.get('generation_time_s', 0.0))} tok/s")
    if "draft_tokens" in m:   # speculative decoding
        d, a = int(m["draft_tokens"]), int(m.get("accepted_tokens", 0))
        out += f" | draft: {a} of {d} accepted" + (f" ({100 * a / d:.0f}%)" if d else "")
    return out


def print_stats(llm) -> None:
    print(format_stats(getattr(llm, "last_metrics", None) or {}), file=sys.stderr, flush=True)


def tolerant_text_streams() -> None:
    """Model text or piped input that the terminal's encoding cannot carry is replaced, not fatal."""
    for stream in (sys.stdout, sys.stderr, sys.stdin):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="replace")
            except (ValueError, OSError):
                pass
