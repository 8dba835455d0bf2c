"""Prefill and decode tok/s of two corelm builds, alternated process by process (A, B, B, A, ...), so a
noisy neighbour on the machine hurts both alike. Each build is a python/ folder holding corelm with its
_core extension (a copy of a checkout's python/ with its built .so in corelm/); a worker that would load
corelm from anywhere else (an editable install, say) stops with an error.

    python tools/bench/ab_builds.py --a /tmp/base/python --b python [--dtypes q4,q8] [--threads 1,2] [--rounds 3]
                              [--model FOLDER_OR_GGUF]

Every worker loads $PEERS/models/qwen0.5b-dims-rand (or --model) at the dtype, warms up, then times --reps requests
of a fresh 128-token random prompt and 64 greedy tokens: prefill = 128 / time to first token, decode =
63 / (time of the last token - time of the first). Prints the medians and the ratio B / A."""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

PEERS = os.environ.get("PEERS", os.path.expanduser("~/corelm-peers"))
MODEL = os.environ.get("AB_MODEL") or os.path.join(PEERS, "models", "qwen0.5b-dims-rand")  # --model sets it for workers
N_PROMPT, N_GEN = 128, 64


def import_build(path):
    """corelm from the build folder `path`. An editable install's import hook (a finder on sys.meta_path)
    outranks PYTHONPATH, so under one both workers would load the installed extension: the hook is
    dropped, and a module from anywhere else is an error."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
    sys.path.insert(0, path)
    try:
        import corelm
        from corelm import _core
    except ImportError as e:
        sys.exit(f"no corelm build at {path} ({e}): copy python/ and put the built _core extension in corelm/")
    for m in (corelm, _core):
        if not os.path.realpath(m.__file__).startswith(os.path.realpath(path) + os.sep):
            sys.exit(f"{m.__name__} came from {m.__file__}, not from the build at {path}")
    return corelm


def worker(dtype, threads, reps):
    corelm = import_build(os.environ["AB_BUILD"])
    dtype, _, act = dtype.partition("+")   # q8+i8 / q8+i16: int8 / int16 activations (else "auto")
    llm = corelm.LLM(MODEL, threads=threads, dtype=dtype, max_seq_len=512, speculative_model=None,
                     **({"activations": {"i8": "int8", "i16": "int16"}[act]} if act else {}))
    llm.wait_for_huge_pages(timeout=300)   # decode at its steady speed (see LLM.wait_for_huge_pages)
    rng = random.Random(1)
    vocab = llm.spec.vocab_size

    def one(n):
        prompt = [rng.randrange(vocab // 32, vocab - 1) for _ in range(N_PROMPT)]  # fresh: no prefix reuse
        params = corelm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0, times = time.perf_counter(), []
        for _ in llm.stream(prompt, params):
            times.append(time.perf_counter())
        return N_PROMPT / (times[0] - t0), (len(times) - 1) / (times[-1] - times[0])

    one(8)
    print("RESULT " + json.dumps([one(N_GEN) for _ in range(reps)]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="python/ folder of build A (the baseline)")
    ap.add_argument("--b", required=True, help="python/ folder of build B")
    ap.add_argument("--dtypes", default="q4,q8", help="comma-separated; a +i8/+i16 suffix (q8+i8) runs activations=\"int8\"/\"int16\"")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2, help="requests timed per worker process")
    ap.add_argument("--model", help="HF folder or .gguf file (default $PEERS/models/qwen0.5b-dims-rand); dtype auto keeps a GGUF's blocks")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker[0], int(a.worker[1]), int(a.worker[2]))
    if a.model:
        os.environ["AB_MODEL"] = os.path.abspath(a.model)
    builds = {"A": os.path.abspath(a.a), "B": os.path.abspath(a.b)}
    keys = [(d, int(t)) for d in a.dtypes.split(",") for t in a.threads.split(",")]
    got = {}
    for r in range(a.rounds):
        for d, t in keys:
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                env = dict(os.environ, AB_BUILD=builds[name])
                o = subprocess.run([sys.executable, os.path.abspath(__file__), "--a", "-", "--b", "-", "--worker", d,
                                    str(t), str(a.reps)], env=env, capture_output=True, text=True)
                line = [s for s in o.stdout.splitlines() if s.startswith("RESULT ")]
                if not line:
                    sys.exit(f"worker {name} {d} {t}t failed:\n{o.stderr[-2000:]}")
                got.setdefault((d, t, name), []).extend(json.loads(line[0][7:]))
    for d, t in keys:
        med = {n: [statistics.median(x[i] for x in got[(d, t, n)]) for i in (0, 1)] for n in ("A", "B")}
        print(f"{d} {t}t  prefill A {med['A'][0]:7.1f} B {med['B'][0]:7.1f} ({med['B'][0] / med['A'][0]:.3f}x)   "
              f"decode A {med['A'][1]:6.1f} B {med['B'][1]:6.1f} ({med['B'][1] / med['A'][1]:.3f}x)   "
              f"n={len(got[(d, t, 'A')])}")


if __name__ == "__main__":
    main()
