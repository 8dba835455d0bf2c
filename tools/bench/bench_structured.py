#!/usr/bin/env python3
"""The cost of structured output: generated tok/s with a JSON schema (llguidance's token mask per sequence
per step) against the same requests unconstrained, at 1 and 16 concurrent streams, alternating round by
round in one process (the order flips every round), medians.

    python tools/bench/bench_structured.py [--model PATH] [--streams 1 16] [--threads 2] [--rounds 3] [--tokens 64]
                                     [--temperature T]

Default model: the embedded SmolLM2-135M-Instruct. Every request asks for a list of things to bring on a
trip, greedy (or sampled at --temperature, request i with seed i), at most --tokens tokens; constrained
ones must match SCHEMA (an object holding an array of strings). The unconstrained run of a request
generates exactly as many tokens as its constrained answer (EOS ignored), so both prefill and generate
the same; tok/s = generated tokens / wall time of the batch."""
import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {"trip": {"type": "string", "maxLength": 40},
                                           "items": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                                     "minItems": 1, "maxItems": 40}},
          "required": ["trip", "items"], "additionalProperties": False}
PROMPT = "List, as JSON, the things to bring on a {} trip."
PLACES = ["camping", "beach", "ski", "city", "desert", "jungle", "sailing", "hiking"]


def run(llm, n, tokens, lengths=None, temperature=0.0):
    """tok/s of n requests: constrained to SCHEMA (lengths None), or unconstrained with request i
    generating exactly lengths[i] tokens (EOS ignored), the constrained answers' own lengths, so both
    runs generate and prefill the same numbers of tokens. Returns (tok/s, each request's tokens)."""
    import corelm
    from corelm import SamplingParams
    prompts = [[{"role": "user", "content": PROMPT.format(PLACES[i % len(PLACES)])}] for i in range(n)]
    if lengths is None:
        so = corelm.StructuredOutputsParams(json=SCHEMA)
        params = [SamplingParams(max_tokens=tokens, temperature=temperature, seed=i, structured_outputs=so)
                  for i in range(n)]
    else:
        params = [SamplingParams(max_tokens=k, temperature=temperature, seed=i, ignore_eos=True)
                  for i, k in enumerate(lengths)]
    t = time.perf_counter()
    outs = llm.chat(prompts, params)
    dt = time.perf_counter() - t
    if lengths is None:
        for o in outs:  # every constrained answer that ended parses (others stopped at the token limit)
            if o.outputs[0].finish_reason == "stop":
                json.loads(o.outputs[0].text)
    counts = [len(o.outputs[0].token_ids) for o in outs]
    return sum(counts) / dt, counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    a = ap.parse_args()
    import corelm
    llm = corelm.LLM(a.model, threads=a.threads, speculative_model=None)  # None: the embedded model
    print(f"model {a.model or 'embedded SmolLM2-135M-Instruct Q4_1'}, {a.threads} threads, at most {a.tokens} tokens, "
          f"temperature {a.temperature}, "
          f"{a.rounds} rounds")
    print("| streams | tokens per request | unconstrained tok/s | json_schema tok/s | ratio |")
    print("|---|---|---|---|---|")
    for n in a.streams:
        _, lengths = run(llm, n, a.tokens, temperature=a.temperature)  # warm-up; the answers' lengths
        run(llm, n, a.tokens, lengths, a.temperature)
        free, cons = [], []
        for r in range(a.rounds):
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                if constrained:
                    rate, counts = run(llm, n, a.tokens, temperature=a.temperature)
                    assert counts == lengths, "the (greedy or seeded) answers changed between runs"
                    cons.append(rate)
                else:
                    free.append(run(llm, n, a.tokens, lengths, a.temperature)[0])
        f, c = statistics.median(free), statistics.median(cons)
        print(f"| {n} | {statistics.mean(lengths):.0f} | {f:.1f} ({min(free):.1f}-{max(free):.1f}) | {c:.1f} "
              f"({min(cons):.1f}-{max(cons):.1f}) | {c / f:.3f}x |")


if __name__ == "__main__":
    main()
