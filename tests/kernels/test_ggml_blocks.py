"""GGUF block types multiplied as the file stores them (Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS;
cpp/kernels/ggml_formats.h): dequantization bit for bit as gguf.quants, every kernel table against the
scalar reference and against numpy, int8 and int16 activations, row ranges, decode == prefill rows."""
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from corelm import _core  # noqa: E402
from corelm.loader.gguf import _DECODERS  # noqa: E402
from corelm.options import GGUF_BLOCK_FORMATS, WEIGHT_FORMATS  # noqa: E402

TABLES = _core.kernel_tables()
ROW_EXACT_ROWS = 32  # kRowExactRows (kernels.h): up to this many rows, every table gives decode's bits
TYPES = [WEIGHT_FORMATS[n].gguf for n in GGUF_BLOCK_FORMATS]
# offsets of each type's fp16 scale fields (random bytes there could be NaN/Inf or huge): the core's traits rows
F16_FIELDS = {r["ggml"]: tuple(r["f16_fields"]) for r in _core.weight_formats() if r["ggml_block"]}


def block_of(t):
    f = next(f for f in WEIGHT_FORMATS.values() if f.gguf == t)
    return f.block, f.block_bytes


def random_blocks(t, rows, blocks, seed=0, extreme=False):
    """Random raw blocks: every code, scale and high bit byte random; the fp16 scales finite and small
    (extreme: every byte 0xff but the scales, the largest codes and scales each type has)."""
    rng = np.random.default_rng(seed)
    _, bb = block_of(t)
    raw = np.full((rows, blocks, bb), 0xFF, np.uint8) if extreme else rng.integers(0, 256, (rows, blocks, bb), np.uint8)
    for off in F16_FIELDS[t]:
        d = (rng.standard_normal((rows, blocks)) * 0.01).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1)


def reference(t, raw, rows, cols):
    return quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, t)).reshape(rows, cols).astype(np.float32)


def shapes(t):
    be, _ = block_of(t)
    return [(1, be), (7, 2 * be), (13, 3 * be), (37, be * (5 if be == 256 else 28))]  # rows % 8 != 0, odd blocks


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("extreme", [False, True])
def test_dequantize_bit_exact(t, extreme):
    for rows, cols in shapes(t):
        raw = random_blocks(t, rows, cols // block_of(t)[0], seed=rows, extreme=extreme)
        ref = reference(t, raw, rows, cols)
        for isa in TABLES:
            got = _core.testing.kernel_raw_to_f32(isa, raw, t, rows, cols)
            assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (isa, rows, cols)
        flat = _DECODERS[t](raw.reshape(-1), rows * cols).reshape(rows, cols)
        assert np.array_equal(flat.view(np.uint32), ref.view(np.uint32))


def quantized_activations(x, act):
    """x as every matmul takes it: per 32 columns dx = absmax/127 (int8) or /32767 (int16), q = round to
    even of x * (1/dx), in float32 as the kernels compute it; returned dequantized, q * dx."""
    top = np.float32(127 if act == "int8" else 32767)
    b = x.reshape(len(x), -1, 32).astype(np.float32)
    d = (np.abs(b).max(-1, keepdims=True) / top).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.rint((b * inv).astype(np.float32))
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("act", ["int8", "int16"])
def test_matmul_every_table(t, act):
    """Each table gives the dot of the dequantized weights with the quantized activations, up to fp32
    summation (relative to the sum of the terms' magnitudes)."""
    for rows, cols in shapes(t):
        raw = random_blocks(t, rows, cols // block_of(t)[0], seed=cols)
        w = reference(t, raw, rows, cols).astype(np.float64)
        for m in (1, 2, 5, 9):
            x = np.random.default_rng(m).standard_normal((m, cols)).astype(np.float32) * 3
            xq = quantized_activations(x, act)
            want, size = xq @ w.T, np.abs(xq) @ np.abs(w).T + 1e-30
            for isa in TABLES:
                y = _core.testing.kernel_matmul_raw(isa, x, raw, t, rows, cols, act)
                assert np.all(np.abs(y - want) / size < 1e-5), (isa, rows, cols, m)


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("extreme", [False, True])
def test_row_ranges_and_batch_invariance(t, extreme):
    """A thread's [n0, n1) writes only those rows, and a token's outputs are the same bits alone
    (decode, whose int16 path multiplies other instructions) as among others (prefill). extreme: the
    largest codes and scales against activations at +-32767 (every integer sum at its largest). 75 rows:
    two whole 32-row super-groups (a small batch streams each in one pass) and a partial one; 5, 7 and
    35 tokens: a small batch in tiles of 3 + 2 and 4 + 3 rows, and a prompt's tiles (kRowExactRows,
    kernels.h)."""
    be, _ = block_of(t)
    cols = 4 * be
    for rows, tokens, lo, hi in ((29, 7, 5, 18), (75, 7, 5, 70), (75, 5, 5, 70), (75, 35, 32, 64)):
        raw = random_blocks(t, rows, 4, seed=3, extreme=extreme)
        x = np.random.default_rng(0).standard_normal((tokens, cols)).astype(np.float32)
        if extreme:
            x[0], x[1], x[2] = 1, -1, np.where(np.arange(cols) % 3 == 0, 1, -1)
        for isa in TABLES:
            for act in ("int8", "int16"):
                full = _core.testing.kernel_matmul_raw(isa, x, raw, t, rows, cols, act)
                part = _core.testing.kernel_matmul_raw(isa, x, raw, t, rows, cols, act, lo, hi)
                assert np.all(part[:, :lo] == 0) and np.all(part[:, hi:] == 0)
                assert np.array_equal(part[:, lo:hi], full[:, lo:hi]), isa
                if tokens > ROW_EXACT_ROWS and isa.startswith("amx"):
                    continue  # a prompt of more rows runs on the tiles, in bf16
                for i in range(len(x)):
                    alone = _core.testing.kernel_matmul_raw(isa, x[i:i + 1], raw, t, rows, cols, act)
                    assert np.array_equal(alone[0], full[i]), (isa, act, rows, i)


def test_bad_raw_buffers_are_refused():
    raw = random_blocks("Q4_K", 2, 1)
    with pytest.raises(ValueError, match="multiple of 256"):
        _core.testing.kernel_matmul_raw("scalar", np.zeros((1, 128), np.float32), raw[:, :72], "Q4_K", 2, 128)
    with pytest.raises(ValueError, match="bytes"):
        _core.dequantize_gguf("Q6_K", np.zeros(209, np.uint8), 256)
    with pytest.raises(ValueError, match="GGUF type"):
        _core.dequantize_gguf("Q8_K", np.zeros(292, np.uint8), 256)


# ---------------------------------------------------------------------------------------------------
# A whole model of mixed GGUF types, through the engine: q, k and v of three types (stacked), gate and up
# of one type (fused) and of two (converted), every type somewhere, the embedding and lm_head too.

LAYER_TYPES = [  # (attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down)
    ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "IQ4_XS", "IQ4_XS", "Q2_K"),
    ("Q5_0", "Q5_0", "Q5_0", "IQ4_NL", "Q4_K", "Q6_K", "Q5_K"),
    ("Q5_1", "Q5_1", "Q8_0", "Q4_0", "Q5_1", "Q5_1", "Q4_1"),
]
DIM, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 320


def mixed_gguf(path):
    from conftest import corpus_tool
    from corelm.loader.gguf import ggml_type_ids
    tool = corpus_tool()
    rng = np.random.default_rng(5)
    hd = DIM // HEADS

    def blocks(t, rows, cols, seed):
        if t in TYPES:
            raw = random_blocks(t, rows, cols // block_of(t)[0], seed=seed)
        else:  # Q8_0 / Q4_0 / Q4_1: random codes, small scales
            bb = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[t]
            raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // 32, bb), np.uint8)
            for off in (0, 2) if t == "Q4_1" else (0,):
                raw[:, :, off:off + 2] = (np.random.default_rng(seed + 1).standard_normal((rows, cols // 32)) * 0.01
                                          ).astype(np.float16).view(np.uint8).reshape(rows, cols // 32, 2)
            raw = raw.reshape(rows, -1)
        return [cols, rows], ggml_type_ids()[t], raw.tobytes()

    f32 = lambda a: ([len(a)], ggml_type_ids()["F32"], a.astype(np.float32).tobytes())  # noqa: E731
    tensors = [("token_embd.weight", *blocks("Q6_K", VOCAB, DIM, 1)), ("output.weight", *blocks("Q5_1", VOCAB, DIM, 2)),
               ("output_norm.weight", *f32(1 + 0.1 * rng.standard_normal(DIM)))]
    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    for i, types in enumerate(LAYER_TYPES):
        shapes = {"attn_q": (DIM, DIM), "attn_k": (KV_HEADS * hd, DIM), "attn_v": (KV_HEADS * hd, DIM),
                  "attn_output": (DIM, DIM), "ffn_gate": (FFN, DIM), "ffn_up": (FFN, DIM), "ffn_down": (DIM, FFN)}
        for j, (part, t) in enumerate(zip(parts, types)):
            tensors.append((f"blk.{i}.{part}.weight", *blocks(t, *shapes[part], 100 * i + j)))
        tensors += [(f"blk.{i}.attn_norm.weight", *f32(1 + 0.1 * rng.standard_normal(DIM))),
                    (f"blk.{i}.ffn_norm.weight", *f32(1 + 0.1 * rng.standard_normal(DIM)))]
    meta = [("general.architecture", tool.STRING, "llama"), ("llama.context_length", tool.UINT32, 64),
            ("llama.embedding_length", tool.UINT32, DIM), ("llama.block_count", tool.UINT32, len(LAYER_TYPES)),
            ("llama.feed_forward_length", tool.UINT32, FFN), ("llama.attention.head_count", tool.UINT32, HEADS),
            ("llama.attention.head_count_kv", tool.UINT32, KV_HEADS), ("llama.rope.freq_base", tool.FLOAT32, 10000.0),
            ("llama.attention.layer_norm_rms_epsilon", tool.FLOAT32, 1e-5),
            ("tokenizer.ggml.model", tool.STRING, "llama"),
            ("tokenizer.ggml.tokens", tool.ARRAY, (tool.STRING, [f"t{i}" for i in range(VOCAB)])),
            ("tokenizer.ggml.scores", tool.ARRAY, (tool.FLOAT32, [0.0] * VOCAB)),
            ("tokenizer.ggml.token_type", tool.ARRAY, (tool.INT32, [1] * VOCAB)),
            ("tokenizer.ggml.bos_token_id", tool.UINT32, 1), ("tokenizer.ggml.eos_token_id", tool.UINT32, 2)]
    path.write_bytes(tool.build_gguf(meta, tensors))
    return str(path)


def check_mixed_model(path):
    """The engine on the file's own blocks (stacked q/k/v, the K-quant embedding read back by row) against
    the same file dequantized to fp32 (gguf.quants' values, float matmuls): logits agree to the int16
    activations' rounding, and greedy tokens are the same. Returns the NMSE."""
    import corelm
    from conftest import core_forward
    ref = corelm.LLM(path, dtype="fp32", kv_cache_dtype="fp32", max_seq_len=64)
    assert ref.engine.loaded.stored_types == "fp32"
    tokens = np.array([1, 17, 99, 250, 3, 41, 7, 300], np.int32)
    want = core_forward(ref.engine.core, tokens, 0, True)
    llm = corelm.LLM(path, kv_cache_dtype="fp32", max_seq_len=64, activations="int16")
    stored = set(llm.engine.loaded.stored_types.split("+"))
    assert {"q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_xs", "iq4_nl", "q5_0", "q5_1", "q8_0"} <= stored
    weights = {s[0] for s in llm.engine.core.weight_spans()}
    assert {"layers.0.wqkv.0", "layers.0.wqkv.1", "layers.0.wqkv.2", "layers.2.wqkv.0", "layers.2.wqkv.1"} <= weights
    got = core_forward(llm.engine.core, tokens, 0, True)
    nmse = float(np.mean((got - want) ** 2) / np.mean(want ** 2))
    assert np.all(np.isfinite(got)) and nmse < 1e-4, nmse
    sp = corelm.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    a = ref.generate({"prompt_token_ids": tokens.tolist()}, sp)[0].outputs[0].token_ids
    b = llm.generate({"prompt_token_ids": tokens.tolist()}, sp)[0].outputs[0].token_ids
    assert a == b
    return nmse


@pytest.mark.parametrize("isa", [t for t in TABLES if t != "amx"])
def test_mixed_type_model_matches_its_dequantized_weights(tmp_path, isa):
    """check_mixed_model under each kernel table (CORELM_ISA is read once per process: a child each)."""
    import subprocess
    import sys
    path = mixed_gguf(tmp_path / "mixed.gguf")
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(here)  # conftest.py's folder
    code = (f"import sys; sys.path[:0] = [{here!r}, {tests!r}]; import test_ggml_blocks as t; "
            f"print(t.check_mixed_model({path!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, CORELM_ISA=isa), cwd=here)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
