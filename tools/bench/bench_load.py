"""Load time and peak RSS of one model file: corelm against llama.cpp's llama-simple, alternating, one fresh
process per measurement (page cache warm: one unmeasured load of each first).

corelm: process start to a ready `LLM` (interpreter start and imports included). llama.cpp: `llama-simple -n 1`,
process start to exit (model load, a context, one token for a 1-token prompt: a few ms past the load).

--decode N also has each corelm process decode N tokens right after the load, wait for its weights to move onto
2 MiB pages (where the load put them on 4 KiB ones: LLM.wait_for_huge_pages) and decode N again, reporting both
speeds and the wait (what a first request sees, and the speed once the machine was idle long enough).

    python tools/bench/bench_load.py --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --threads 2 --rounds 5 [--decode 64]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PEERS = os.environ.get("PEERS", os.path.expanduser("~/corelm-peers"))
HERE = os.path.dirname(os.path.abspath(__file__))


# Greedy decode after a 32-token prompt, before and after the move onto 2 MiB pages (%d: --decode).
DECODE_AFTER_LOAD = """
import json, time, corelm
params = corelm.SamplingParams(temperature=0, max_tokens=%d, ignore_eos=True)
def tok_s():
    stamps = [time.perf_counter() for c in llm.stream(list(range(1000, 1032)), params) if c.token_id is not None]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])
first = tok_s()
t = time.perf_counter()
llm.wait_for_huge_pages(timeout=600)
wait = time.perf_counter() - t
print("DECODE " + json.dumps(dict(first=first, wait_s=wait, after=tok_s(), moved=llm.engine.core.huge_page_promotion)))
"""


def timed(cmd, env=None):
    """(wall seconds, peak RSS MiB) of one process; raises if it fails."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if status != 0:
        raise RuntimeError(f"{cmd[0]} failed ({status}):\n{out.decode(errors='replace')[-2000:]}")
    return wall, ru.ru_maxrss / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a .gguf file both engines load")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--llama-simple", default=os.path.join(PEERS, "llama.cpp-build", "bin", "llama-simple"))
    ap.add_argument("--decode", type=int, default=0, help="also decode this many tokens after the load (see above)")
    ap.add_argument("--out", default=None, help="raw results as JSON")
    a = ap.parse_args()
    code = (f"from corelm import LLM; llm = LLM({a.model!r}, threads={a.threads}, speculative_model=None)")
    env = dict(os.environ, PYTHONPATH=os.path.join(HERE, "..", "..", "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    engines = {"corelm": ([sys.executable, "-c", code], env)}
    if os.path.exists(a.llama_simple):
        engines["llama.cpp"] = ([a.llama_simple, "-m", a.model, "-n", "1", "Hi"], None)
    else:
        print(f"llama-simple not found at {a.llama_simple}: corelm only", file=sys.stderr)
    for cmd, e in engines.values():   # page cache warm, imports compiled
        timed(cmd, e)
    runs = {k: [] for k in engines}
    for r in range(a.rounds):
        for k, (cmd, e) in engines.items():
            runs[k].append(timed(cmd, e))
            print(f"round {r + 1} {k}: {runs[k][-1][0]:.2f} s, {runs[k][-1][1]:.0f} MiB", flush=True)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(m for _, m in v)) for k, v in runs.items()}
    for k, (w, m) in med.items():
        print(f"{k}: median {w:.2f} s, peak RSS {m:.0f} MiB")
    if len(med) == 2:
        print(f"corelm / llama.cpp: load {med['corelm'][0] / med['llama.cpp'][0]:.2f}x, "
              f"peak RSS {med['corelm'][1] / med['llama.cpp'][1]:.2f}x")
    decode = []
    for r in range(a.rounds if a.decode else 0):   # processes of their own: the load rounds time the load alone
        out = subprocess.run([sys.executable, "-c", code + "\n" + DECODE_AFTER_LOAD % a.decode], env=env,
                             capture_output=True, text=True, check=True).stdout
        decode.append(json.loads(next(line[7:] for line in out.splitlines() if line.startswith("DECODE "))))
        d = decode[-1]
        print(f"round {r + 1} corelm decode: {d['first']:.1f} tok/s right after the load, {d['after']:.1f} after "
              f"{d['wait_s']:.1f} s waiting for 2 MiB pages ({d['moved']['moved_bytes'] >> 20} of "
              f"{d['moved']['total_bytes'] >> 20} MiB moved)", flush=True)
    if decode:
        print("corelm decode: median " + ", ".join(f"{k} {statistics.median(d[k] for d in decode):.2f}"
                                                   for k in ("first", "wait_s", "after")))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "threads": a.threads, "runs": runs, "median": med, "decode": decode}, f,
                      indent=1)


if __name__ == "__main__":
    main()
