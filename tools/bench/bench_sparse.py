"""Decode and prefill with sparse weights (sbf16, sq8, sq4) against their dense format (bf16, q8, q4), on a
Qwen2.5-0.5B-shaped model of random weights pruned by magnitude per row (embedding and lm_head kept dense, as
convert keeps them).

    python tools/bench/bench_sparse.py [--dtype bf16,q8,q4] [--rounds 3] [--tokens 32] [--sparsity 0.5,0.7]
                                 [--threads 1,2] [--hog]
    python tools/bench/bench_sparse.py --stream [--dtype bf16,q8,q4] [--rounds 3] [--sparsity 0.5,0.7] [--threads 1,2] [--hog]
    python tools/bench/bench_sparse.py --dtype q4 --llama-bench BIN/llama-bench --llama-model qwen0.5b-dims-rand-Q4_0.gguf
    python tools/bench/bench_sparse.py --folders DENSE SPARSE [...] [--llama-bench BIN --llama-model GGUF]

Every model is built once; the measurements alternate between them round by round (medians reported,
with the ratio to the dense format at the same thread count). --stream times decode's weight stream alone
(the kernel table's matmul over 24 layers of the model's matrices, _core.testing.bench_gemv_stream):
ms per pass over the same matrices, so the ratio is the speedup, and the share of the bandwidth roofline
(the bytes actually stored, streamed at the GB/s of a plain read alternated with it in the same call). --hog adds runs with one thread while
another process streams memory on another core: a core that gets a share of the memory bandwidth, as
each core of a many-core server does when all of them decode. --llama-bench (decode only, one --dtype) also runs
llama.cpp's llama-bench on --llama-model, a GGUF of the same shape in the dense format's llama.cpp type (F16,
Q8_0, Q4_0; the peers' qwen0.5b-dims-rand: Llama architecture, no q/k/v bias, the same matrices), alternating
with the corelm runs in every round: decode after a 128-token context, as ours. --folders times real converted
models instead (`corelm convert --weights W [--sparsity S --prune wanda]` folders, each loaded as LLM loads
it, the first the dense one the others are compared with)."""
import argparse
import contextlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python"))
from corelm import _core  # noqa: E402
from corelm.convert import quantize_q4_0, quantize_q8_0, to_bf16  # noqa: E402
from corelm.engine.model_builder import core_config, updated, wait_for_huge_pages  # noqa: E402
from corelm.loader.spec import weight_shapes  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import measure_bw  # noqa: E402
from bench_quant import SPEC, time_prompt_and_steps  # noqa: E402


def hog(stop):
    """Streams 256 MB over and over on the last CPU this process may use (the benchmark keeps the first)."""
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    a = np.ones(32 << 20)
    while not stop.is_set():
        a.sum()


class Hog:
    def __enter__(self):
        self.stop = mp.Event()
        self.p = mp.Process(target=hog, args=(self.stop,), daemon=True)
        self.p.start()
        time.sleep(0.5)

    def __exit__(self, *exc):
        self.stop.set()
        self.p.join(5)


def prune(w, s):
    """w with the fraction s of each row's smallest magnitudes zeroed."""
    if s <= 0:
        return w
    k = int(s * w.shape[1])
    idx = np.argpartition(np.abs(w), k - 1, axis=1)[:, :k]
    w = w.copy()
    np.put_along_axis(w, idx, 0, axis=1)
    return w


def runs_of(a):
    """(label, weight type, sparsity, threads, hog) for every measurement."""
    out = []
    for t in map(int, a.threads.split(",")):
        for hogged in ((False, True) if a.hog and t == 1 else (False,)):
            out.append((a.dtype, a.dtype, 0.0, t, hogged))
            out += [(f"s{a.dtype}@{s:g}", "s" + a.dtype, s, t, hogged) for s in map(float, a.sparsity.split(","))]
    return out


def report(runs, values, unit, better_low, out=None):
    """Prints each run's median and its ratio to the dense format (the first run); with out (a dict), records
    them there too."""
    dense = runs[0][1]
    for r in runs:
        med = float(np.median(values[r]))
        base = float(np.median(values[(dense, dense, 0.0, r[3], r[4])]))
        ratio = base / med if better_low else med / base
        print(f"{r[0]:10s} {r[3]}t{' +hog' if r[4] else '     '}  {med:8.2f} {unit}  x{ratio:.2f} vs {dense}  "
              f"(rounds: {', '.join(f'{v:.2f}' for v in values[r])})")
        if out is not None:
            out.setdefault(unit, []).append({"weights": r[0], "threads": r[3], "hog": r[4], "median": med,
                                             f"vs_{dense}": ratio, "rounds": values[r]})


def stream(a):
    h, f = SPEC.hidden_size, SPEC.intermediate_size
    kv = SPEC.num_kv_heads * SPEC.head_dim
    shapes = [(h + 2 * kv, h), (h, h), (2 * f, h), (h, f)]
    runs = runs_of(a)
    ms = {r: [] for r in runs}
    roof = {r: [] for r in runs}   # the kernel's GB/s of bytes as stored over a plain read's, same call
    table = _core.kernel_tables()[0] if a.table is None else a.table  # the best first
    for rnd in range(a.rounds):
        for r in runs if rnd % 2 == 0 else runs[::-1]:
            with Hog() if r[4] else contextlib.nullcontext():
                d = _core.testing.bench_gemv_stream(f"{table}_{r[1]}", shapes, SPEC.num_layers, 5, r[3], True,
                                                    a.activations, r[2])
            ms[r].append(d["bytes"] / d["gemv_GBps"] / 1e6)
            roof[r].append(100 * d["gemv_GBps"] / d["read_GBps"])
    print(f"kernel table {table}: ms per pass over 24 layers of the model's matrices")
    out = {"mode": "stream", "table": table}
    report(runs, ms, "ms", True, out)
    print("share of the bandwidth roofline (the bytes stored, at a plain read's GB/s measured alongside):")
    for r in runs:
        print(f"{r[0]:10s} {r[3]}t{' +hog' if r[4] else '     '}  {np.median(roof[r]):5.1f}%  "
              f"(rounds: {', '.join(f'{v:.1f}' for v in roof[r])})")
    out["roofline_pct"] = [{"weights": r[0], "threads": r[3], "hog": r[4], "median": float(np.median(roof[r])),
                            "rounds": roof[r]} for r in runs]
    return out


def llama_decode(a, threads):
    """llama-bench's decode tok/s on --llama-model after a 128-token context (its -d), a.tokens tokens."""
    cmd = [a.llama_bench, "-m", a.llama_model, "-t", str(threads), "-p", "0", "-n", str(a.tokens), "-d", "128",
           "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return float(json.loads(out.stdout)[0]["avg_ts"])


def folder_models(a):
    """--folders: (runs, models, vocabulary size), each folder built as LLM builds it, once per thread count."""
    from corelm.convert import folder_dtype
    from corelm.loader import load_model
    from corelm.engine.model_builder import build_core_model
    runs, models = [], {}
    loaded = {path: load_model(path) for path in a.folders}
    vocab = loaded[a.folders[0]].spec.vocab_size
    for t in map(int, a.threads.split(",")):
        for path in a.folders:
            label = os.path.basename(os.path.normpath(path))
            src = loaded[path]
            dtype = folder_dtype(src.source) if src.source_format == "corelm" else "auto"  # as LLM picks it
            m = build_core_model(src, dtype=dtype, threads=t, max_seq_len=1024, pin_threads=False)
            wait_for_huge_pages([m], timeout=300)
            runs.append((label, label, 0.0, t, False))
            models[(label, 0.0, t)] = m
    return runs, models, vocab


def decode(a):
    if a.folders:
        runs, models, vocab = folder_models(a)
        prompt = np.random.default_rng(0).integers(0, vocab, 128).astype(np.int32)
        return timed_decode(a, runs, models, prompt)
    runs = runs_of(a)
    models = {}
    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
               for name, shape in weight_shapes(SPEC).items()}
    for r in runs:
        key = (r[1], r[2], r[3])
        if key in models:
            continue
        m = _core.Model(updated(core_config(SPEC, a.dtype, r[3], 1024), pin_threads=False, act_type=a.activations))
        for name, w in weights.items():
            if w.ndim == 1 or name in ("tok_embeddings", "lm_head") or r[1] == a.dtype:
                m.set_weight(name, w)
            elif a.dtype == "bf16":  # the matrix pruned, as dense bf16 bytes, which the core stores sparse
                m.set_weight_raw(name, "SBF16", to_bf16(prune(w, r[2])).view(np.uint8).ravel(), list(w.shape))
            else:  # pruned, as the dense format's blocks, whose zero codes the core drops
                blocks = (quantize_q8_0 if a.dtype == "q8" else quantize_q4_0)(prune(w, r[2]))
                m.set_weight_raw(name, "SQ8" if a.dtype == "q8" else "SQ4", blocks.ravel(), list(w.shape))
        m.finalize()
        wait_for_huge_pages([m], timeout=300)   # decode at its steady speed (LLM.wait_for_huge_pages)
        models[key] = m
    prompt = rng.integers(0, SPEC.vocab_size, 128).astype(np.int32)
    return timed_decode(a, runs, models, prompt)


def timed_decode(a, runs, models, prompt):
    """Prefill and decode of every run's model (and llama-bench), alternating round by round."""
    tok_s = {r: [] for r in runs}
    pre_s = {r: [] for r in runs}
    thread_counts = sorted({r[3] for r in runs})
    llama = {t: [] for t in thread_counts} if a.llama_bench else {}
    bw = {t: [] for t in thread_counts} if a.folders else {}   # a plain read's GB/s, for the roofline
    for rnd in range(a.rounds):
        order = [("llama", t) for t in llama] + [("bw", t) for t in bw] + runs
        for r in order if rnd % 2 == 0 else order[::-1]:
            if r[0] == "llama":
                llama[r[1]].append(llama_decode(a, r[1]))
                continue
            if r[0] == "bw":
                bw[r[1]].append(measure_bw(r[1])[0])
                continue
            m = models[(r[1], r[2], r[3])]
            with Hog() if r[4] else contextlib.nullcontext():
                pre, step = time_prompt_and_steps(m, prompt, a.tokens)
            pre_s[r].append(len(prompt) / pre)
            tok_s[r].append(1 / step)
    for r in runs:
        m = models[(r[1], r[2], r[3])]
        print(f"{r[0]:10s} {r[3]}t  {m.weight_bytes / 1e6:6.0f} MB of weights")
    out = {"mode": "decode", "weight_bytes": {r[0]: models[(r[1], r[2], r[3])].weight_bytes for r in runs}}
    print("decode (tok/s):")
    report(runs, tok_s, "decode tok/s", False, out)
    print("prefill, 128-token prompt (tok/s):")
    report(runs, pre_s, "prefill tok/s", False, out)
    if bw:
        print("share of the bandwidth roofline (the weights' bytes at a plain read's median GB/s, same rounds):")
        out["read GB/s"] = {t: vals for t, vals in bw.items()}
        for r in runs:
            gbps = float(np.median(bw[r[3]]))
            pct = 100 * float(np.median(tok_s[r])) * models[(r[1], r[2], r[3])].weight_bytes / 1e9 / gbps
            out.setdefault("roofline_pct", []).append({"weights": r[0], "threads": r[3], "median": pct})
            print(f"{r[0]:10s} {r[3]}t  {pct:5.1f}% of {gbps:.1f} GB/s")
    if llama:
        name = os.path.basename(a.llama_model)
        out["llama_cpp"] = {"model": name, "decode tok/s": []}
        print(f"decode against llama.cpp ({name}):")
        for t, vals in llama.items():
            base = float(np.median(vals))
            out["llama_cpp"]["decode tok/s"].append({"threads": t, "median": base, "rounds": vals})
            print(f"llama.cpp  {t}t       {base:8.2f} tok/s  (rounds: {', '.join(f'{v:.2f}' for v in vals)})")
            for r in runs:
                if r[3] == t and not r[4]:
                    print(f"{r[0]:10s} {t}t       x{float(np.median(tok_s[r])) / base:.2f} vs llama.cpp")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16",
                    help="the dense formats, comma-separated (bf16, q8, q4), each against its sparse one (sbf16, sq8, "
                         "sq4)")
    ap.add_argument("--activations", default="int16", choices=["int8", "int16"],
                    help="how q8/q4 weights take the activation rows (default: int16, what LLM's 'auto' uses)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--sparsity", default="0.5,0.7")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--hog", action="store_true", help="also 1 thread beside a memory-streaming process")
    ap.add_argument("--stream", action="store_true", help="decode's weight stream alone")
    ap.add_argument("--table", default=None, help="--stream: the kernel table (default: the best one)")
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench, run beside decode (one --dtype)")
    ap.add_argument("--llama-model", default=None,
                    help="with --llama-bench: a GGUF of the same shape in the dense format's llama.cpp type")
    ap.add_argument("--folders", nargs="+", default=None,
                    help="decode of these models instead (converted corelm folders, or any model LLM loads, at its "
                         "'auto' dtype; the first: the dense one)")
    ap.add_argument("--out", default=None, help="also write the results here as JSON (with the commit)")
    a = ap.parse_args()
    dtypes = a.dtype.split(",")
    if not set(dtypes) <= {"bf16", "q8", "q4"}:
        ap.error(f"--dtype: bf16, q8 or q4, not {a.dtype}")
    if a.llama_bench and (a.stream or len(dtypes) != 1 or not a.llama_model):
        ap.error("--llama-bench: decode only, one --dtype, with --llama-model")
    if a.folders and (a.stream or a.hog):
        ap.error("--folders: decode only, without --hog")
    if a.folders:
        dtypes = [os.path.basename(os.path.normpath(a.folders[0]))]
    res = {}
    for dt in dtypes:
        print(f"--- {', '.join(a.folders)}" if a.folders else f"--- {dt} against s{dt}")
        one = argparse.Namespace(**dict(vars(a), dtype=dt))
        res[dt] = stream(one) if a.stream else decode(one)
    res = res[dtypes[0]] if len(dtypes) == 1 else {"by_dtype": res}
    if a.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        res.update(commit=commit, args=vars(a), cpu=_core.cpu_info().get("brand", ""))
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
