"""Speculative decoding (engine/speculative.py): prompt lookup, lookahead, a draft model and a self-draft are lossless.
Greedy and seeded sampled output, logprobs, stop strings, max/min tokens and chat are token-for-token what
plain decoding gives; rejected guesses never reach the prefix cache and leave no KV blocks behind; the
sampled distribution passes a two-sample chi-square test against plain decoding."""
import os
import re
import time

import numpy as np
import pytest

from conftest import DEFAULT_GGUF, MODELS

import corelm
from corelm import SamplingParams
from corelm.engine.scheduler import BlockManager
from corelm.engine.speculative import Acceptance, Lookahead, PromptLookup, Proposer, SpecGuard, StepCosts, plan_lengths

STORIES = os.path.join(MODELS, "stories260K")
STORIES_GGUF = os.path.join(STORIES, "stories260K.gguf")
QWEN = os.path.join(MODELS, "tiny-qwen2")
OLMOE = os.path.join(MODELS, "tiny-olmoe")
# a prompt whose continuation repeats itself, so prompt lookup has something to copy
STORY = "Once upon a time, there was a little girl named Lily. Lily liked to play. Once upon a time, there was"


# --- the proposers alone -------------------------------------------------------------------------------

def test_prompt_lookup_copies_what_followed_the_latest_match():
    p = PromptLookup(k_max=3, n_max=3, n_min=1)
    toks = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7]
    # the trigram (5, 6, 7) occurred at 0 (then 8 9 5) and at 5 (then 1 2 5): the latest wins
    assert p.propose([("a", toks, 3)]) == {"a": [1, 2, 5]}
    assert p.propose([("a", toks + [1], 2)]) == {"a": [2, 5]}        # the index grows with the tokens
    assert p.propose([("b", [1, 2, 3, 4], 3)]) == {}                  # nothing repeats: no proposal
    assert p.propose([("c", [4, 4], 3)]) == {"c": [4]}               # only what exists after the match
    p.forget("a")
    assert p.propose([("a", [9, 9, 9], 2)]) == {"a": [9]}            # a new sequence under an old key


def check_chain(proposer, model, tokens, k):
    """One step as the scheduler runs it, on a model given as a function of the tokens so far (its greedy
    next token): propose, check every row, keep the agreeing prefix and the model's token at the first
    miss, tell the proposer with every row's prediction. Returns (proposal, label, accepted)."""
    d = proposer.propose([("s", tokens, k)]).get("s", [])
    label = proposer._matched.get("s")
    preds = [model(tokens + d[:j]) for j in range(len(d) + 1)]
    accepted = next((j for j in range(len(d)) if d[j] != preds[j]), len(d))
    n_before = len(tokens)
    tokens += preds[:accepted + 1]
    if d:
        proposer.verified("s", n_before, len(d), accepted, np.asarray(preds))
    return d, label, accepted


def test_lookahead_proposes_the_models_own_jacobi_guesses():
    """A model whose next token depends only on the position (so nothing in the text ever repeats, and
    prompt lookup has nothing to copy): after one missed guess, the rows after the miss predicted the next
    tokens, and the following step proposes them and they are all kept."""
    model = lambda toks: 100 + len(toks)
    p = Lookahead(k_max=4)
    tokens = [1, 2, 1]
    # only a one-token match ("1" was followed by "2"): proposed as a seed, and missed at once
    assert check_chain(p, model, tokens, 4) == ([2, 1], ("text", 1), 0)
    assert tokens == [1, 2, 1, 103]
    d, label, accepted = check_chain(p, model, tokens, 4)
    assert (d, label, accepted) == ([104, 105], "jacobi", 2)     # the rows after the miss were right
    assert tokens[-3:] == [104, 105, 106]
    assert p.stats.proposed == 4 and p.stats.accepted == 2
    assert PromptLookup(k_max=4).propose([("s", tokens, 4)]) == {}  # what prompt lookup would have had
    assert p.propose([("s", tokens, 4)]) == {}   # all kept: no leftover guess, and nothing to match
    p.forget("s")
    assert not p._pool and not p._jacobi and not any(k[0] == "s" for k in p._acceptance)


def test_lookahead_pool_holds_the_guessed_n_grams():
    p = Lookahead(k_max=4)
    tokens = [5, 6, 7, 5]
    assert p.propose([("s", tokens, 4)]) == {"s": [6, 7, 5]}     # a one-token match
    tokens.append(8)                                            # the model's token at the missed first row
    p.verified("s", 4, 3, 0, np.array([8, 9, 10, 11]))
    # the rows after the miss: the next Jacobi guess
    assert p.propose([("s", tokens, 4)]) == {"s": [9, 10, 11]} and p._matched["s"] == "jacobi"
    assert p.propose([("s", tokens, 2)]) == {"s": [9, 10]}
    # the sequence moves on without a check (the planner gave it no rows): a guessed n-gram now ends the
    # text, and its predicted continuation is proposed from the pool
    tokens.append(9)
    assert p.propose([("s", tokens, 4)]) == {"s": [10, 11]} and p._matched["s"] == ("guess", 4)
    # what each rejected row read, then its prediction: "6" was read at row 1, and 9 predicted after it
    assert p.propose([("t", [6, 6], 4)]) == {"t": [6]}          # another sequence: its own pool only
    assert p.propose([("s", tokens + [3, 5, 6], 4)]) == {"s": [9, 10, 11]}
    assert p._matched["s"] == ("guess", 2)
    # the text's occurrence, more recent than the guess, wins over it
    tokens += [10, 12, 5, 8, 9]
    assert p.propose([("s", tokens, 4)]) == {"s": [10, 12, 5, 8]} and p._matched["s"] == ("text", 3)
    # a continuation predicted twice beats a newer one predicted once
    q = Lookahead(k_max=4)
    pool = q._pool.setdefault("s", {})
    q._indexed("s", [1, 2])
    for made, cont in ((2, [7]), (3, [7]), (4, [8])):
        q._remember(pool, [1, 2], cont, made)
    assert q._match("s", [1, 2], 2, 4) == (("guess", 2), [7])
    # a pool past its size drops its oldest n-grams
    q = Lookahead(k_max=4, n_max=1, n_min=1, max_grams=8)
    pool = q._pool.setdefault("s", {})
    for t in range(9):
        q._remember(pool, [t], [t + 1], t)
    assert sorted(g for (g,) in pool) == [2, 3, 4, 5, 6, 7, 8]


def test_acceptance_estimate_learns_and_drifts_back():
    a = Acceptance(prior=0.6)
    for _ in range(20):
        a.update(4, 0)            # every first guess missed
    assert a.rate < 0.05
    for _ in range(100):
        a.idle()                  # not asked: the estimate drifts back toward the prior, to be probed again
    assert 0.5 < a.rate < 0.6
    for _ in range(20):
        a.update(4, 4)
    assert a.rate > 0.95


def test_a_new_sequence_starts_from_what_its_kind_of_guess_was_kept_at():
    """A fixed prior that does not pay (a draft pass costing a third of the model's) would never be probed,
    so every request after the first would go unspeculated: new sequences start from the proposer's
    acceptance over earlier ones."""
    kept = Proposer(4)
    assert abs(kept.acceptance("a").rate - 0.6) < 1e-9   # nothing known yet: the default prior
    for _ in range(10):
        kept.verified("a", 10, 4, 4)
    kept.forget("a")
    assert kept.acceptance("b").rate > 0.9
    missed = Proposer(4)
    for _ in range(10):
        missed.verified("a", 10, 4, 0)
    assert abs(missed.acceptance("b").rate - 0.6) < 1e-9   # earlier misses do not keep a new one from a try
    # prompt lookup pools by n-gram size: what 4-gram matches did says nothing about 2-gram ones
    p = PromptLookup()
    p._matched["a"] = 4
    for _ in range(10):
        p.verified("a", 10, 4, 4)
    p._matched["b"] = 4
    assert p.acceptance("b").rate > 0.9
    p._matched["c"] = 2
    assert abs(p.acceptance("c").rate - 0.6) < 1e-9


def test_plan_gives_rows_only_where_they_pay():
    costs = StepCosts()
    assert plan_lengths([0.9], [8], 1, costs) == [0]           # nothing measured yet: measure plain first
    costs.record(1, 0.030)
    for rows in range(2, 10):
        costs.record(rows, 0.030 * (1 + 0.15 * (rows - 1)))  # each row costs 15% of a plain pass
    k = plan_lengths([0.9], [8], 1, costs)[0]
    assert 3 <= k <= 8
    assert plan_lengths([0.1], [8], 1, costs) == [0]           # guesses that miss are not worth a row
    assert plan_lengths([0.9], [2], 1, costs) == [2]           # no more than what there is
    # a draft model's passes cost too: a slow draft gets fewer tokens, a hopeless one none
    assert plan_lengths([0.9], [8], 1, costs, pass_seconds=0.006)[0] < k
    assert plan_lengths([0.9], [8], 1, costs, pass_seconds=0.05) == [0]
    # copied guesses (drafted False) cost no drafting pass: a slow draft does not hold them back
    assert plan_lengths([0.9], [8], 1, costs, pass_seconds=0.05, drafted=[False]) == [k]
    copied, drafted = plan_lengths([0.9, 0.9], [8, 8], 2, costs, pass_seconds=0.05, drafted=[False, True])
    assert copied > 0 and drafted == 0
    # a draft that must first read what was copied since it last ran is charged that reading
    assert plan_lengths([0.9], [8], 1, costs, pass_seconds=0.006, catch_up=[0.0])[0] > 0
    assert plan_lengths([0.9], [8], 1, costs, pass_seconds=0.006, catch_up=[0.2]) == [0]
    # two sequences share the extra rows, the better guesser first
    a, b = plan_lengths([0.95, 0.5], [8, 8], 2, costs)
    assert a > b
    # a batch whose pass costs as much per row as it saves gets none
    flat = StepCosts()
    for rows in range(1, 30):
        flat.record(rows, 0.01 * rows)
    assert plan_lengths([0.9] * 16, [8] * 16, 16, flat) == [0] * 16


def test_stale_costs_are_measured_again():
    costs = StepCosts(max_age=5)
    costs.record(1, 0.030)
    costs.record(4, 0.300)                   # measured once while the host was slow
    assert costs.cost(4) == 0.300
    for _ in range(6):
        costs.record(1, 0.020)               # plain passes only since
    assert abs(costs.cost(4) - costs.cost(1) * 1.3) < 1e-12   # stale: estimated again, so it gets tried


def test_guard_pauses_speculation_that_does_not_pay():
    g = SpecGuard(min_steps=4, pause=10)
    g.record(1, False, 1, 0.050)              # one plain step says little: no verdict on it
    for _ in range(6):
        g.record(1, True, 1, 0.045)
    assert g.allowed(1)
    g = SpecGuard(min_steps=4, pause=10)
    for _ in range(5):
        g.record(1, False, 1, 0.030)          # plain: 33 tokens/s
    for _ in range(4):
        assert g.allowed(1)
        g.record(1, True, 1.2, 0.045)         # with proposals: 27 tokens/s
    assert [g.allowed(1) for _ in range(11)] == [False] * 10 + [True]
    assert g.allowed(2)                       # other batch sizes are judged on their own
    for _ in range(6):
        g.record(1, True, 3, 0.050)           # retried, and now it pays
    assert g.allowed(1)
    for _ in range(40):
        g.record(1, True, 1.2, 0.045)
    assert not g.allowed(1)
    g.resume()                                # a new sequence: judged afresh
    assert g.allowed(1) and g.allowed(1)
    g = SpecGuard(min_steps=4, pause=10)
    for _ in range(8):
        g.record(1, False, 1, 0.030)
    for tokens in [4] * 4 + [1] * 8:         # 2 tokens a 50 ms step: 8 misses in a row do not trip it
        g.record(1, True, tokens, 0.050)
    assert g.allowed(1)


@pytest.mark.parametrize("bad", [0, 17, 2.5, "4", True])
@pytest.mark.parametrize("cls", [PromptLookup, Lookahead])
def test_bad_proposal_lengths_are_refused(bad, cls):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        cls(k_max=bad)


# --- lossless through the engine ----------------------------------------------------------------------

def run(llm, prompts, params):
    llm.reset()
    out = llm.generate(prompts, params)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [sorted(d.items()) for d in c.logprobs]) for c in o.outputs] for o in out]


# Several sequences at once: q8 weights, whose kernels give a row the same bits in a batch of any size.
# (bf16 batches of 2+ rows round activations to bf16 where AVX512_BF16 runs them, decode does not: the
# plain baseline itself then depends on the batch, so float models are compared one sequence at a time.)
Q8 = dict(threads=2, dtype="q8")
FIXED = dict(speculative_adaptive=False)   # tiny models: a draft pass costs what a target pass does, so the
                                           # planner would rightly never speculate; these tests make it


PLAIN = dict(speculative_model=None)


@pytest.fixture(scope="module")
def plain_stories():
    return corelm.LLM(STORIES_GGUF, max_num_seqs=2, **Q8, **PLAIN)


PARAMS = [
    SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, max_tokens=60, n=2, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=80, stop=["Lily liked"], include_stop_str_in_output=True),
    SamplingParams(temperature=1.0, seed=3, top_k=5, repetition_penalty=1.1, max_tokens=40, min_tokens=30),
]


@pytest.mark.parametrize("spec", [dict(speculative_model="[ngram]"),
                                  dict(speculative_model="[ngram]", speculative_adaptive=True),
                                  dict(speculative_model="[ngram]", num_speculative_tokens=7, prompt_lookup_min=1),
                                  dict(speculative_model="[lookahead]"),
                                  dict(speculative_model="[lookahead]", num_speculative_tokens=5, prompt_lookup_max=3,
                                       prompt_lookup_min=3),
                                  dict(speculative_model="[lookahead]", speculative_adaptive=True),
                                  dict(speculative_model=STORIES_GGUF, num_speculative_tokens=3),
                                  dict(speculative_model=QWEN),      # another model over the same tokenizer
                                  dict(speculative_model="[self]", speculative_weights="q4")])
def test_output_is_unchanged_by_speculation(plain_stories, spec):
    llm = corelm.LLM(STORIES_GGUF, max_num_seqs=2, **Q8, **{**FIXED, **spec})
    prompts = [STORY, "Tim had a big red ball. Tim had a big"]
    # a stop id the greedy answer meets at its 12th token (the generation must end exactly there)
    stop_id = run(plain_stories, prompts[:1], PARAMS[0])[0][0][0][11]
    for params in PARAMS + [SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[stop_id])]:
        assert run(llm, prompts, params) == run(plain_stories, prompts, params), params
    stats = llm.engine.speculator.stats
    # adaptive lookahead probes its weak guesses sparingly (how much, the step timings decide)
    assert stats.proposed > (10 if spec == dict(speculative_model="[lookahead]", speculative_adaptive=True) else 50)
    assert stats.accepted <= stats.proposed
    assert stats.accepted > 0 or spec["speculative_model"] == QWEN   # a random-weight draft guesses wrong
    assert llm.engine.scheduler.blocks.num_free == llm.engine.core.kv_blocks   # every block came back


@pytest.mark.parametrize("source, dtype", [(STORIES, "fp32"), (STORIES, "bf16"), (QWEN, "bf16"), (OLMOE, "bf16"),
                                           (QWEN, "q4")])
def test_greedy_float_and_moe_models_are_unchanged(source, dtype):
    """fp32 and bf16 weights take the row-exact kernel table for the check (on AVX512_BF16 CPUs the bf16
    batch kernel rounds activations to bf16, decode does not)."""
    plain = corelm.LLM(source, dtype=dtype, threads=2, **PLAIN)
    spec = corelm.LLM(source, dtype=dtype, threads=2, speculative_model="[self]", speculative_weights="q8", **FIXED,
                      num_speculative_tokens=5)
    ids = plain.encode_prompt("Once upon a time") if source == STORIES else list(range(5, 30)) * 2
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    assert run(spec, [ids], params) == run(plain, [ids], params)
    assert spec.engine.speculator.stats.accepted > 0


def test_a_draft_model_copies_from_the_text_first(plain_stories):
    """With a draft model, a sequence whose text repeats is proposed the copy (no drafting pass) and the
    others are drafted; the output is plain decoding's either way, and a copy that stops being kept hands
    the sequence back to the draft."""
    llm = corelm.LLM(STORIES_GGUF, max_num_seqs=2, **Q8, **FIXED, speculative_model=STORIES_GGUF,
                     num_speculative_tokens=3)
    spec = llm.engine.speculator
    assert spec.lookup is not None and spec.copy_k_max == 3
    prompts = [STORY, "Tim had a big red ball. Tim had a big"]
    for params in PARAMS[:2]:
        assert run(llm, prompts, params) == run(plain_stories, prompts, params), params
    assert 0 < spec.copied.accepted <= spec.copied.proposed
    assert spec.stats.proposed > spec.copied.proposed          # the draft drafted too
    # the choice, per sequence: the copy where it gives more tokens a second than drafting would (each at
    # its acceptance and best length; a copy costs its rows, a draft its rows and passes; before the costs
    # are known: the copy where it is kept at least as often)
    spec._acceptance[("s", "draft")] = Acceptance(prior=0.9)
    spec._acceptance[("s", ("copy", 2))] = Acceptance(prior=0.5)
    tokens = [5, 6, 7, 8, 5, 6]
    assert spec.copy([("s", tokens, 3)]) == {}
    spec._state["s"] = [[], len(tokens) - 1]   # the draft has read the text: no catch-up
    spec.pass_seconds = 0.002
    assert spec.copy([("s", tokens, 3)], 0.030, 0.003) == {}      # the draft's passes are cheap
    spec.pass_seconds = 0.030
    assert spec.copy([("s", tokens, 3)], 0.030, 0.003) == {"s": [7, 8, 5]}   # each pass costs a step
    spec._acceptance[("s", ("copy", 2))] = Acceptance(prior=0.95)
    assert spec.copy([("s", tokens, 3)]) == {"s": [7, 8, 5]}
    # the reading a draft owes (tokens it has not seen) is charged by how often checks lately kept a copy
    spec.read_seconds = 0.001
    spec._state["s"][1] = 2
    assert spec.catch_up_seconds("s", tokens) == 0.0     # no copy kept yet: the reading serves the drafts ahead
    spec.copy([("s", tokens, 3)])
    spec.verified("s", len(tokens), 3, 1)
    assert spec.catch_up_seconds("s", tokens + [7]) == pytest.approx(0.004 * 0.2)
    spec._acceptance[("s", "draft")] = Acceptance(prior=0.1)   # copies win every step
    for _ in range(30):
        assert spec.copy([("s", tokens, 3)])
        spec.verified("s", len(tokens), 3, 2)
    assert spec.catch_up_seconds("s", tokens + [7]) == pytest.approx(0.004, rel=0.01)   # an edit: in full
    # an n-gram size a sequence has not copied yet starts from how its other copies fared (on open-ended
    # code a 2-gram's copies miss: its 3-grams' should not start at the prior again)
    spec._acceptance[("u", "draft")] = Acceptance(prior=0.1)
    for _ in range(2):
        assert spec.copy([("u", tokens, 3)])
        spec.verified("u", len(tokens), 3, 0)
    spec._copied["u"] = spec._copied["v"] = 3
    assert spec.acceptance("u").rate < 0.3
    assert spec.acceptance("v").rate >= 0.6   # no copies yet: the prior
    for key in ("s", "u", "v"):
        spec.forget(key)
    assert "s" not in spec.lookup._index and not [k for k in spec._acceptance if k[0] == "s"]
    assert not spec._copies_kept


@pytest.mark.parametrize("proposer", ["[ngram]", "[lookahead]"])
def test_chat_is_unchanged(plain_stories, proposer):
    llm = corelm.LLM(STORIES_GGUF, **Q8, **FIXED, speculative_model=proposer)
    messages = [{"role": "user", "content": STORY}]
    params = SamplingParams(temperature=0, max_tokens=50)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    a = llm.chat(messages, params, chat_template=template)[0].outputs[0]
    b = plain_stories.chat(messages, params, chat_template=template)[0].outputs[0]
    assert (a.token_ids, a.text) == (b.token_ids, b.text)


def test_structured_output_is_unchanged_by_speculation():
    """A grammar masks every checked row in turn, advanced only by the tokens kept: greedy and seeded
    sampled output under a JSON schema and a regex are what plain decoding gives, valid, and proposals
    were made and accepted (the answer repeats itself, so lookup has something to copy)."""
    pytest.importorskip("llguidance")
    from corelm.engine.guided import StructuredOutputsParams
    schema = {"type": "array", "minItems": 6, "maxItems": 6,
              "items": {"type": "object", "properties": {"name": {"enum": ["Lily", "Tim"]}, "age": {"type": "integer"}},
                        "required": ["name", "age"], "additionalProperties": False}}
    spec = corelm.LLM(DEFAULT_GGUF, **Q8, **FIXED, speculative_model="[ngram]", max_num_seqs=2)
    plain = corelm.LLM(DEFAULT_GGUF, **Q8, **PLAIN, max_num_seqs=2)
    prompt = 'List six children as JSON: [{"name": "Lily", "age": 5}, {"name": "Tim", "age": 6}, '
    for so in (StructuredOutputsParams(json=schema), StructuredOutputsParams(regex=r"(Lily|Tim) is [0-9]( and (Lily|Tim) is [0-9]){5}")):
        params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=so),
                  SamplingParams(temperature=0.7, seed=5, max_tokens=120, n=2, structured_outputs=so)]
        for p in params:
            assert run(spec, [prompt], p) == run(plain, [prompt], p), (so, p)
    got = spec.generate([prompt], params[0])[0].outputs[0].text
    assert re.fullmatch(r"(Lily|Tim) is [0-9]( and (Lily|Tim) is [0-9]){5}", got), got
    stats = spec.engine.speculator.stats
    assert stats.accepted > 10 and stats.accepted <= stats.proposed
    assert spec.engine.scheduler.blocks.num_free == spec.engine.core.kv_blocks


@pytest.mark.parametrize("proposer", ["[ngram]", "[lookahead]"])
def test_batched_speculation_keeps_cache_clean(proposer):
    """Several sequences speculate in one pass; the prefix cache only ever holds blocks of tokens that
    were kept, and every block is free again at the end."""
    llm = corelm.LLM(STORIES_GGUF, **Q8, **FIXED, speculative_model=proposer, max_num_seqs=3)
    plain = corelm.LLM(STORIES_GGUF, **Q8, **PLAIN, max_num_seqs=3)
    prompts = [STORY, STORY + " a", "Tim had a big red ball. Tim had a big", "The cat sat. The cat sat. The"]
    params = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    sched = llm.engine.scheduler
    kept = set()
    for o in got:
        toks, h = list(o.prompt_token_ids) + list(o.outputs[0].token_ids), 0
        for i in range(len(toks) // sched.block_size):
            h = BlockManager.chain_hash(h, tuple(toks[i * sched.block_size:(i + 1) * sched.block_size]))
            kept.add(h)
    assert sched.blocks.cached and set(sched.blocks.cached) <= kept
    assert sched.blocks.num_free == llm.engine.core.kv_blocks
    assert llm.engine.speculator.stats.accepted > 20


def test_lookahead_learns_from_every_checked_row(plain_stories):
    """Through the engine: the proposer is told each checked row's argmax (greedy: the kept tokens, then
    the model's guesses after the miss), and proposals from those guesses, not only copies of the text,
    are made and kept; output is plain's, over several sequences at once."""
    llm = corelm.LLM(STORIES_GGUF, **Q8, **FIXED, speculative_model="[lookahead]", max_num_seqs=2)
    spec = llm.engine.speculator
    checked = []
    verified = spec.verified

    def spy(key, n_before, proposed, accepted, predictions=None):
        tokens = spec._last[key][0]
        assert predictions is not None and len(predictions) == proposed + 1
        checked.append(list(predictions[:accepted + 1]) == tokens[n_before:n_before + accepted + 1])
        verified(key, n_before, proposed, accepted, predictions)

    spec.verified = spy
    prompts = [STORY, "Tim had a big red ball.", "The sun"]
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    assert run(llm, prompts, params) == run(plain_stories, prompts, params)
    assert checked and all(checked)
    kinds = spec.kinds
    assert set(kinds) == {"text", "guess", "jacobi"}, kinds
    assert kinds["guess"][1] > 10 and kinds["jacobi"][1] > 0, kinds
    assert sum(p for p, _ in kinds.values()) == spec.stats.proposed
    assert not spec._pool and not spec._last   # every sequence was forgotten at its end


def test_sampled_distribution_matches_plain_decoding():
    """Two-sample chi-square test (homogeneity) of the 2nd and 3rd sampled tokens, 600 samples each, plain
    vs a draft that always proposes its argmax (so many guesses are rejected at temperature 1): with the
    test at alpha = 0.001, a correct sampler fails it once in a thousand seed sets; these seeds are fixed,
    so the test is deterministic."""
    n = 600
    params = SamplingParams(temperature=1.0, seed=11, n=n, max_tokens=3, ignore_eos=True)
    params_b = SamplingParams(temperature=1.0, seed=50_000, n=n, max_tokens=3, ignore_eos=True)
    plain = corelm.LLM(STORIES_GGUF, **Q8, **PLAIN, max_num_seqs=4)
    spec = corelm.LLM(STORIES_GGUF, **Q8, **FIXED, max_num_seqs=2, speculative_model=STORIES_GGUF,
                      num_speculative_tokens=2)
    prompt = "Once upon a time, there was a"
    a = [c.token_ids for c in plain.generate([prompt], params)[0].outputs]
    b = [c.token_ids for c in spec.generate([prompt], params_b)[0].outputs]
    assert spec.engine.speculator.stats.proposed > 300 and spec.engine.speculator.stats.accepted > 50
    for pos in (1, 2):
        cats = sorted({t[pos] for t in a + b})
        table = np.array([[sum(t[pos] == c for t in a) for c in cats], [sum(t[pos] == c for t in b) for c in cats]])
        big = table.sum(0) >= 10          # pool rare tokens so expected counts are not tiny
        table = np.column_stack([table[:, big], table[:, ~big].sum(1)]) if (~big).any() else table[:, big]
        stat, critical = chi_square(table)
        assert stat < critical, (pos, stat, critical, table)


def chi_square(table):
    """Pearson's statistic for a 2 x k contingency table and its critical value at alpha = 0.001 for
    (k - 1) degrees of freedom (the Wilson-Hilferty approximation, within 1% from 3 degrees on)."""
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    z = 3.0902   # the standard normal's 0.999 quantile
    return stat, df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


# --- options ------------------------------------------------------------------------------------------

def test_speculation_options_are_checked():
    with pytest.raises(ValueError, match="need speculative_model"):
        corelm.LLM(STORIES_GGUF, speculative_model=None, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        corelm.LLM(STORIES_GGUF, speculative_model="[ngram]", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="vocabulary differs"):
        corelm.LLM(STORIES_GGUF, speculative_model=DEFAULT_GGUF)   # SmolLM2's 49152 tokens
    for proposer in ("[ngram]", "[lookahead]"):
        with pytest.raises(ValueError, match="prompt lookup"):
            corelm.LLM(STORIES_GGUF, speculative_model=proposer, speculative_weights="q4")
    for bad in ("[lookahed]", "[]", 3):
        with pytest.raises(ValueError, match="speculative_model"):
            corelm.LLM(STORIES_GGUF, speculative_model=bad)
    assert isinstance(corelm.LLM(STORIES_GGUF, speculative_model="[lookahead]").engine.speculator, Lookahead)
    for lo, hi in ((0, 4), (3, 2), ("2", 4), (2, 17)):
        with pytest.raises(ValueError, match="n-gram sizes"):
            corelm.LLM(STORIES_GGUF, prompt_lookup_min=lo, prompt_lookup_max=hi)
    with pytest.raises(ValueError, match="speculative_adaptive"):
        corelm.LLM(STORIES_GGUF, speculative_adaptive="yes")


def test_draft_reads_a_long_prompt_in_chunks(monkeypatch):
    """A prompt longer than READ_CHUNK reaches the draft in several passes, and output is still plain's."""
    from corelm.engine import speculative
    monkeypatch.setattr(speculative, "READ_CHUNK", 7)
    ids = list(range(5, 45))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = corelm.LLM(STORIES_GGUF, **Q8, **PLAIN)
    spec = corelm.LLM(STORIES_GGUF, **Q8, **FIXED, speculative_model=STORIES_GGUF)
    assert run(spec, [ids], params) == run(plain, [ids], params)
    assert spec.engine.spec_counts()["accepted_tokens"] > 0


def test_a_draft_reading_the_prompt_is_not_a_pass_cost(monkeypatch):
    """The step that finishes a prompt also has the draft read it; that time is the draft's, not what a pass
    of the prompt's rows costs, so StepCosts (which the planner prices proposals with) leaves it out: a
    2-token prompt's pass counted a slow draft's reading as a 2-row pass, and no proposal paid after."""
    spec = corelm.LLM(STORIES_GGUF, **Q8, speculative_model=STORIES_GGUF)
    read = spec.engine.speculator.read_prompts

    def slow_read(items):
        time.sleep(0.5)
        return read(items)

    monkeypatch.setattr(spec.engine.speculator, "read_prompts", slow_read)
    spec.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert spec.engine.scheduler.step_costs.seconds[3] < 0.25


def test_a_draft_skips_prompts_while_the_planner_declines_to_draft(monkeypatch):
    """Where the planner has drafted nothing for 16 steps at this many sequences (many streams), a finished
    prompt is not read by the draft (that reading was 9% of 16 streams' time); a sequence that is drafted
    for later has its prompt read first, and the output is plain's throughout."""
    from corelm.engine import scheduler as sched
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8] for i in range(3)]
    plain = corelm.LLM(STORIES_GGUF, **Q8, **PLAIN)
    spec = corelm.LLM(STORIES_GGUF, **Q8, speculative_model=STORIES_GGUF)
    reads = []
    read = spec.engine.speculator.read_prompts
    monkeypatch.setattr(spec.engine.speculator, "read_prompts", lambda items: (reads.append([k for k, _ in items]),
                                                                              read(items)))
    monkeypatch.setattr(sched, "plan_lengths", lambda rates, limits, *a, **k: [0] * len(rates))
    expect = run(plain, prompts, params)
    assert run(spec, prompts, params) == expect    # learns that it declines at 3 sequences
    reads.clear()
    assert run(spec, prompts, params) == expect
    assert not reads and len(spec.engine.scheduler._unread) == 0   # none read; the finished ones forgotten
    monkeypatch.setattr(sched, "plan_lengths", lambda rates, limits, *a, **k: list(limits))  # now it drafts
    spec.engine.scheduler._declined = {3: sched.DECLINED_STEPS}
    assert run(spec, prompts, params) == expect
    assert reads and spec.engine.spec_counts()["draft_tokens"] > 0   # read when first drafted for


# --- every entry point --------------------------------------------------------------------------------

def test_cli_generate_and_chat_take_draft_flags(tmp_path):
    import subprocess
    import sys
    base = [sys.executable, "-m", "corelm.entrypoints.cli"]
    env = dict(os.environ)
    cmd = ["generate", STORIES_GGUF, "-p", STORY, "-n", "40", "--temp", "0", "--ignore-eos", "-v"]
    plain = subprocess.run(base + cmd + ["--draft-model", "[none]"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert plain.returncode == 0 and "draft:" not in plain.stderr, plain.stderr
    for proposer in ("[ngram]", "[lookahead]"):
        spec = subprocess.run(base + cmd + ["--draft-model", proposer, "--draft-tokens", "5"], capture_output=True,
                              text=True, env=env, timeout=300)
        assert spec.returncode == 0, spec.stderr
        assert spec.stdout == plain.stdout and "draft:" in spec.stderr
    chat = subprocess.run(base + ["chat", STORIES_GGUF, "--draft-model", STORIES_GGUF, "--temp", "0", "-n", "20",
                                  "-v"], input="Once upon a time\n/bye\n", capture_output=True, text=True, env=env,
                          timeout=300)
    assert chat.returncode == 0 and "draft:" in chat.stderr, chat.stderr
    bad = subprocess.run(base + ["generate", STORIES_GGUF, "-p", "x", "--draft-weights", "q4"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "prompt lookup" in bad.stderr


def test_server_metrics_count_draft_tokens():
    from test_server import running_server
    httpx = pytest.importorskip("httpx")
    llm = corelm.LLM(STORIES_GGUF, **Q8, **FIXED, speculative_model="[ngram]")
    with running_server(lambda: llm, api_key=None) as s:
        assert s.state.wait_ready(60)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": STORY, "max_tokens": 40, "temperature": 0,
                                                        "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
        plain = corelm.LLM(STORIES_GGUF, **Q8, speculative_model=None).generate([STORY], SamplingParams(temperature=0, max_tokens=40,
                                                                               ignore_eos=True))[0].outputs[0].text
        assert r.json()["choices"][0]["text"] == plain
        text = httpx.get(s.url + "/metrics").text
        drafted = int(next(line.split()[1] for line in text.splitlines()
                           if line.startswith("corelm_spec_decode_draft_tokens_total")))
        accepted = int(next(line.split()[1] for line in text.splitlines()
                            if line.startswith("corelm_spec_decode_accepted_tokens_total")))
        assert drafted > 0 and 0 < accepted <= drafted


def test_batch_worker_speculates():
    from corelm.entrypoints.batch.worker import BatchWorker
    from test_server import batch_answer
    body = {"prompt": STORY, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    plain, err = batch_answer(BatchWorker(STORIES_GGUF, 2, {"dtype": "q8", "speculative_model": None}),
                              "/v1/completions", body)
    worker = BatchWorker(STORIES_GGUF, 2, {"dtype": "q8", "speculative_model": "[ngram]", **FIXED})
    spec, err2 = batch_answer(worker, "/v1/completions", body)
    assert err is None and err2 is None
    assert spec["response"]["body"]["choices"] == plain["response"]["body"]["choices"]
    assert worker.engine.spec_counts()["accepted_tokens"] > 0


def test_real_pair_is_unchanged():
    """Qwen2.5-Coder-1.5B (Q4_K_M) with the 0.5B drafting in q4, and with prompt lookup: greedy chat
    answers are token for token the plain ones (real GGUFs; skipped without them)."""
    from conftest import real_model
    target = real_model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    draft = real_model("qwen2.5-coder-0.5b-instruct.gguf")
    messages = [{"role": "user", "content": "Rename `count` to `n` in: def f(count):\n    return count * count\n"}]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = corelm.LLM(target, threads=2, max_seq_len=1024, **PLAIN).chat(messages, params)[0].outputs[0]
    for spec in (dict(speculative_model=draft, speculative_weights="q4"), dict(speculative_model="[ngram]")):
        llm = corelm.LLM(target, threads=2, max_seq_len=1024, **FIXED, **spec)
        got = llm.chat(messages, params)[0].outputs[0]
        assert (got.token_ids, got.text) == (plain.token_ids, plain.text), spec
        assert llm.engine.spec_counts()["accepted_tokens"] > 0
