"""The core's mixture-of-experts layers (model/forward.cc Model::moe) against a numpy reference of the
same model: routing (softmax over all experts, top k, optional renormalisation), expert-grouped
matmuls over several sequences at once, OLMoE's q/k norms over whole projections, raw quantized
experts, and the errors for weights that do not fit the layout."""
import numpy as np
import pytest

from corelm import _core
from corelm.engine.model_builder import updated
from conftest import core_forward
from test_quant import dequant, ggml_quantize

D, F, V, HD = 64, 48, 128, 16


def config(n_experts=8, k=2, norm_topk=True, whole=False, layers=2, heads=4, kv_heads=2, threads=1, dtype="fp32", f=F):
    inv = (1.0 / 10000 ** (np.arange(0, HD, 2) / HD)).astype(np.float32)
    return updated(_core.ModelConfig(), vocab_size=V, dim=D, ffn_dim=f, n_layers=layers, n_heads=heads,
                   n_kv_heads=kv_heads, head_dim=HD, norm_eps=1e-5, tie_embeddings=False, attention_bias=False,
                   max_seq_len=128, rope_inv_freq=inv.tolist(), weight_type=dtype, n_threads=threads,
                   pin_threads=False, n_experts=n_experts, n_experts_used=k, moe_norm_topk=norm_topk,
                   qk_norm_whole=whole)


def random_weights(cfg, seed=0):
    rng = np.random.default_rng(seed)
    E, L, nh, nkv, F = cfg.n_experts, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim
    g = lambda *s, std=0.2: (rng.standard_normal(s) * std).astype(np.float32)  # noqa: E731
    w = {"tok_embeddings": g(V, D, std=1.0), "lm_head": g(V, D), "norm": 1 + g(D, std=0.1)}
    for l in range(L):
        p = f"layers.{l}."
        w.update({p + "attn_norm": 1 + g(D, std=0.1), p + "ffn_norm": 1 + g(D, std=0.1), p + "wq": g(nh * HD, D),
                  p + "wk": g(nkv * HD, D), p + "wv": g(nkv * HD, D), p + "wo": g(D, nh * HD),
                  p + "router": g(E, D, std=1.0)})
        if cfg.qk_norm_whole:
            w[p + "q_norm"], w[p + "k_norm"] = 1 + g(nh * HD, std=0.1), 1 + g(nkv * HD, std=0.1)
        for e in range(E):
            q = f"{p}experts.{e}."
            w.update({q + "w_gate": g(F, D), q + "w_up": g(F, D), q + "w_down": g(D, F)})
    return w


def build(cfg, w, raw=None):
    m = _core.Model(cfg)
    for name, a in w.items():
        if raw and ".experts." in name:
            blocks = ggml_quantize(a, raw)
            m.set_weight_raw(name, raw, blocks, list(a.shape))
        else:
            m.set_weight(name, a)
    m.finalize()
    return m


def rms(x, w, eps=1e-5):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def reference(cfg, w, tokens):
    """Every token's logits, in float64."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    T, nh, nkv, K = len(tokens), cfg.n_heads, cfg.n_kv_heads, cfg.n_experts_used
    inv = np.array(cfg.rope_inv_freq, np.float64)
    ang = np.arange(T)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(v):  # [T, heads, HD], rotate-half
        a, b = v[..., :HD // 2], v[..., HD // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    x = w["tok_embeddings"][tokens]
    for l in range(cfg.n_layers):
        p = f"layers.{l}."
        h = rms(x, w[p + "attn_norm"])
        q, k, v = h @ w[p + "wq"].T, h @ w[p + "wk"].T, h @ w[p + "wv"].T
        if cfg.qk_norm_whole:
            q, k = rms(q, w[p + "q_norm"]), rms(k, w[p + "k_norm"])
        q, k, v = rope(q.reshape(T, nh, HD)), rope(k.reshape(T, nkv, HD)), v.reshape(T, nkv, HD)
        k, v = np.repeat(k, nh // nkv, 1), np.repeat(v, nh // nkv, 1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(HD) + np.triu(np.full((T, T), -np.inf), 1)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", pr, v).reshape(T, nh * HD) @ w[p + "wo"].T
        h = rms(x, w[p + "ffn_norm"])
        z = h @ w[p + "router"].T
        prob = np.exp(z - z.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for t in range(T):
            top = np.argsort(-prob[t], kind="stable")[:K]
            wt = prob[t, top] / (prob[t, top].sum() if cfg.moe_norm_topk else 1.0)
            for e, we in zip(top, wt):
                q_ = f"{p}experts.{e}."
                gate, up = h[t] @ w[q_ + "w_gate"].T, h[t] @ w[q_ + "w_up"].T
                out[t] += we * ((gate / (1 + np.exp(-gate)) * up) @ w[q_ + "w_down"].T)
        x = x + out
    return rms(x, w["norm"]) @ w["lm_head"].T


def nmse(a, b):
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


TOKENS = np.array([3, 17, 92, 5, 41, 41, 7, 120, 64, 8, 1, 99, 23, 56, 77, 2, 31, 110, 12, 45], np.int32)


@pytest.mark.parametrize("kw", [dict(), dict(norm_topk=False), dict(whole=True), dict(k=1), dict(k=8),
                                dict(n_experts=3, k=2, kv_heads=4), dict(threads=2)],
                         ids=["mixtral", "olmoe-weights", "olmoe-qk-norm", "top1", "all-experts", "3-experts", "2-threads"])
def test_moe_matches_numpy(kw):
    cfg = config(**kw)
    w = random_weights(cfg)
    ref = reference(cfg, w, TOKENS)
    m = build(cfg, w)
    got = core_forward(m, TOKENS, 0, all_logits=True)  # prefill: rows grouped by expert
    assert nmse(got, ref) < 1e-9
    m2 = build(cfg, w)
    for t in range(len(TOKENS)):  # decode: one row per chosen expert
        last = core_forward(m2, TOKENS[t:t + 1], t)
    assert nmse(last, ref[-1]) < 1e-9
    assert m.active_weight_bytes < m.weight_bytes or cfg.n_experts_used == cfg.n_experts


def test_moe_batch_of_sequences_groups_across_them():
    """Three sequences in one forward (their tokens share experts' rows) give each one's own logits."""
    cfg = updated(config(threads=2), kv_blocks=12)
    w = random_weights(cfg, seed=1)
    m = build(cfg, w)
    seqs = [TOKENS[:7], TOKENS[7:16], TOKENS[16:]]
    tables = [np.arange(i * 4, i * 4 + 4, dtype=np.int32) for i in range(3)]
    got = m.forward_batch(np.concatenate(seqs), [(len(s), 0, tables[i], True) for i, s in enumerate(seqs)])
    row = 0
    for s in seqs:
        assert nmse(got[row:row + len(s)], reference(cfg, w, s)) < 1e-9
        row += len(s)
    # then a decode step of all three at once
    nxt = np.array([9, 10, 11], np.int32)
    got = m.forward_batch(nxt, [(1, len(s), tables[i], False) for i, s in enumerate(seqs)])
    for i, s in enumerate(seqs):
        assert nmse(got[i], reference(cfg, w, np.append(s, nxt[i]))[-1]) < 1e-9


def bf16(a):
    return ((a.view(np.uint32) + 0x7FFF + ((a.view(np.uint32) >> 16) & 1)) & 0xFFFF0000).view(np.float32)


@pytest.mark.parametrize("dtype", ["q8", "q4", "bf16"])
def test_moe_quantized_experts(dtype):
    """Every matrix but the router (kept fp32) in the engine's weight type: as the reference on the
    rounded weights, up to the int16 activations of quantized matmuls (bf16 ones round x to bf16)."""
    cfg = updated(config(dtype=dtype, threads=2, f=96), act_type="int16")
    w = random_weights(cfg, seed=2)
    kind = {"q8": "Q8_0", "q4": "Q4_0"}.get(dtype)
    rounded = {k: v if v.ndim == 1 or k.endswith("router") else
               bf16(v) if dtype == "bf16" else dequant(ggml_quantize(v, kind), kind, v.shape) for k, v in w.items()}
    got = core_forward(build(cfg, w), TOKENS, 0, all_logits=True)
    assert nmse(got, reference(cfg, rounded, TOKENS)) < (1e-3 if dtype == "bf16" else 1e-6)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_moe_raw_expert_blocks(kind):
    """GGUF blocks of every expert kept as they are: the dequantized values through the float path give
    the same logits, up to the int8 activations the raw path multiplies with."""
    cfg = config(threads=2, f=96)  # GGUF blocks need rows of whole blocks of 32
    w = random_weights(cfg, seed=3)
    deq = {k: dequant(ggml_quantize(v, kind), kind, v.shape) if ".experts." in k else v for k, v in w.items()}
    ref = reference(cfg, deq, TOKENS)
    m = build(cfg, w, raw=kind)
    assert m.weight_bytes < build(cfg, w).weight_bytes
    assert nmse(core_forward(m, TOKENS, 0, all_logits=True), ref) < 3e-3


def test_moe_weight_errors():
    cfg = config(layers=1)
    w = random_weights(cfg)
    m = _core.Model(cfg)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        m.set_weight("layers.0.w_gate", w["layers.0.experts.0.w_gate"])
    with pytest.raises(ValueError, match="beyond the model's 8 experts"):
        m.set_weight("layers.0.experts.8.w_down", w["layers.0.experts.0.w_down"])
    with pytest.raises(ValueError, match="unknown weight"):
        m.set_weight("layers.0.experts.1.wq", w["layers.0.wq"])
    with pytest.raises(ValueError, match="expected"):
        m.set_weight("layers.0.router", w["layers.0.router"][:7])
    for name, a in w.items():
        if name != "layers.0.experts.5.w_down":
            m.set_weight(name, a)
    with pytest.raises(ValueError, match="experts.5.w_down"):
        m.finalize()
    dense = config(n_experts=0, k=0)
    with pytest.raises(ValueError, match="without experts"):
        _core.Model(dense).set_weight("layers.0.router", w["layers.0.router"])
    for bad in (dict(n_experts=4, k=5), dict(n_experts=4, k=0), dict(n_experts=-1, k=0)):
        with pytest.raises(ValueError, match="n_experts"):
            _core.Model(config(**bad))


def test_moe_nan_router_does_not_crash():
    cfg = config(layers=1)
    w = random_weights(cfg)
    w["layers.0.router"][:] = np.nan
    logits = core_forward(build(cfg, w), TOKENS, 0)
    assert logits.shape == (V,)


def test_moe_split_by_node():
    """Threads on two (fake) nodes: each node's threads take their own rows of every chosen expert first
    (units in multiples of the active experts), and the logits stay the reference's."""
    cfg = config(threads=2, f=96)
    w = random_weights(cfg, seed=4)
    m = build(cfg, w)
    m.set_thread_nodes([0, 1])
    assert nmse(core_forward(m, TOKENS, 0, all_logits=True), reference(cfg, w, TOKENS)) < 1e-9
