"""`corelm batch`: OpenAI Batch JSONL files through N worker processes (or Ray actors).

    from corelm.entrypoints.batch import run_batch
    summary = run_batch("in.jsonl", "out.jsonl", workers=2)

Each input line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}`; each output line is `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`. Results are appended as they finish; a rerun skips custom_ids already in the
output. See runner.py for the process model and protocol.py for the line format.
"""
from .protocol import BatchLineError, parse_line  # noqa: F401
from ...engine import split_cpus  # noqa: F401
from .runner import run_batch  # noqa: F401
