#!/usr/bin/env python3
"""Write a random-weight GGUF file with a real model's shapes, for speed benchmarks of llama.cpp and corelm.

    python tools/make_random_gguf.py --preset olmoe-1b-7b --out /tmp/cm_bench/olmoe-1b-7b-Q4_0.gguf
    python tools/make_random_gguf.py --preset gemma3-1b --type Q4_K --out /tmp/cm_bench/gemma3-1b-Q4_K.gguf

Weight values do not change speed; shapes and block types do. So the file is written straight as GGUF
blocks (no torch, no float intermediate), streamed one tensor at a time: memory stays about one tensor
(the largest is Gemma 3's 262144 x 1152 embedding, 170 MB as Q4_0), whatever the model's size.

- Presets (PRESETS): `olmoe-1b-7b` (arch "olmoe", 64 experts, top 8) and `gemma3-1b` (arch "gemma3", sliding
  window 512 on 5 layers of 6, tied embeddings), with llama.cpp's tensor names and metadata keys.
- `--type` Q4_0 (default), Q8_0 or Q4_K: every 2D/3D matrix, embedding and output included (like
  `llama-quantize --pure`); norms and the MoE router are F32. A row length that is not a multiple of the
  type's block falls back as llama-quantize does (Q4_K -> Q5_0: Gemma 3 1B's 1152-wide rows).
- Blocks are random bytes with sane fp16 scales (weights of about 0.05 RMS), so activations stay finite.
  Norm weights are about 1 (Gemma's GGUF stores 1 + w: also about 1).
- Tokenizer: a synthetic SentencePiece ("llama") vocabulary of exactly the preset's size: <unk> <s> </s>,
  the 256 byte tokens, then printable pieces (common English words and their prefixes, then letter strings),
  scores descending, so text tokenizes into many ordinary tokens. BOS 1, EOS 2, UNK 0, add_bos.
- Deterministic for a given --seed.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import string
import sys
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter, LlamaFileType, MODEL_TENSOR as T
from gguf import TENSOR_NAMES, TokenType

PRESETS = {
    "olmoe-1b-7b": dict(arch="olmoe", layers=16, hidden=2048, heads=16, kv_heads=16, head_dim=128, ffn=1024,
                        experts=64, experts_used=8, vocab=50304, rope_base=10000.0, eps=1e-5, context=4096,
                        tied=False, qk_norm_whole=True),
    "gemma3-1b": dict(arch="gemma3", layers=26, hidden=1152, heads=4, kv_heads=1, head_dim=256, ffn=6912,
                      experts=0, vocab=262144, rope_base=1e6, rope_base_swa=1e4, window=512, swa_pattern=6,
                      eps=1e-6, context=32768, tied=True, post_norms=True),
}
TYPES = {"Q4_0": (Q.Q4_0, LlamaFileType.MOSTLY_Q4_0), "Q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
         "Q4_K": (Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_S)}
FALLBACK = {Q.Q4_K: Q.Q5_0}       # llama-quantize's, for rows that are not a multiple of 256
# fp16 block scale range per type: (code - zero) * d then has an RMS of about 0.05
SCALE = {Q.Q4_0: (0.002, 0.02), Q.Q5_0: (0.001, 0.01), Q.Q8_0: (0.0001, 0.0013), Q.Q4_K: (0.0001, 0.0006)}
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day did "
         "get come made may part over new sound take only little work know place year live me back give most very "
         "after thing our just name good sentence man think say great where help through much before line right "
         "too mean old any same tell boy follow came want show also around form three small set put end does "
         "another well large must big even such because turn here why ask went men read need land different home "
         "us move try kind hand picture again change off play spell air away animal house point page letter "
         "mother answer found study still learn should world model token speed bench memory compute").split()


def tensor_plan(p: dict) -> list:
    """(name, numpy shape: GGUF's dims reversed, kind: "norm" | "f32" | "matrix") in file order."""
    def name(t, bid=None):
        return TENSOR_NAMES[t].format(bid=bid) + ".weight"
    h, hd, kv = p["hidden"], p["head_dim"], p["kv_heads"] * p["head_dim"]
    q_out, ffn, vocab = p["heads"] * hd, p["ffn"], p["vocab"]
    plan = [(name(T.TOKEN_EMBD), (vocab, h), "matrix")]
    for i in range(p["layers"]):
        qk_norm = (q_out, kv) if p.get("qk_norm_whole") else (hd, hd)
        plan += [(name(T.ATTN_NORM, i), (h,), "norm"),
                 (name(T.ATTN_Q, i), (q_out, h), "matrix"), (name(T.ATTN_K, i), (kv, h), "matrix"),
                 (name(T.ATTN_V, i), (kv, h), "matrix"), (name(T.ATTN_OUT, i), (h, q_out), "matrix"),
                 (name(T.ATTN_Q_NORM, i), (qk_norm[0],), "norm"), (name(T.ATTN_K_NORM, i), (qk_norm[1],), "norm"),
                 (name(T.FFN_NORM, i), (h,), "norm")]
        if p.get("post_norms"):
            plan += [(name(T.ATTN_POST_NORM, i), (h,), "norm"), (name(T.FFN_POST_NORM, i), (h,), "norm")]
        if p["experts"]:
            e = p["experts"]
            plan += [(name(T.FFN_GATE_INP, i), (e, h), "f32"),
                     (name(T.FFN_GATE_EXP, i), (e, ffn, h), "matrix"), (name(T.FFN_UP_EXP, i), (e, ffn, h), "matrix"),
                     (name(T.FFN_DOWN_EXP, i), (e, h, ffn), "matrix")]
        else:
            plan += [(name(T.FFN_GATE, i), (ffn, h), "matrix"), (name(T.FFN_UP, i), (ffn, h), "matrix"),
                     (name(T.FFN_DOWN, i), (h, ffn), "matrix")]
    plan.append((name(T.OUTPUT_NORM), (h,), "norm"))
    if not p["tied"]:
        plan.append((name(T.OUTPUT), (vocab, h), "matrix"))
    return plan


def block_type(shape: tuple, qtype: Q) -> Q:
    """The matrix's type: `qtype`, or its fallback when the row length is not a multiple of its block."""
    for t in (qtype, FALLBACK.get(qtype)):
        if t is not None and shape[-1] % GGML_QUANT_SIZES[t][0] == 0:
            return t
    raise ValueError(f"row length {shape[-1]} fits no block of {qtype.name}")


def byte_shape(shape: tuple, qtype: Q) -> tuple:
    block, size = GGML_QUANT_SIZES[qtype]
    return (*shape[:-1], shape[-1] // block * size)


def random_blocks(rng: np.random.Generator, shape: tuple, qtype: Q) -> np.ndarray:
    """Random codes with fp16 scales in SCALE[qtype] (Q4_K: d there, dmin about 7.5 d; 6-bit scales random)."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = math.prod(shape) // block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    lo, hi = SCALE[qtype]
    d = (lo + (hi - lo) * rng.random(n, dtype=np.float32)).astype("<f2")
    raw[:, 0:2] = d.view(np.uint8).reshape(n, 2)
    if qtype == Q.Q4_K:   # dmin: the mins (6-bit, about 32) times dmin offset the codes (about 7.5) times d scale
        dmin = (d.astype(np.float32) * (7.5 * (0.5 + rng.random(n, dtype=np.float32)))).astype("<f2")
        raw[:, 2:4] = dmin.view(np.uint8).reshape(n, 2)
    return raw.reshape(byte_shape(shape, qtype))


def f32_tensor(rng: np.random.Generator, shape: tuple, kind: str) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32)
    return (1.0 + 0.02 * x) if kind == "norm" else 0.02 * x


def vocabulary(size: int) -> tuple[list, list, list]:
    """(tokens, scores, token types): specials, byte tokens, then printable pieces, scores descending."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    pieces = dict.fromkeys(["\u2581"] + list(string.digits + string.ascii_letters + string.punctuation) +
                           ["\u2581" + c for c in string.ascii_letters + string.digits])
    for w in WORDS:     # every prefix too, so SentencePiece's merges reach the whole word
        pieces.update(dict.fromkeys("\u2581" + w[:k] for k in range(1, len(w) + 1)))
        pieces.update(dict.fromkeys(w[:k] for k in range(2, len(w) + 1)))
    for n in itertools.count(2):
        if len(pieces) >= size - len(tokens):
            break
        for letters in itertools.product(string.ascii_lowercase, repeat=n):
            s = "".join(letters)
            pieces.update(dict.fromkeys(("\u2581" + s, s)))
            if len(pieces) >= size - len(tokens):
                break
    tokens += list(pieces)[:size - len(tokens)]
    types += [TokenType.NORMAL] * (size - len(types))
    scores = [0.0] * 259 + [-float(i) for i in range(size - 259)]
    return tokens, scores, [int(t) for t in types]


def add_metadata(w: GGUFWriter, preset: str, p: dict, ftype: LlamaFileType) -> None:
    w.add_name(f"random {preset}")
    w.add_file_type(int(ftype))
    w.add_quantization_version(2)
    w.add_context_length(p["context"])
    w.add_embedding_length(p["hidden"])
    w.add_block_count(p["layers"])
    w.add_feed_forward_length(p["ffn"])
    w.add_head_count(p["heads"])
    w.add_head_count_kv(p["kv_heads"])
    w.add_key_length(p["head_dim"])
    w.add_value_length(p["head_dim"])
    w.add_rope_freq_base(p["rope_base"])
    w.add_layer_norm_rms_eps(p["eps"])
    if p["experts"]:
        w.add_expert_count(p["experts"])
        w.add_expert_used_count(p["experts_used"])
    if p.get("window"):
        w.add_sliding_window(p["window"])
        w.add_sliding_window_pattern(p["swa_pattern"])
        w.add_rope_freq_base_swa(p["rope_base_swa"])
    tokens, scores, types = vocabulary(p["vocab"])
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


def write_model(preset: str, type_name: str, out: str, seed: int) -> None:
    p = PRESETS[preset]
    qtype, ftype = TYPES[type_name]
    plan = tensor_plan(p)
    w = GGUFWriter(out, p["arch"])
    add_metadata(w, preset, p, ftype)
    for name, shape, kind in plan:          # tensor infos first: the header lists every tensor's offset
        if kind == "matrix":
            t = block_type(shape, qtype)
            bshape = byte_shape(shape, t)
            w.add_tensor_info(name, bshape, np.dtype(np.uint8), math.prod(bshape), raw_dtype=t)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * math.prod(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for i, (name, shape, kind) in enumerate(plan):  # then the data, one tensor in memory at a time
        data = (random_blocks(rng, shape, block_type(shape, qtype)) if kind == "matrix"
                else f32_tensor(rng, shape, kind))
        w.write_tensor_data(data)
        if (i + 1) % 50 == 0:
            print(f"  {i + 1}/{len(plan)} tensors", file=sys.stderr, flush=True)
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--type", choices=sorted(TYPES), default="Q4_0", help="block type of the matrices")
    ap.add_argument("--out", required=True, help="the .gguf file to write")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    t0 = time.time()
    write_model(a.preset, a.type, a.out, a.seed)
    print(f"{a.out}: {os.path.getsize(a.out) / 2**30:.2f} GiB in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
