"""The int8 KV cache (rows Hadamard-rotated, then 8 bits over [min, max] with an fp16 step and lower
bound per token per head) against the fp32 cache: bytes per token, attention error on random models with
awkward head sizes and outlier channels, and 256 greedy tokens on the real test models.

Exact agreement for 256 tokens is not reachable for every prompt: within 256 tokens the fp32-cache
reference has top-2 logit gaps down to 0.002-0.04 on these prompts, below what any 8-bit (or bf16) cache
changes the logits by (see docs/architecture.md). So the greedy tests require identical tokens up to the first such
near-tie, and the logit error to stay well inside what an int8 cache can reach."""
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import DEFAULT_GGUF, FIXTURES, MODELS, core_forward

import corelm
from corelm import SamplingParams, _core
from corelm.engine.model_builder import KV_BLOCK_SIZE, core_config, kv_blocks_for, updated
from corelm.loader.spec import ModelSpec, weight_shapes

STORIES = os.path.join(MODELS, "stories260K")
GREEDY = dict(temperature=0.0, ignore_eos=True)
# (layers, kv heads, head_dim) of the models the cache is sized for
SHAPES = {"qwen2.5-0.5b": (24, 2, 64), "smollm2-135m": (30, 3, 64), "stories260K": (5, 4, 8)}


def tiny_spec(n_layers=1, n_kv_heads=1, head_dim=16, bias=False):
    return ModelSpec(arch="qwen2" if bias else "llama", vocab_size=128, hidden_size=64, intermediate_size=96,
                     num_layers=n_layers, num_heads=2 * n_kv_heads, num_kv_heads=n_kv_heads, head_dim=head_dim,
                     rms_norm_eps=1e-5, rope_theta=1e4, attention_bias=bias)


def core_model(spec, kv_type, max_seq_len=256, kv_blocks=None):
    cfg = core_config(spec, "fp32", 1, max_seq_len, pin_threads=False)
    cfg = updated(cfg, kv_type=kv_type, kv_block_size=KV_BLOCK_SIZE)
    if kv_blocks:
        cfg = updated(cfg, kv_blocks=kv_blocks)
    return _core.Model(cfg)


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_kv_bytes_per_token_about_half_of_bf16(shape):
    layers, kv_heads, hd = SHAPES[shape]
    spec = tiny_spec(layers, kv_heads, hd)
    per_token = {}
    for kv in ("fp32", "bf16", "int8"):
        core = core_model(spec, kv, kv_blocks=4)
        per_token[kv] = core.kv_bytes / (core.kv_blocks * core.kv_block_size)
        # the Python budget uses the same size: a 1 MiB budget holds exactly that many blocks
        assert kv_blocks_for(spec, kv, 64, 1 / 1024) == (1 << 20) // int(per_token[kv] * KV_BLOCK_SIZE)
    rows = layers * kv_heads  # one key row and one value row per layer per kv head
    assert per_token["fp32"] == rows * 2 * hd * 4
    assert per_token["bf16"] == rows * 2 * hd * 2
    assert per_token["int8"] == rows * 2 * (hd + 4)  # int8 values, fp16 step and lower bound
    print(f"{shape}: KV bytes/token fp32 {per_token['fp32']:.0f}, bf16 {per_token['bf16']:.0f}, "
          f"int8 {per_token['int8']:.0f} ({per_token['int8'] / per_token['bf16']:.3f} of bf16)")
    if hd >= 64:
        assert per_token["int8"] / per_token["bf16"] <= 0.54


def random_model(spec, kv_type, seed=3):
    """Random weights with two outlier channels in every key head (as real models have), and biases."""
    m = core_model(spec, kv_type)
    rng = np.random.default_rng(seed)
    hd = spec.head_dim
    for name, shape in weight_shapes(spec).items():
        w = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        if name.endswith("norm"):
            w = w + 1
        if name.endswith(("wk", "bk")):
            w[1::hd] *= 8
            w[hd - 1::hd] *= 4
        m.set_weight(name, w)
    m.finalize()
    return m


@pytest.mark.parametrize("head_dim", [6, 16, 24, 64])
def test_int8_kv_attention_close_to_fp32_on_awkward_shapes(head_dim):
    """head_dim 6 and 24 rotate in blocks of 2 and 8; logits over 150 positions (several KV blocks)."""
    spec = tiny_spec(n_layers=2, n_kv_heads=2, head_dim=head_dim, bias=True)
    tokens = np.random.default_rng(head_dim).integers(0, spec.vocab_size, 150).astype(np.int32)
    logits = {kv: core_forward(random_model(spec, kv), tokens, 0, True) for kv in ("fp32", "bf16", "int8")}
    ref = logits["fp32"].astype(np.float64)
    err = {kv: float(np.sqrt(np.mean((logits[kv] - ref) ** 2) / np.mean(ref ** 2))) for kv in ("bf16", "int8")}
    assert 0 < err["int8"] < 4 * err["bf16"], err  # measured: 1.9-2.9x


def real_models():
    out = [(STORIES, "stories260K", 3)]
    if os.path.isfile(DEFAULT_GGUF):
        out.append((DEFAULT_GGUF, "smollm2", 1))
    return out


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("path,name,n_prompts", real_models(), ids=lambda v: v if isinstance(v, str) and "/" not in v else None)
def test_int8_kv_greedy_256_tokens_follow_fp32(path, name, n_prompts):
    """fp32 weights (SmolLM2's Q4_1 blocks dequantized): the q4 path's own rounding of activations
    makes its prefill and decode logits differ by as much as a bf16 cache does, which would hide the cache's error."""
    with open(os.path.join(FIXTURES, f"{name}.json")) as f:
        prompts = [c["prompt_ids"] for c in json.load(f)["cases"]][:n_prompts]
    llms = {kv: corelm.LLM(path, kv_cache_dtype=kv, threads=2, max_seq_len=512, dtype="fp32") for kv in ("fp32", "int8")}
    params = SamplingParams(max_tokens=256, **GREEDY)
    for prompt in prompts:
        expected = llms["fp32"].generate([prompt], params)[0].outputs[0].token_ids
        ids = np.asarray(prompt + expected[:-1], np.int32)
        tf = {}
        for kv, llm in llms.items():  # logits of every step, teacher-forced on the fp32 tokens
            llm.reset()
            tf[kv] = core_forward(llm.engine.core, ids, 0, True)[len(prompt) - 1:]
            llm.reset()
        assert (tf["fp32"].argmax(axis=1) == expected).all()  # prefill and decode agree, so the gaps are the decode's
        top2 = np.sort(tf["fp32"], axis=1)[:, -2:]
        gaps = top2[:, 1] - top2[:, 0]
        err = np.abs(tf["int8"] - tf["fp32"]).max(axis=1)
        got = llms["int8"].generate([prompt], params)[0].outputs[0].token_ids
        n = first_difference(got, expected)
        print(f"{name}: int8 follows fp32 for {n}/256 tokens (fp32 top-2 gap there {gaps[min(n, 255)]:.4f}, "
              f"smallest {gaps.min():.4f}); |dlogit| median {np.median(err):.4f} max {err.max():.4f}")
        # a bf16 cache makes 0.05-0.07; absmax/127 int8 made 0.28-0.39 (stories260K) and 0.31-0.49 (SmolLM2)
        assert np.median(err) < 0.2
        assert n == len(expected) or gaps[n] < 0.1, (n, gaps[n])


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-mistral", "stories260K"])
def test_bf16_and_int8_kv_follow_fp32_until_a_near_tie(name):
    """Both compressed caches on the fixture models (tiny random ones too): 256 greedy tokens follow the
    fp32-cache tokens until a step where the fp32 logits have a near-tie (top-2 gap < 0.15)."""
    path = os.path.join(MODELS, name)
    llms = {kv: corelm.LLM(path, dtype="fp32", threads=2, kv_cache_dtype=kv, max_seq_len=512)
            for kv in ("fp32", "bf16", "int8")}
    assert llms["int8"].engine.core.kv_type == "int8" and llms["bf16"].engine.core.kv_type == "bf16"
    ref = llms.pop("fp32")
    params = SamplingParams(max_tokens=256, **GREEDY)
    with open(os.path.join(FIXTURES, f"{name}.json")) as f:
        prompts = [c["prompt_ids"] for c in json.load(f)["cases"]]
    for prompt in prompts:
        expected = ref.generate([prompt], params)[0].outputs[0].token_ids
        ref.reset()
        logits = core_forward(ref.engine.core, np.asarray(prompt + expected[:-1], np.int32), 0, True)[len(prompt) - 1:]
        top2 = np.sort(logits, axis=1)[:, -2:]
        gaps = top2[:, 1] - top2[:, 0]
        for kv, llm in llms.items():
            n = first_difference(llm.generate([prompt], params)[0].outputs[0].token_ids, expected)
            assert n == len(expected) or gaps[n] < 0.15, (kv, n, gaps[n])


def test_kv_cache_follows_the_model_precision_by_default():
    """kv_cache_dtype="auto" (the default): fp32 for fp32 matrices, bf16 for bf16 or quantized ones (a
    GGUF's kept blocks included), as vLLM and llama.cpp store it in the model's precision; an explicit
    choice wins."""
    stories = os.path.join(MODELS, "stories260K")
    assert corelm.LLM(stories, dtype="fp32", threads=1).engine.kv_cache_dtype == "fp32"
    for dtype in ("bf16", "q8_0", "q4_0"):
        assert corelm.LLM(stories, dtype=dtype, threads=1).engine.kv_cache_dtype == "bf16"
    assert corelm.LLM(DEFAULT_GGUF, threads=1).engine.kv_cache_dtype == "bf16"      # q4_1+q8_0 blocks kept
    assert corelm.LLM(stories, dtype="q8_0", threads=1, kv_cache_dtype="fp32").engine.kv_cache_dtype == "fp32"
