"""The engine: LLMEngine (requests in, text chunks out) over the scheduler (continuous batching on a
paged KV cache), per-request sequences (sampling, stop conditions, UTF-8-safe text) and the builder
of the C++ model. Entry points (cli, server, batch) import this package alone and never reach past it:
what they need beyond LLMEngine (machine facts, CPU placement, model files) is exported here."""
from .guided import StructuredOutputsParams  # noqa: F401
from .kv_blocks import block_hashes, check_prompt_fits  # noqa: F401
from .lora import LoRARequest  # noqa: F401
from .llm_engine import LLMEngine, TextPrompt, TokensPrompt, default_model_path, served_model_name  # noqa: F401
from .model_builder import check_kv_sparsity  # noqa: F401
from .models import (cached_models, convert_model, download_model, hub_cache_dir, local_model_path,  # noqa: F401
                     model_tokenizer, sparsity_summary)
from .placement import allowed_cpus, split_cpus  # noqa: F401
from .sampling import SamplingParams  # noqa: F401
from .sequence import StreamChunk  # noqa: F401
from .system import model_info, numa_split, system_info  # noqa: F401
