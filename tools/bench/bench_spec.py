#!/usr/bin/env python3
"""Speculative decoding against plain decoding, and beside llama.cpp's llama-lookup, llama-speculative and
llama-lookahead on the same prompts: greedy decode tok/s (first to last generated token, prefill left out),
engines alternating within every round, medians over rounds.

    python tools/bench/bench_spec.py --model TARGET.gguf [--draft DRAFT] [--draft-weights q4] [--self-draft q4]
        [--tasks rename summary story code] [--threads 1 2] [--rounds 3] [--tokens 256]
        [--llama-bin DIR] [--out results.json]

Tasks (chat prompts, the model's own template): `rename` rewrites a 35-line class with one attribute renamed
(input-grounded: most of the answer is in the prompt), `summary` summarises a given passage, `story` and
`code` are open-ended (nothing to copy: prompt lookup must cost nothing there). corelm engines: plain,
prompt lookup (adaptive), lookahead (prompt lookup plus the model's own Jacobi guesses, adaptive), the draft
model (adaptive, prompt lookup's copies first where they match) and the target drafting for itself in fewer
bits; with --draft-alone also each draft without the copies.
llama.cpp (with --llama-bin): llama-bench's decode at the prompt's depth as its plain speed, llama-lookup
(3 drafted tokens, its default), llama-speculative with the same draft (4), llama-lookahead."""
import argparse
import json
import os
import re
import statistics
import subprocess
import time

CLASS = '''class Inventory:
    """A store's stock: items, their counts and prices."""

    def __init__(self, name):
        self.name = name
        self.items = {}
        self.prices = {}

    def add(self, item, count, price):
        if count <= 0:
            raise ValueError("count must be positive")
        self.items[item] = self.items.get(item, 0) + count
        self.prices[item] = price

    def remove(self, item, count):
        have = self.items.get(item, 0)
        if count > have:
            raise ValueError(f"only {have} of {item} left")
        self.items[item] = have - count
        if self.items[item] == 0:
            del self.items[item]
            del self.prices[item]

    def value(self):
        total = 0
        for item, count in self.items.items():
            total += count * self.prices[item]
        return total

    def report(self):
        lines = [f"Inventory of {self.name}:"]
        for item in sorted(self.items):
            lines.append(f"  {item}: {self.items[item]} at {self.prices[item]:.2f}")
        lines.append(f"Total value: {self.value():.2f}")
        return "\\n".join(lines)
'''

PASSAGE = ("The town of Alder Creek sits where two rivers meet, and for most of its history the rivers decided "
           "its fortunes. In wet years the lower streets flooded and the mill stopped; in dry years the mill ran "
           "day and night and the town grew. In 1911 the council built a levee along the east bank, paid for by "
           "a tax on every barrel of flour the mill shipped. The levee held through three floods, but it pushed "
           "the water onto the farms across the river, and the farmers sued. The case lasted nine years. The "
           "court finally ordered the town to build a second levee on the west bank and to pay the farmers for "
           "their lost harvests. The town could not afford both, so it sold the mill to a company from the "
           "city, which closed it within a decade. Today the levees still stand, the old mill is a museum, and "
           "the town lives on tourists who come to walk along the rivers that once ruled it.")

TASKS = {
    "rename": "Rename the attribute `items` to `stock` everywhere in this class and show the whole class, "
              "nothing else:\n```python\n" + CLASS + "```",
    "summary": "Summarise this passage in a few sentences, keeping its facts and dates:\n\n" + PASSAGE,
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "code": "Write a Python function that parses one line of CSV with quoted fields, with a docstring and tests.",
}


def corelm_engines(a, threads):
    import corelm
    base = dict(threads=threads, max_seq_len=2048, dtype=a.dtype)
    engines = {"corelm plain": corelm.LLM(a.model, speculative_model=None, **base),
               "corelm prompt lookup": corelm.LLM(a.model, speculative_model="[ngram]", **base),
               "corelm lookahead": corelm.LLM(a.model, speculative_model="[lookahead]", **base)}
    if a.draft:
        engines["corelm draft"] = corelm.LLM(a.model, speculative_model=a.draft, speculative_weights=a.draft_weights,
                                             **base)
    if a.self_draft:
        engines[f"corelm self-draft {a.self_draft}"] = corelm.LLM(a.model, speculative_model="[self]",
                                                                  speculative_weights=a.self_draft, **base)
    if a.draft_alone:   # the same drafts without prompt lookup's copies ahead of them
        alone = {}
        if a.draft:
            alone["corelm draft alone"] = corelm.LLM(a.model, speculative_model=a.draft,
                                                     speculative_weights=a.draft_weights, **base)
        if a.self_draft:
            alone[f"corelm self-draft {a.self_draft} alone"] = corelm.LLM(a.model, speculative_model="[self]",
                                                                          speculative_weights=a.self_draft, **base)
        for llm in alone.values():
            llm.engine.speculator.lookup = None
        engines.update(alone)
    for llm in engines.values():   # decode at its steady speed (see LLM.wait_for_huge_pages)
        llm.wait_for_huge_pages(timeout=300)
    return engines


def run_corelm(llm, prompt, tokens):
    """(decode tok/s, generated tokens, accepted / proposed) of one greedy answer."""
    from corelm import SamplingParams
    llm.reset()
    n, t1 = 0, None
    for chunk in llm.chat_stream([{"role": "user", "content": prompt}], SamplingParams(max_tokens=tokens, temperature=0)):
        if t1 is None:
            t1 = time.perf_counter()
        n += chunk.token_id is not None
    dt = time.perf_counter() - t1
    m = llm.last_metrics
    acc = m["accepted_tokens"] / m["draft_tokens"] if m.get("draft_tokens") else None
    return (n - 1) / dt if n > 1 else 0.0, n, acc


def run_streams(llm, n, tokens):
    """Generated tok/s of n concurrent greedy requests (the tasks' prompts in turn), wall time of the batch."""
    from corelm import SamplingParams
    llm.reset()
    prompts = [[{"role": "user", "content": TASKS[t]}] for t in (list(TASKS) * n)[:n]]
    t0 = time.perf_counter()
    outs = llm.chat(prompts, SamplingParams(max_tokens=tokens, temperature=0))
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def prompt_file(model, prompt):
    """The chat-templated prompt text (as corelm renders it), in a file for the llama.cpp tools."""
    from corelm.loader import load_model
    tok = load_model(model).tokenizer
    path = f"/tmp/bench_spec_{abs(hash(prompt)) % 10**8}.txt"
    with open(path, "w") as f:
        f.write(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))
    return path, len(tok.encode(open(path).read(), add_special_tokens=False))


def run_llama(a, tool, threads, path, depth, tokens):
    """(decode tok/s, generated tokens, acceptance) of one llama.cpp run, as the tool reports them."""
    b = os.path.join(a.llama_bin, tool)
    common = ["-t", str(threads), "-n", str(tokens), "--temp", "0", "-f", path, "-c", "4096"]
    if tool == "llama-bench":
        cmd = [b, "-m", a.model, "-t", str(threads), "-p", "0", "-n", str(tokens), "-d", str(depth), "-r", "1", "-o", "json"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900).stdout
        return json.loads(out)[0]["avg_ts"], tokens, None
    cmd = [b, "-m", a.model] + common
    if tool == "llama-speculative":
        cmd += ["-md", a.draft, "--spec-draft-n-max", "4", "-td", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    m = re.findall(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds?, speed:\s+([\d.]+) t/s", text)
    if not m:
        raise RuntimeError(f"{tool} printed no speed:\n{text[-2000:]}")
    acc = re.search(r"accept\s+=\s+([\d.]+)%", text)
    return float(m[-1][2]), int(m[-1][0]), float(acc.group(1)) / 100 if acc else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="auto", help="the target's dtype in corelm (llama.cpp runs the file as it is)")
    ap.add_argument("--draft", default=None, help="a draft model over the same vocabulary")
    ap.add_argument("--draft-weights", default=None, help="convert the draft to this format first (e.g. q4)")
    ap.add_argument("--self-draft", default=None, help="also the target drafting for itself in this format (e.g. q4)")
    ap.add_argument("--draft-alone", action="store_true",
                    help="also each draft without prompt lookup's copies ahead of it")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--llama-bin", default=None, help="llama.cpp's bin folder (llama-bench, llama-lookup, ...)")
    ap.add_argument("--llama-tools", nargs="+", default=["llama-bench", "llama-lookup", "llama-speculative"],
                    help="which llama.cpp tools run (llama-lookahead too if named; llama-speculative needs --draft)")
    ap.add_argument("--streams", type=int, default=0,
                    help="instead: N concurrent requests, every engine against plain (total generated tok/s)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    results = []
    if a.streams:
        for threads in a.threads:
            llms = corelm_engines(a, threads)
            runs = {k: [] for k in llms}
            for rnd in range(a.rounds):
                for name in (list(llms) if rnd % 2 == 0 else list(llms)[::-1]):
                    runs[name].append(run_streams(llms[name], a.streams, a.tokens))
                    print(f"threads {threads} round {rnd} {a.streams} streams {name}: {runs[name][-1]:.1f} tok/s", flush=True)
            p = statistics.median(runs["corelm plain"])
            tok_s = {k: round(statistics.median(v), 2) for k, v in runs.items()}
            results.append({"threads": threads, "streams": a.streams, "tok_s": tok_s,
                            "ratio": {k: round(v / p, 3) for k, v in tok_s.items()}, "runs": runs})
            print(f"| threads | streams | engine | generated tok/s | vs plain |\n|---|---|---|---|---|")
            for k, v in tok_s.items():
                print(f"| {threads} | {a.streams} | {k} | {v:.1f} | {v / p:.2f}x |")
            del llms
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"model": a.model, "dtype": a.dtype, "tokens": a.tokens, "results": results}, f, indent=1)
        return
    lookahead_kinds = {}
    for threads in a.threads:
        engines = corelm_engines(a, threads)
        llama = []
        if a.llama_bin:
            llama = [t for t in a.llama_tools if t != "llama-speculative" or a.draft]
        files = {t: prompt_file(a.model, TASKS[t]) for t in a.tasks} if llama else {}
        runs = {}
        for rnd in range(a.rounds):
            order = list(engines) + llama
            if rnd % 2:
                order.reverse()
            for task in a.tasks:
                for name in order:
                    if name in engines:
                        r = run_corelm(engines[name], TASKS[task], a.tokens)
                    else:
                        path, depth = files[task]
                        r = run_llama(a, name, threads, path, depth, a.tokens)
                    runs.setdefault((task, name), []).append(r)
                    print(f"threads {threads} round {rnd} {task:8s} {name:28s} {r[0]:7.1f} tok/s  {r[1]} tokens"
                          + (f"  accepted {r[2]:.0%}" if r[2] is not None else ""), flush=True)
        for task in a.tasks:
            plain = statistics.median(r[0] for r in runs[(task, "corelm plain")])
            for name in list(engines) + llama:
                rs = runs[(task, name)]
                tps = statistics.median(r[0] for r in rs)
                accs = [r[2] for r in rs if r[2] is not None]
                results.append({"threads": threads, "task": task, "engine": name, "tok_s": round(tps, 2),
                                "vs_corelm_plain": round(tps / plain, 3), "tokens": rs[0][1],
                                "accepted": round(statistics.median(accs), 3) if accs else None,
                                "runs": [round(r[0], 2) for r in rs]})
        kinds = engines["corelm lookahead"].engine.speculator.kinds   # [proposed, kept] by kind, every run
        lookahead_kinds[threads] = kinds
        print(f"threads {threads} lookahead, kept of proposed by kind (every run): "
              + ", ".join(f"{k} {a} of {p} ({a / p:.0%})" for k, (p, a) in sorted(kinds.items()) if p), flush=True)
        del engines
    print("\n| threads | task | engine | decode tok/s | vs corelm plain | accepted |")
    print("|---|---|---|---|---|---|")
    for r in results:
        acc = f"{r['accepted']:.0%}" if r["accepted"] is not None else ""
        print(f"| {r['threads']} | {r['task']} | {r['engine']} | {r['tok_s']:.1f} | {r['vs_corelm_plain']:.2f}x | {acc} |")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "dtype": a.dtype, "draft": a.draft, "draft_weights": a.draft_weights, "self_draft": a.self_draft,
                       "tokens": a.tokens, "rounds": a.rounds, "results": results,
                       "lookahead_kinds": lookahead_kinds}, f, indent=1)


if __name__ == "__main__":
    main()
