"""corelm: a CPU-first LLM inference engine.

    import corelm
    llm = corelm.LLM()                       # the embedded SmolLM2-135M-Instruct, or a path / hub id
    out = llm.generate(["Once upon a time"], corelm.SamplingParams(max_tokens=32, temperature=0))
    print(out[0].outputs[0].text)

The public names are imported lazily so that `corelm.loader`, `corelm.tokenizer` and the CLI's
light commands do not pay for loading the C++ core.
"""
__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "StreamChunk",
           "TextPrompt", "TokensPrompt", "StructuredOutputsParams", "LoRARequest", "PoolingParams", "EmbeddingRequestOutput",
           "ScoringRequestOutput",
           "ModelLoadError", "__version__"]


def __getattr__(name):
    if name in ("LLM", "RequestOutput", "CompletionOutput", "Logprob", "EmbeddingRequestOutput", "ScoringRequestOutput"):
        from . import llm
        return getattr(llm, name)
    if name in ("LLMEngine", "SamplingParams", "StreamChunk", "TextPrompt", "TokensPrompt"):
        from . import engine
        return getattr(engine, name)
    if name == "LoRARequest":
        from .engine.lora import LoRARequest
        return LoRARequest
    if name == "PoolingParams":
        from .engine.pooling import PoolingParams
        return PoolingParams
    if name == "StructuredOutputsParams":
        from .engine.sampling import StructuredOutputsParams
        return StructuredOutputsParams
    if name == "ModelLoadError":
        from .errors import ModelLoadError
        return ModelLoadError
    raise AttributeError(f"module 'corelm' has no attribute {name!r}")
