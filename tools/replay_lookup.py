"""What prompt lookup can give on a task at best: the target's greedy answer (plain decode), replayed with
n-gram proposals copied from the prompt and the answer so far, every step's check perfect. Prints tokens
per step and rows per step (1 + tokens proposed) for each proposal length k and number of candidate
continuations (the distinct continuations of the most recent matches of the longest suffix n-gram,
--ngram-max down to --ngram-min; a step keeps the longest accepted one), and with --row-costs the speedup
over plain decode those steps would give when a pass of r rows costs row_costs[r-1] of a 1-row pass.

    python tools/replay_lookup.py --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --tasks summary rename \\
        [--tokens 200] [--row-costs 1 1.155 1.26 1.35 1.52 1.69 1.98 2.28 2.5]

The prompts are tools/bench_spec.py's. Several candidates would need a tree-shaped check (each branch
attending only to its own tokens); this says whether one could pay before building it.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_spec import TASKS  # noqa: E402


def candidates(ctx, k, n_min, n_max, want):
    """Up to `want` distinct continuations (k tokens at most) after the most recent occurrences of the
    longest suffix n-gram of ctx that occurs before its end."""
    for n in range(n_max, n_min - 1, -1):
        if len(ctx) <= n:
            continue
        suffix, found = ctx[-n:], []
        for j in range(len(ctx) - n - 1, -1, -1):
            if ctx[j:j + n] == suffix:
                c = ctx[j + n:j + n + k]
                if c and c not in found:
                    found.append(c)
                    if len(found) >= want:
                        break
        if found:
            return found
    return []


def replay(prompt, answer, k, n_min, n_max, want, row_costs=None):
    """(steps, rows, cost) of the answer's replay. One candidate a step is the engine's own proposer
    (PromptLookup); more are candidates()' (the engine proposes one)."""
    from corelm.engine.speculative import PromptLookup
    lookup = PromptLookup(k_max=k, n_max=n_max, n_min=n_min)
    i = steps = rows = 0
    cost = 0.0
    while i < len(answer):
        if want == 1:
            guess = lookup.propose([(0, prompt + answer[:i], k)]).get(0)
            cands = [guess] if guess else []
        else:
            cands = candidates(prompt + answer[:i], k, n_min, n_max, want)
        best = 0
        for c in cands:
            a = 0
            while a < len(c) and i + a < len(answer) and c[a] == answer[i + a]:
                a += 1
            best = max(best, a)
        r = 1 + sum(len(c) for c in cands)
        steps, rows = steps + 1, rows + r
        if row_costs:
            cost += row_costs[min(r, len(row_costs)) - 1]
        i += best + 1
    return steps, rows, cost


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", nargs="+", default=["summary", "rename"], choices=sorted(TASKS))
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--k", nargs="+", type=int, default=[2, 4, 8], help="proposal lengths")
    ap.add_argument("--candidates", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--row-costs", nargs="+", type=float, default=None,
                    help="a pass of r rows costs the r-th value (of a 1-row pass); past the last, the last")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import corelm
    from corelm import SamplingParams
    llm = corelm.LLM(a.model, threads=a.threads, max_seq_len=4096, speculative_model=None)
    for task in a.tasks:
        out = llm.chat([[{"role": "user", "content": TASKS[task]}]],
                       SamplingParams(max_tokens=a.tokens, temperature=0))[0]
        prompt, answer = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        print(f"{task}: {len(answer)} tokens after a {len(prompt)}-token prompt")
        for k in a.k:
            for want in a.candidates:
                steps, rows, cost = replay(prompt, answer, k, a.ngram_min, a.ngram_max, want, a.row_costs)
                line = (f"  k {k} candidates {want}: {len(answer) / steps:.2f} tokens a step, "
                        f"{rows / steps:.2f} rows a step")
                if a.row_costs:
                    line += f", x{len(answer) / cost:.2f} over plain decode"
                print(line, flush=True)


if __name__ == "__main__":
    main()
