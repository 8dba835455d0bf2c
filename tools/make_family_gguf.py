#!/usr/bin/env python3
"""GGUF files of the tiny random family models (tests/data/models/tiny-*/), written by llama.cpp's own
converter, so the tests load each family as llama.cpp names, orders and shifts its tensors (Gemma's norms
stored as 1 + w, Phi-3's fused qkv and gate/up, LongRoPE factor tensors, MoE experts stacked into one
ffn_{gate,up,down}_exps tensor per layer, Mixtral written as arch "llama" with its q/k rows permuted) and check
it against the same transformers fixtures as the HF folder.

    /work/venv-torch/bin/python tools/make_family_gguf.py --llama-cpp /work/llama/src [names...]

The tiny models carry the stories260K tokenizer as tokenizer.json only, which the converter cannot read
for these families; its vocabulary is copied from stories260K.gguf instead (the same 512 tokens). Writes
tests/data/models/tiny-<family>/tiny-<family>.f32.gguf.
"""
from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(REPO, "tests", "data", "models")
VOCAB = os.path.join(MODELS, "stories260K", "stories260K.gguf")
NAMES = {"tiny-qwen3": "Qwen3ForCausalLM", "tiny-gemma2": "Gemma2ForCausalLM", "tiny-gemma3": "Gemma3ForCausalLM",
         "tiny-phi3": "Phi3ForCausalLM", "tiny-qwen3moe": "Qwen3MoeForCausalLM", "tiny-mixtral": "MixtralForCausalLM",
         "tiny-olmoe": "OlmoeForCausalLM"}


def copy_vocab(self) -> None:
    """set_vocab for every family: stories260K.gguf's SentencePiece vocabulary and special ids."""
    import gguf
    r = gguf.GGUFReader(VOCAB, "r")

    def field(key):
        return r.get_field(key)

    f = field(gguf.Keys.Tokenizer.LIST)
    self.gguf_writer.add_tokenizer_model("llama")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list([bytes(f.parts[i]) for i in f.data])
    f = field(gguf.Keys.Tokenizer.SCORES)
    self.gguf_writer.add_token_scores([f.parts[i].tolist()[0] for i in f.data])
    f = field(gguf.Keys.Tokenizer.TOKEN_TYPE)
    self.gguf_writer.add_token_types([f.parts[i].tolist()[0] for i in f.data])
    for key, add in ((gguf.Keys.Tokenizer.BOS_ID, self.gguf_writer.add_bos_token_id),
                     (gguf.Keys.Tokenizer.EOS_ID, self.gguf_writer.add_eos_token_id),
                     (gguf.Keys.Tokenizer.UNK_ID, self.gguf_writer.add_unk_token_id)):
        if (f := field(key)) is not None:
            add(f.parts[-1].tolist()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("names", nargs="*", default=list(NAMES))
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(args.llama_cpp, "gguf-py"))
    sys.path.insert(0, args.llama_cpp)
    import convert_hf_to_gguf as conv
    from conversion import load_all_models
    from conversion.base import ModelBase, ModelType
    load_all_models()
    for name in args.names:
        cls = ModelBase.from_model_architecture(NAMES[name], ModelType.TEXT)
        cls.set_vocab = copy_vocab
        folder = os.path.join(MODELS, name)
        out = os.path.join(folder, f"{name}.f32.gguf")
        sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", "f32"]
        conv.main()
        print(f"{name}: {out} ({os.path.getsize(out):,} bytes)")


if __name__ == "__main__":
    main()
