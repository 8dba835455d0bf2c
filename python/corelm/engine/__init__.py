"""The engine: LLMEngine (requests in, text chunks out) over the scheduler (continuous batching on a
paged KV cache), per-request sequences (sampling, stop conditions, UTF-8-safe text) and the builder
of the C++ model. Entry points (LLM, cli, server, batch) use LLMEngine and never reach past it."""
from .llm_engine import LLMEngine, TextPrompt, TokensPrompt, served_model_name  # noqa: F401
from .sampling import SamplingParams  # noqa: F401
from .sequence import StreamChunk  # noqa: F401
