"""vLLM's vllm.lora.request.LoRARequest, as corelm.lora.request.LoRARequest."""
from ..engine import LoRARequest  # noqa: F401
