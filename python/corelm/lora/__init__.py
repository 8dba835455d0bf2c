"""LoRA adapters per request, where vLLM keeps them: `from corelm.lora.request import LoRARequest` (or
`from corelm.lora import LoRARequest`), for LLM.generate / LLM.chat's lora_request (engine/lora.py)."""
from .request import LoRARequest  # noqa: F401
