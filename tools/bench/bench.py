#!/usr/bin/env python3
"""corelm vs llama.cpp on this CPU: prefill tok/s, decode tok/s, peak RSS, % of the decode roofline.

usage:  python tools/bench/bench.py [--models M ...] [--engines E ...] [--threads 1 2] [--rounds 3]
                              [--peers DIR] [--out FILE.json] [--bw 1=31 2=35] [--python PY]

Same columns as the peer benchmark (shared/bench/peers/bench_peers.py), so the tables read side by side:
- prefill tok/s = prompt / time to first token (128-token prompt of random ids, seeded);
- decode tok/s  = (N_GEN - 1) / (t_tok64 - t_tok1), 64 greedy tokens, EOS ignored;
- peak RSS      = ru_maxrss of the worker process (one fresh process per measurement);
- % roofline    = decode tok/s / (read bandwidth at that thread count / weight bytes read per token).
  Weight bytes per token = every layer tensor + lm_head in the engine's storage dtype (the embedding row
  is ignored; a tied lm_head counts as the embedding matrix); of a mixture of experts' stacked expert
  tensors only the used share (expert_used_count / expert_count), what a token's router picks. Bandwidth is measured in the same run with
  the peers' membw microbenchmark (compiled from its source if needed; numpy fallback), once per round and
  thread count, and printed.
Engines: corelm:DTYPE with any dtype of corelm.options (bf16, fp32, q8/q8_0, q4/q4_0, q4_1: our engine;
HF folder or GGUF file; the quantized ones quantize at load, and the bytes per token are the packed
matrices the engine reports), corelm:file-FORMAT (file-q8_0, file-q4_1, ...: what users get from
`corelm convert --weights FORMAT` or LLM(path, weights=...): the converted folder, made once and cached;
4-bit folders keep an 8-bit embedding/lm_head, so more bytes than at load); a "+i8" or "+i16"
suffix (corelm:q8+i8) runs with activations="int8" or "int16" (default "auto": int16 for q8, int8 for q4), llama-bench:F16|Q8_0|Q4_0|Q4_K_M
(llama.cpp's own tool, on $PEERS/models/gguf/<model>-<var>.gguf; with a .gguf model path it runs that file),
openvino-genai:int8|int4 (the peers' OpenVINO worker from shared/bench/peers/bench_peers.py in $PEERS/venv-ov,
on $PEERS/models/ov/<model>-<var>, fed this run's prompt; no roofline column: its bytes are not known exactly).
llama-bench reports its own pp128/tg64; its tg64 starts from an empty context, ours after the 128-token prompt.
Engines and thread counts are interleaved round by round (the order rotates), medians are reported with
min-max. Models: names under $PEERS/models (default qwen0.5b-dims-rand) or paths (HF folder or .gguf file).
Raw results: --out (default $PEERS/results/corelm-bench-<time>.json, plus a .md with the tables).
"""
import argparse, json, os, statistics, struct, subprocess, sys, threading, time

# ---------------- parameters ----------------
PEERS = os.environ.get("PEERS", os.path.expanduser("~/corelm-peers"))
PEERS_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "bench", "peers")
MODELS = ["qwen0.5b-dims-rand"]
ENGINES = ["corelm:bf16", "corelm:fp32", "llama-bench:F16"]
THREADS = [1, 2]
ROUNDS = 3
N_PROMPT, N_GEN = 128, 64
N_WARM = 4                 # warm-up generation length (different prompt)
SEED = 1234
LLAMA_BENCH_REPS = 2       # -r for llama-bench within a round (median of its samples)
MEMBW_GIB, MEMBW_REPS = 1, 10
TIMEOUT = 900              # per worker process, seconds
STORAGE_BYTES = {"bf16": 2, "fp32": 4}   # corelm storage dtype of the weight matrices
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# --------------------------------------------


# ---------------- model files (no dependency beyond the stdlib) ----------------
def gguf_tensors(path):
    """Minimal GGUF reader: {name: (n_elements, n_bytes)} plus metadata scalars. n_bytes from offsets."""
    with open(path, "rb") as f:
        def rd(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def rstr():
            return f.read(rd("Q")).decode("utf-8", "replace")
        sizes = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

        def rval(t):
            if t == 8:
                return rstr()
            if t == 9:
                et, n = rd("I"), rd("Q")
                if et in sizes:  # skip numeric arrays quickly
                    f.seek(n * struct.calcsize("<" + sizes[et]), 1)
                    return None
                for _ in range(n):   # strings (vocab) or nested arrays: walk past them
                    rval(et)
                return None
            return rd(sizes[t])
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, n_t, n_kv = rd("I"), rd("Q"), rd("Q")
        meta = {}
        for _ in range(n_kv):
            k = rstr()
            v = rval(rd("I"))
            if v is not None:
                meta[k] = v
        infos = []
        for _ in range(n_t):
            name = rstr()
            dims = [rd("Q") for _ in range(rd("I"))]
            ttype, off = rd("I"), rd("Q")
            infos.append((name, dims, ttype, off))
        align = int(meta.get("general.alignment", 32))
        start = (f.tell() + align - 1) // align * align
        end = os.path.getsize(path) - start
    offs = sorted(o for _, _, _, o in infos) + [end]
    nxt = {o: offs[i + 1] for i, o in enumerate(offs[:-1])}
    out = {}
    for name, dims, ttype, off in infos:
        n = 1
        for d in dims:
            n *= d
        out[name] = {"n": n, "bytes": nxt[off] - off, "dims": dims, "type": ttype}
    return out, meta


def safetensors_tensors(folder):
    """{name: {"n": elements, "bytes": stored bytes, "dims": shape}} from the safetensors headers."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    out = {}
    for fn in files:
        with open(os.path.join(folder, fn), "rb") as f:
            hdr = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for k, v in hdr.items():
            if k == "__metadata__":
                continue
            n = 1
            for d in v["shape"]:
                n *= d
            out[k] = {"n": n, "bytes": v["data_offsets"][1] - v["data_offsets"][0], "dims": v["shape"]}
    return out


def model_info(path):
    """Tensors of a model split into per-token-read ones, plus its vocab size."""
    if os.path.isdir(path):
        ts = safetensors_tensors(path)
        cfg = json.load(open(os.path.join(path, "config.json")))
        emb = next(k for k in ts if k.endswith("embed_tokens.weight"))
        tied = not any(k.endswith("lm_head.weight") for k in ts)
        vocab = cfg.get("vocab_size") or ts[emb]["dims"][0]
    else:
        ts, meta = gguf_tensors(path)
        emb = "token_embd.weight"
        tied = "output.weight" not in ts
        vocab = ts[emb]["dims"][1]
    read = {k: v for k, v in ts.items() if k != emb or tied}  # a tied lm_head reads the embedding matrix
    # a token reads only the experts its router picks: each stacked expert tensor counts used/experts
    arch = meta.get("general.architecture") if not os.path.isdir(path) else None
    used, n_exp = (meta.get(f"{arch}.expert_used_count"), meta.get(f"{arch}.expert_count")) if arch else (None, None)
    if used and n_exp:
        read = {k: dict(v, bytes=v["bytes"] * used / n_exp, n=v["n"] * used / n_exp) if "_exps." in k else v
                for k, v in read.items()}
    return {"tensors": read, "vocab": int(vocab)}


def weight_bytes_per_token(engine, path):
    """Bytes of weights streamed per decoded token. llama.cpp: exact GGUF tensor sizes. corelm: matrices in
    its storage dtype, 1-D tensors (norms, biases) in fp32."""
    kind, var = engine.split(":")
    if kind not in ("llama-bench", "corelm") or (kind == "corelm" and var not in STORAGE_BYTES):
        return None                  # q8/q4: the corelm worker reports its own; openvino: not known exactly
    info = model_info(path)
    if kind == "llama-bench":
        return sum(v["bytes"] for v in info["tensors"].values())
    return sum(v["n"] * (STORAGE_BYTES[var] if len(v["dims"]) >= 2 else 4) for v in info["tensors"].values())


# ---------------- paths ----------------
def resolve_model(m):
    """A model argument -> (label, path for corelm, gguf folder prefix or file for llama-bench)."""
    if os.path.exists(m):
        p = os.path.abspath(m)
        label = os.path.basename(p.rstrip("/"))
        return label, p, p if p.endswith(".gguf") else None
    return m, f"{PEERS}/models/{m}", f"{PEERS}/models/gguf/{m}"


def engine_path(engine, model):
    kind, var = engine.split(":")
    label, corelm_path, gg = resolve_model(model)
    if kind == "corelm":
        return corelm_path
    if kind == "openvino-genai":
        return f"{PEERS}/models/ov/{label}-{var}"
    if gg is None:
        return None
    return gg if gg.endswith(".gguf") else f"{gg}-{var}.gguf"


def engine_label(engine, model):
    """llama-bench on a given .gguf file is named after that file's type, not the requested variant."""
    kind, var = engine.split(":")
    _, _, gg = resolve_model(model)
    if kind == "llama-bench" and gg and gg.endswith(".gguf"):
        base = os.path.basename(gg)[:-5]
        return f"llama-bench:{base.rsplit('.', 1)[-1] if '.' in base else base.rsplit('-', 1)[-1]}"
    return engine


def llama_bench_bin(a):
    return a.llama_bench or f"{PEERS}/llama.cpp-build/bin/llama-bench"


# ---------------- worker (child process) ----------------
def worker_main(engine, path, T, prompt_file):
    kind, var = engine.split(":")
    var, _, act = var.partition("+")          # corelm:q8+i8: int8 activations
    ids, warm = json.load(open(prompt_file))
    try:
        import corelm
    except ImportError:
        sys.path.insert(0, os.path.join(REPO, "python"))
        import corelm
    if var.startswith("file-"):   # the converted folder (cached): convert outside the timed load
        corelm.LLM(path, threads=T, weights=var[5:], max_seq_len=8)
    t_load = time.perf_counter()
    kw = {"weights": var[5:]} if var.startswith("file-") else {"dtype": var}
    if act:
        kw["activations"] = {"i8": "int8", "i16": "int16"}[act]
    llm = corelm.LLM(path, threads=T, max_seq_len=512, speculative_model=None, **kw)  # plain decode
    t_load = time.perf_counter() - t_load
    t_pages = time.perf_counter()   # weights loaded on 4 KiB pages (2 MiB ones came slowly) go onto 2 MiB ones
    llm.wait_for_huge_pages(timeout=300)
    t_pages = time.perf_counter() - t_pages

    def run(prompt, n):
        params = corelm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        stamps, toks = [], []
        t0 = time.perf_counter()
        for chunk in llm.stream(prompt, params):
            if getattr(chunk, "token_id", 0) is None:   # a closing text-only flush carries no token
                continue
            stamps.append(time.perf_counter())
            toks.append(chunk.token_id)
        return t0, stamps, toks

    run(warm, N_WARM)                        # warm-up: different prompt of the same length
    if hasattr(llm, "reset"):
        llm.reset()
    t0, stamps, toks = run(ids, N_GEN)
    if len(stamps) != N_GEN:
        raise SystemExit(f"expected {N_GEN} stream chunks, got {len(stamps)}")
    pf = len(ids) / (stamps[0] - t0)
    dc = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    print("RESULT " + json.dumps({"prefill_tps": pf, "decode_tps": dc, "load_s": t_load, "huge_page_wait_s": t_pages,
                                  "tokens_head": toks[:8],
                                  "weight_type": str(getattr(llm, "dtype", var)),
                                  "weight_bytes": llm.engine.core.active_weight_bytes,
                                  "huge_pages": corelm._core.huge_pages_in_use(),
                                  "threads": getattr(llm, "threads", T)}), flush=True)


# ---------------- parent side ----------------
def spawn_rss(cmd, env, timeout=TIMEOUT):
    """Run cmd; return (stdout+stderr, peak RSS MiB from wait4, exit code). Killed after timeout."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killer = threading.Timer(timeout, p.kill)
    killer.start()
    try:
        out = p.stdout.read()
    finally:
        killer.cancel()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)  # already reaped: keep Popen from waiting again
    return out, ru.ru_maxrss / 1024, p.returncode


def thread_env(T):
    return dict(os.environ, OMP_NUM_THREADS=str(T), MKL_NUM_THREADS=str(T), OPENBLAS_NUM_THREADS=str(T),
                HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def run_one(engine, model, T, a, prompt_file):
    kind, var = engine.split(":")
    path = engine_path(engine, model)
    if path is None:
        return {"error": "no GGUF for this model (pass a .gguf path or a name under $PEERS/models)"}
    if not os.path.exists(path):
        return {"error": f"missing {path}"}
    env = thread_env(T)
    if kind == "llama-bench":
        lb = llama_bench_bin(a)
        if not os.path.exists(lb):
            return {"error": f"llama.cpp not built ({lb} missing; see shared/bench/peers/run_peers.sh)"}
        out, rss, rc = spawn_rss([lb, "-m", path, "-p", str(N_PROMPT), "-n", str(N_GEN), "-t", str(T),
                                  "-r", str(LLAMA_BENCH_REPS), "-o", "json"] + a.llama_args.split(), env)
        if rc != 0 or "[" not in out:
            return {"error": (out[-500:].strip() + f" (exit code {rc})").strip()}
        i = out.find("[\n  {")           # the JSON array (stderr log lines are mixed in)
        js = json.loads(out[i if i >= 0 else out.index("["):out.rindex("]") + 1])
        pp = [statistics.median(e["samples_ts"]) for e in js if e["n_prompt"] > 0 and e["n_gen"] == 0]
        tg = [statistics.median(e["samples_ts"]) for e in js if e["n_gen"] > 0 and e["n_prompt"] == 0]
        return {"prefill_tps": pp[0], "decode_tps": tg[0], "rss_mib": rss,
                "build": js[0].get("build_commit"), "cpu": js[0].get("cpu_info")}
    if kind == "openvino-genai":
        return run_openvino(engine, model, T, prompt_file, env)
    if kind != "corelm":
        return {"error": f"unknown engine kind {kind}"}
    out, rss, rc = spawn_rss([a.python, os.path.abspath(__file__), "--worker", engine, path, str(T), prompt_file],
                             env)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]), rss_mib=rss)
    return {"error": out[-800:].strip() or f"exit code {rc}"}


def run_openvino(engine, model, T, prompt_file, env):
    """The peers' OpenVINO GenAI worker, pointed (through a private $PEERS) at this run's prompt."""
    py, script = f"{PEERS}/venv-ov/bin/python", os.path.join(PEERS_SRC, "bench_peers.py")
    if not os.path.exists(py) or not os.path.exists(script):
        return {"error": f"OpenVINO venv or {script} missing (see shared/bench/peers/run_peers.sh)"}
    private = os.path.splitext(prompt_file)[0] + "-peers"
    os.makedirs(os.path.join(private, "results"), exist_ok=True)
    if not os.path.exists(os.path.join(private, "models")):
        os.symlink(f"{PEERS}/models", os.path.join(private, "models"))
    ids = json.load(open(prompt_file))[0]
    json.dump(ids, open(os.path.join(private, "results", "prompt_ids.json"), "w"))
    out, rss, rc = spawn_rss([py, script, "--worker", engine, resolve_model(model)[0], str(T)], dict(env, PEERS=private))
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]), rss_mib=rss)
    return {"error": out[-800:].strip() or f"exit code {rc}"}


# ---------------- memory bandwidth ----------------
def membw_binary():
    """The peers' membw (AVX-512 sum, OpenMP), else tools/bench/membw_avx2.c (the same with 256-bit loads, for
    CPUs without AVX-512); compiled into $PEERS/micro or a cache dir when missing."""
    b = f"{PEERS}/micro/membw"
    if os.access(b, os.X_OK):
        return b
    cache = os.path.expanduser("~/.cache/corelm-bench")
    here = os.path.dirname(os.path.abspath(__file__))
    for src, dst, flags in ((f"{PEERS}/micro/membw.c", "membw", "-march=native"),
                            (os.path.join(PEERS_SRC, "micro", "membw.c"), "membw", "-march=native"),
                            (os.path.join(here, "membw_avx2.c"), "membw_avx2", "-mavx2")):
        if os.path.exists(src):
            dst = os.path.join(cache, dst)
            os.makedirs(cache, exist_ok=True)
            if os.access(dst, os.X_OK) or subprocess.run(
                    ["gcc", "-O3", flags, "-fopenmp", src, "-o", dst], capture_output=True).returncode == 0:
                return dst
    return None


def measure_bw(T):
    """Sustained read GB/s at T threads (median of MEMBW_REPS sweeps over MEMBW_GIB GiB)."""
    b = membw_binary()
    if b:
        env = dict(thread_env(T), OMP_PROC_BIND="close")
        o = subprocess.run([b, str(MEMBW_GIB), str(MEMBW_REPS)], env=env, capture_output=True, text=True).stdout
        if "read_GBps_median=" in o:
            return float(o.split("read_GBps_median=")[1].split()[0]), "membw"
    # fallback: numpy sums of T slices in T threads (numpy releases the GIL in the reduction)
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor
    a = np.ones(MEMBW_GIB * 2**28, dtype=np.float32)
    parts = np.array_split(a, T)
    best = []
    with ThreadPoolExecutor(T) as ex:
        for _ in range(MEMBW_REPS):
            t = time.perf_counter()
            list(ex.map(np.sum, parts))
            best.append(a.nbytes / (time.perf_counter() - t) / 1e9)
    return statistics.median(best), "numpy"


# ---------------- report ----------------
def stat(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


def fmt(s, nd=1):
    if not s:
        return "–"
    if len(set([round(s["min"], nd), round(s["max"], nd)])) == 1:
        return f"{s['median']:.{nd}f}"
    return f"{s['median']:.{nd}f} ({s['min']:.{nd}f}–{s['max']:.{nd}f})"


def summarize(raw, bw_samples, a):
    rows = []
    for (label, engine, T), rs in raw.items():
        ok = [r for r in rs if "error" not in r]
        row = {"model": label, "engine": engine, "T": T, "n_ok": len(ok), "n": len(rs)}
        if not ok:
            row["error"] = rs[-1]["error"]
        for k in ("prefill_tps", "decode_tps", "rss_mib"):
            row[k] = stat([r[k] for r in ok])
            row[k + "_all"] = [r[k] for r in ok]
        rows.append(row)
    bw = {T: stat(v) for T, v in bw_samples.items()}
    return rows, bw


def tables(rows, bw, bpt, a, models):
    Ts = a.threads
    md = []
    md.append("## read bandwidth (GB/s; membw in this run unless given with --bw)\n")
    md.append("| threads | " + " | ".join(f"{T}t" for T in Ts) + " |")
    md.append("|---|" + "---|" * len(Ts))
    md.append("| GB/s | " + " | ".join(fmt(bw.get(T)) for T in Ts) + " |\n")
    for label in models:
        md.append(f"## {label}\n")
        md.append(f"prompt {N_PROMPT} random ids, {N_GEN} greedy tokens (EOS ignored); "
                  f"medians over {a.rounds} rounds (min–max)\n")
        hdr = "| engine:format |"
        for T in Ts:
            hdr += f" prefill {T}t | decode {T}t | % roof {T}t |"
        hdr += " peak RSS MiB | GB/token |"
        md.append(hdr)
        md.append("|---|" + "---|---|---|" * len(Ts) + "---|---|")
        engines = []
        for r in rows:
            if r["model"] == label and r["engine"] not in engines:
                engines.append(r["engine"])
        for e in engines:
            line = f"| {e} |"
            rss = []
            for T in Ts:
                r = next((r for r in rows if r["model"] == label and r["engine"] == e and r["T"] == T), None)
                if r is None or not r["decode_tps"]:
                    err = ((r or {}).get("error") or "not run").strip() or "?"
                    line += f" FAILED: {err.splitlines()[-1][:60]} | – | – |"
                    continue
                gb = (bpt.get((label, e)) or 0) / 1e9
                roof = bw[T]["median"] / gb if bw.get(T) and gb else None
                pct = f"{100 * r['decode_tps']['median'] / roof:.0f}%" if roof else "–"
                line += f" {fmt(r['prefill_tps'])} | {fmt(r['decode_tps'])} | {pct} |"
                rss.append(r["rss_mib"]["median"])
            gbs = f"{bpt[(label, e)] / 1e9:.3f}" if bpt.get((label, e)) else "–"
            line += f" {max(rss):.0f} |" if rss else " – |"
            md.append(line + f" {gbs} |")
        # ratios corelm / llama.cpp at each thread count
        ours = [e for e in engines if e.startswith("corelm:")]
        theirs = [e for e in engines if e.startswith(("llama-bench:", "openvino-genai:"))]
        pairs = []
        for o in ours:
            for t in theirs:
                cells = []
                for T in Ts:
                    ro = next((r for r in rows if r["model"] == label and r["engine"] == o and r["T"] == T), None)
                    rt = next((r for r in rows if r["model"] == label and r["engine"] == t and r["T"] == T), None)
                    if ro and rt and ro["decode_tps"] and rt["decode_tps"]:
                        cells.append(f" {ro['prefill_tps']['median'] / rt['prefill_tps']['median']:.2f}× | "
                                     f"{ro['decode_tps']['median'] / rt['decode_tps']['median']:.2f}× |")
                    else:
                        cells.append(" – | – |")
                pairs.append(f"| {o} / {t} |" + "".join(cells))
        if pairs:
            md.append("\nratio corelm / peer (medians; >1 = corelm faster)\n")
            md.append("| pair |" + "".join(f" prefill {T}t | decode {T}t |" for T in Ts))
            md.append("|---|" + "---|---|" * len(Ts))
            md.extend(pairs)
        md.append("")
        md.append("% roof = decode tok/s ÷ (median read GB/s at that thread count ÷ GB of weights read per token). "
                  "llama-bench's tg64 starts from an empty context; corelm's decode follows the 128-token prompt.\n")
    return "\n".join(md)


def main():
    global PEERS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=4, metavar=("ENGINE", "PATH", "THREADS", "PROMPTS"), help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", default=MODELS, help="names under $PEERS/models, or paths (HF folder, .gguf)")
    ap.add_argument("--engines", nargs="+", default=ENGINES)
    ap.add_argument("--threads", nargs="+", type=int, default=THREADS)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--peers", default=None, help=f"peers folder (default $PEERS or {PEERS})")
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary (default $PEERS/llama.cpp-build/bin)")
    ap.add_argument("--llama-args", default="", help="more llama-bench arguments, e.g. \"--repack 0\" where its AMX "
                    "kernels fault (a Xeon with AMX, this llama.cpp: SIGILL/SIGSEGV in ggml_backend_amx_mul_mat)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the corelm worker")
    ap.add_argument("--bw", nargs="+", default=[], metavar="T=GBPS", help="use these bandwidths, skip membw")
    ap.add_argument("--out", default=None, help="raw JSON results (a .md with the tables is written beside it)")
    a = ap.parse_args()
    if a.peers:
        PEERS = os.path.abspath(a.peers)
    if a.worker:
        return worker_main(a.worker[0], a.worker[1], int(a.worker[2]), a.worker[3])

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = a.out or f"{PEERS}/results/corelm-bench-{stamp}.json"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    notes = []
    if any(e.startswith("llama-bench:") for e in a.engines) and not os.path.exists(llama_bench_bin(a)):
        notes.append(f"llama.cpp is not built ({llama_bench_bin(a)} missing): only corelm rows are measured. "
                     f"Build it with shared/bench/peers/run_peers.sh.")
        a.engines = [e for e in a.engines if not e.startswith("llama-bench:")]
    chk = subprocess.run([a.python, "-c", "import corelm._core; from corelm import LLM, SamplingParams"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                             x for x in (os.environ.get("PYTHONPATH"), os.path.join(REPO, "python")) if x)))
    if chk.returncode != 0:
        notes.append(f"corelm (_core, LLM, SamplingParams) does not import in {a.python}: corelm rows will fail "
                     f"({chk.stderr.strip().splitlines()[-1] if chk.stderr.strip() else '?'}).")
    for n in notes:
        print("NOTE:", n, flush=True)
    fixed_bw = {int(x.split("=")[0]): float(x.split("=")[1]) for x in a.bw}

    # one prompt per model (random ids in [3, vocab), seeded) + a different warm-up prompt
    prompts, bpt, labels = {}, {}, []
    for m in a.models:
        label, cpath, _ = resolve_model(m)
        labels.append(label)
        src = cpath if os.path.exists(cpath) else engine_path("llama-bench:F16", m)
        if not src or not os.path.exists(src):
            print(f"NOTE: model {m} not found ({cpath})", flush=True)
            notes.append(f"model {m} not found")
            continue
        vocab = model_info(src)["vocab"]
        import random
        rng = random.Random(SEED)
        ids = [rng.randrange(3, vocab) for _ in range(N_PROMPT)]
        warm = [rng.randrange(3, vocab) for _ in range(N_PROMPT)]
        pf = f"{os.path.splitext(out)[0]}-{label}-prompt.json"
        json.dump([ids, warm], open(pf, "w"))
        prompts[m] = pf
        for e in a.engines:
            p = engine_path(e, m)
            if p and os.path.exists(p):
                bpt[(label, engine_label(e, m))] = weight_bytes_per_token(e, p)

    raw, bw_samples, log = {}, {}, []
    engines = list(dict.fromkeys(a.engines))
    for rnd in range(a.rounds):
        for T in (a.threads if rnd % 2 == 0 else a.threads[::-1]):
            if T in fixed_bw:
                bw_samples.setdefault(T, []).append(fixed_bw[T])
            else:
                g, how = measure_bw(T)
                bw_samples.setdefault(T, []).append(g)
                print(f"[{time.strftime('%H:%M:%S')}] bandwidth T={T} round={rnd}: {g:.1f} GB/s ({how})", flush=True)
            for m in a.models:
                if m not in prompts:
                    continue
                label = resolve_model(m)[0]
                order = engines[rnd % len(engines):] + engines[:rnd % len(engines)]
                done = set()
                for e in order:
                    el = engine_label(e, m)
                    if el in done:           # several llama-bench variants on one .gguf path = one run
                        continue
                    done.add(el)
                    t = time.time()
                    load1 = os.getloadavg()[0]
                    r = dict(run_one(e, m, T, a, prompts[m]), loadavg1_before=load1)
                    raw.setdefault((label, el, T), []).append(r)
                    short = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()
                             if k in ("prefill_tps", "decode_tps", "rss_mib", "load_s", "huge_page_wait_s", "loadavg1_before")}
                    msg = (f"[{time.strftime('%H:%M:%S')}] {label} {el} T={T} round={rnd} {time.time() - t:.0f}s "
                           f"{short or r}")
                    print(msg, flush=True)
                    log.append(msg)

    for (label, e, T), rs in raw.items():     # corelm reports the bytes of its packed matrices
        wb = [r["weight_bytes"] for r in rs if r.get("weight_bytes")]
        if wb:
            bpt[(label, e)] = statistics.median(wb)
    rows, bw = summarize(raw, bw_samples, a)
    # keep the row order: engines as given, per model
    order_e = []
    for m in a.models:
        for e in engines:
            if engine_label(e, m) not in order_e:
                order_e.append(engine_label(e, m))
    rows.sort(key=lambda r: (labels.index(r["model"]), order_e.index(r["engine"]), a.threads.index(r["T"])))
    md = f"# corelm bench {stamp}\n\n" + "".join(f"NOTE: {n}\n\n" for n in notes) + \
         tables(rows, bw, bpt, a, [l for m, l in zip(a.models, labels) if m in prompts])
    print("\n" + md)
    git = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    json.dump({"stamp": stamp, "git": git, "notes": notes, "args": {k: v for k, v in vars(a).items() if k != "worker"},
               "params": {"N_PROMPT": N_PROMPT, "N_GEN": N_GEN, "N_WARM": N_WARM, "SEED": SEED,
                          "LLAMA_BENCH_REPS": LLAMA_BENCH_REPS, "llama_args": a.llama_args, "MEMBW_GIB": MEMBW_GIB},
               "bandwidth_GBps": {str(T): v for T, v in bw.items()},
               "bandwidth_samples": {str(T): v for T, v in bw_samples.items()},
               "bytes_per_token": {f"{l}|{e}": v for (l, e), v in bpt.items()},
               "rows": rows, "raw": [{"model": l, "engine": e, "T": T, "runs": rs} for (l, e, T), rs in raw.items()],
               "log": log}, open(out, "w"), indent=1)
    open(os.path.splitext(out)[0] + ".md", "w").write(md)
    print(f"raw results: {out}")


if __name__ == "__main__":
    main()
