"""Speculative decoding (--speculative ngram) end to end: the same tokens as without it in every
mode, greedy and seeded, on the tiny random model and the embedded one; constraints, stop strings
and logprobs with it on; proposals accepted where the answer copies the prompt; cancellation leaves
the books balanced and no page held; what ModelInfo, ServerStatus and the request log say."""

from __future__ import annotations

import asyncio

import pytest

from braid.client import AsyncClient, regex
from braid.server.model.loader import default_cache_dir
from braid.v1 import generate_pb2 as pb
from braid_testing.process import run_braid
from braid_testing.models import WITH_TEMPLATE, save_model, tiny_model
from conftest import MODES, Server, free_port, tiny_server, wait_for
from in_process import Model, Outcome, generate, load_model

PASSAGE = (
    "The river rises in the hills above the town and runs for forty miles to the sea. In spring the "
    "snow melts and the water comes down fast and brown, carrying branches and stones; in summer it "
    "is slow and clear, and children swim in the pools below the old mill."
)
COPY = [("user", "Repeat this passage exactly, word for word:\n\n" + PASSAGE)]
FIX = [
    (
        "user",
        "Fix the spelling in this passage and write it out again in full:\n\n"
        + PASSAGE.replace("rises", "riseses").replace("water", "watter"),
    )
]
RAW = [PASSAGE + "\n\n" + PASSAGE[:60], "1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7", "Hi", "A list: apples, pears, apples,"]
SPECULATIVE = ["--speculative", "ngram", "--speculative-tokens", "6"]
SMOL = ["--kv-cache-memory", "256MiB", "--threads", "1"]
# SPECULATIVE with --ngram-min 1, as EngineConfig fields (the in-process tests)
_NGRAM = dict(speculative="ngram", speculative_tokens=6, ngram_min=1)


@pytest.fixture(scope="module")
def speculating(smol_dir, tmp_path_factory):
    """The embedded model with speculation, continuous mode, on a fixed thread count (no thread
    governor switching mid-run); it serves /metrics and logs to a file. What it gives without
    speculation, its requests with disable_speculation give (no proposal made for them, asserted
    where they are compared): a second server, of the same flags but --speculative, was started for
    that, and loaded the model again."""
    metrics_port, log = free_port(), tmp_path_factory.mktemp("speculating") / "server.log"
    server = Server(["--mode", "continuous", *SMOL, *SPECULATIVE, "--metrics-port", str(metrics_port)], log_path=log)
    server.metrics_url, server.log_path = f"http://127.0.0.1:{metrics_port}/metrics", log
    yield server
    server.stop()


def _without_speculation(target: str, requests: list[dict]) -> list:
    """_run's answers to requests with disable_speculation, each asserted to have had no proposal."""
    answers = asyncio.run(_run(target, [dict(r, disable_speculation=True) for r in requests]))
    assert all(final.usage.proposed_tokens == 0 for _, _, final, _ in answers)
    return answers


async def _run(target: str, requests: list[dict]) -> list[tuple[list[int], str, pb.GenerateResponse, list]]:
    """Every request at once: per request its tokens, text, final message and logprobs."""
    async with AsyncClient(target) as client:

        async def one(kw):
            ids, text, logprobs, final = [], "", [], None
            async for m in client.stream(**kw):
                ids += m.token_ids
                text += m.text
                logprobs += list(m.logprobs)
                if m.finish_reason:
                    final = m
            return ids, text, final, logprobs

        return await asyncio.gather(*(one(kw) for kw in requests))


def _greedy_requests() -> list[dict]:
    return [dict(prompt=p, max_new_tokens=40, ignore_eos=True) for p in RAW] + [
        dict(messages=m, max_new_tokens=80) for m in (COPY, FIX)
    ]


@pytest.fixture(scope="module")
def expected_greedy(speculating) -> list:
    """_greedy_requests() with top_logprobs=2 on the server without speculation (disable_speculation),
    run once and kept for the module (the tests of every mode, ngram and draft, compare with it)."""
    return _without_speculation(speculating.target, [dict(r, top_logprobs=2) for r in _greedy_requests()])


@pytest.fixture(scope="module")
def tiny_loaded(tiny_dir, in_process) -> Model:
    """The tiny model's runner, in this process (tests/in_process.py): every mode's engine runs on it."""
    return in_process(tiny_dir)


@pytest.fixture(scope="module")
def plain_in_process(tiny_loaded):
    """plain_in_process(mode): _greedy_requests() with top_logprobs=2 through the tiny model without
    speculation, once for the module (the ngram and the draft tests of every mode compare with it).
    On braid's kernels a position's numbers are the same bits whatever pass computes it
    (_same_but_for_a_near_tie), so every mode's plain tokens are continuous mode's: one run serves
    them all, and a mode that gave other tokens fails as its speculation would. On torch's ops,
    whose passes of other shapes round differently, one run per mode."""
    done: dict[str, list[Outcome]] = {}

    def get(mode: str) -> list[Outcome]:
        mode = mode if tiny_loaded.runner.kernels == "torch" else "continuous"
        if mode not in done:
            done[mode] = generate(tiny_loaded, _tops_requested(), **_TINY, mode=mode)
        return done[mode]

    return get


# As the tiny servers of this module run: --threads 1 --max-batch-size 16 --max-wait-ms 5.
_TINY = dict(max_batch_size=16, max_wait_ms=5)


def _tops_requested() -> list[dict]:
    """_greedy_requests() with top_logprobs=2, as the edge passes it on (logprobs with it)."""
    return [dict(r, logprobs=True, top_logprobs=2) for r in _greedy_requests()]


def _tops(logprobs) -> list[list[tuple[int, float]]]:
    """Each token's most likely tokens as (id, logprob), from the engine's logprobs or the API's."""
    return [[t if isinstance(t, tuple) else (t.token_id, t.logprob) for t in lp.top] for lp in logprobs]


@pytest.mark.parametrize("mode", MODES)
def test_tiny_greedy_tokens_are_the_same_with_speculation_in_every_mode(tiny_loaded, plain_in_process, mode):
    """In process: the engine in each mode with --speculative ngram (--speculative-tokens 6,
    proposing after one token matches, so that there is much to reject) against the same without."""
    expected = plain_in_process(mode)
    got = generate(tiny_loaded, _tops_requested(), **_TINY, mode=mode, **_NGRAM)
    for g, e in zip(got, expected):
        _same_but_for_a_near_tie(g.token_ids, e.token_ids, _tops(e.logprobs), tiny_loaded.runner.kernels)
    # a random model seldom repeats itself: nearly every proposal is rejected, and changes nothing
    assert sum(g.final.proposed_tokens for g in got) > 0  # (9 to 30 in a run: sessions that miss rest)
    assert all(e.final.proposed_tokens == 0 for e in expected)


def test_embedded_model_greedy_tokens_are_the_same_with_speculation(speculating, expected_greedy):
    """The embedded model with --speculative ngram, continuous mode: the tokens its requests get
    without speculation, and the answer that repeats the passage keeps proposals. (The other modes: below.)"""
    fast = speculating
    got = asyncio.run(_run(fast.target, [dict(r, top_logprobs=2) for r in _greedy_requests()]))
    for (ids, *_), (e_ids, _, _, e_logprobs) in zip(got, expected_greedy):
        _same_but_for_a_near_tie(ids, e_ids, _tops(e_logprobs), _kernels(fast))
    copy = got[len(RAW)][2].usage  # the answer that repeats the passage
    assert copy.accepted_tokens > copy.generated_tokens / 5, copy  # (18 of 56 in one run: 1.5 tokens per pass)


@pytest.fixture(scope="module")
def smol_loaded() -> Model:
    """The embedded model's runner, in this process (tests/in_process.py), as `braid serve` builds it."""
    return load_model(None, default_cache_dir(), kv_cache_memory="256MiB")


@pytest.mark.parametrize("mode", ["sequential", "interleaved", "batched"])
def test_embedded_model_greedy_tokens_are_the_same_with_speculation_in_every_mode(smol_loaded, expected_greedy, mode):
    """In process, the engine in each other mode over the embedded model's runner, with --speculative
    ngram (--speculative-tokens 6): the server's tokens without speculation, and proposals kept on
    the passage."""
    expected = expected_greedy
    got = generate(smol_loaded, _tops_requested(), mode=mode, speculative="ngram", speculative_tokens=6)
    for g, (e_ids, _, _, e_logprobs) in zip(got, expected):
        _same_but_for_a_near_tie(g.token_ids, e_ids, _tops(e_logprobs), smol_loaded.runner.kernels)
    copy = got[len(RAW)].final  # the answer that repeats the passage
    assert copy.accepted_tokens > copy.generated_tokens / 5, copy


def _same_but_for_a_near_tie(ids: list[int], expected: list[int], tops: list, kernels: str) -> None:
    """The same greedy tokens. On braid's kernels (ModelInfo.kernels, not "torch"), exactly: every row
    of every pass attends by itself through its page table in the one C call, so a position's numbers
    are the same bits whether a prompt chunk, a proposal or a decode step computes it
    (tests/inprocess/test_decode_step.py). On torch's ops, passes of other shapes round differently: where
    the tokens first differ, the two best of the plain run's step (tops: each step's most likely
    tokens as (id, logprob), _tops) must be within 0.1 nats of each other, as the modes' tests allow."""
    if kernels != "torch":
        assert ids == expected
        return
    if ids == expected:
        return
    k = next((i for i, (a, b) in enumerate(zip(ids, expected)) if a != b), min(len(ids), len(expected)))
    assert k < min(len(ids), len(expected)), f"one is a prefix of the other: {len(ids)} and {len(expected)} tokens"
    (best, best_lp), (second, second_lp) = tops[k][:2]
    assert {ids[k], expected[k]} == {best, second}, (k, ids[k], expected[k], tops[k])
    assert best_lp - second_lp < 0.1, (k, tops[k])


def _kernels(server) -> str:
    with server.client() as client:
        return client.model_info().kernels


def test_a_seed_gives_the_same_tokens_with_speculation(smol_loaded, tiny_loaded):
    """In process: sampled requests with a seed give the same tokens with --speculative ngram as
    without, on the embedded model (the passage's copy, where proposals are kept) and, with n=2, on
    the tiny one (proposing after one token matches)."""
    sampled = [
        dict(messages=COPY, max_new_tokens=60, temperature=t, seed=s, top_p=p, repetition_penalty=r)
        for t, s, p, r in ((0.7, 1, 1.0, 1.0), (1.0, 2, 0.9, 1.0), (0.5, 3, 1.0, 1.2), (1.3, 4, 0.95, 1.0))
    ]
    expected = generate(smol_loaded, sampled, mode="continuous")
    got = generate(smol_loaded, sampled, mode="continuous", speculative="ngram", speculative_tokens=6)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert sum(g.final.accepted_tokens for g in got) > 0
    raw = [dict(prompt=RAW[1], max_new_tokens=30, temperature=1.0, seed=s, n=2) for s in range(3)]
    plain = generate(tiny_loaded, raw, **_TINY, mode="continuous")
    fast = generate(tiny_loaded, raw, **_TINY, mode="continuous", **_NGRAM)
    assert _samples_by_request(fast) == _samples_by_request(plain)


def _samples_by_request(outcomes: list[Outcome], n: int = 2) -> list[list[list[int]]]:
    """Each request's n samples' tokens, in either order."""
    return [sorted(o.token_ids for o in outcomes[i : i + n]) for i in range(0, len(outcomes), n)]


def test_constraints_stop_strings_and_logprobs_with_speculation(speculating):
    fast = speculating
    requests = [
        dict(messages=COPY, max_new_tokens=80, stop=["forty miles"]),
        dict(messages=COPY, max_new_tokens=80, stop=["forty miles"], include_stop_sequence=True),
        dict(messages=COPY, max_new_tokens=30, logprobs=True, top_logprobs=3),
        dict(messages=COPY, max_new_tokens=60, constraint=regex(r"The river rises[a-z ,.]*")),
        dict(
            messages=COPY,
            max_new_tokens=60,
            temperature=0.8,
            seed=5,
            constraint=regex(r"The [a-z]+ rises in the hills[a-z ,.]*"),
        ),
        dict(messages=COPY, max_new_tokens=40, stop_token_ids=[4553], min_new_tokens=5),
        dict(messages=COPY, max_new_tokens=40, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={1: -2.0}),
        dict(messages=COPY, max_new_tokens=40, disable_speculation=True),
    ]
    expected = _without_speculation(fast.target, requests)
    got = asyncio.run(_run(fast.target, requests))
    for request, (ids, text, final, logprobs), (e_ids, e_text, e_final, e_logprobs) in zip(requests, got, expected):
        assert (ids, text) == (e_ids, e_text), request
        assert (final.finish_reason, final.stop_sequence) == (e_final.finish_reason, e_final.stop_sequence), request
        assert len(logprobs) == len(e_logprobs)
        for a, b in zip(logprobs, e_logprobs):
            assert a.rank == b.rank and a.logprob == pytest.approx(b.logprob, abs=1e-3)
            assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
    assert got[0][2].finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert got[3][2].finish_reason == pb.FINISH_REASON_CONSTRAINT
    assert got[-1][2].usage.proposed_tokens == 0  # opted out
    # Speculation took part in ending on a stop string and on a constraint: requests 0 and 3 again,
    # each alone, where every pass's proposal budget is its own. (Beside the 7 others, which sessions
    # got the budget moved with the timing: request 0 once had no proposal accepted in a full run.)
    for i, finish in ((0, pb.FINISH_REASON_STOP_SEQUENCE), (3, pb.FINISH_REASON_CONSTRAINT)):
        [(ids, text, final, _)] = asyncio.run(_run(fast.target, [requests[i]]))
        assert (ids, text, final.finish_reason) == (got[i][0], got[i][1], finish)
        assert final.usage.accepted_tokens > 0, requests[i]


def test_cancelled_mid_generation_leaves_the_books_balanced_and_no_page_held(speculating):
    fast = speculating

    async def cancel_some() -> None:
        async with AsyncClient(fast.target) as client:

            async def cut(kw, after: int):
                seen = 0
                async for m in client.stream(**kw):
                    seen += len(m.token_ids)
                    if seen >= after:
                        return

            # ignore_eos: each is cut mid-generation, however soon its greedy answer would end (with
            # the q8_0 cache the default, two answers ended before their cuts at 9 and 20 tokens)
            await asyncio.gather(
                *(cut(dict(messages=COPY, max_new_tokens=200, ignore_eos=True), after) for after in (1, 5, 9, 20))
            )

    asyncio.run(cancel_some())
    with fast.client() as client:
        status = wait_for(lambda: (s := client.server_status()).sessions_active == 0 and s.kv_pages_used == 0 and s)
    finished = sum(getattr(status.sessions_finished, f.name) for f in pb.FinishCounts.DESCRIPTOR.fields)
    assert status.sessions_submitted == status.sessions_queued + status.sessions_active + finished
    assert status.sessions_finished.cancelled >= 4
    assert status.speculative_accepted_tokens > 0
    assert status.speculative_acceptance_rate == pytest.approx(
        status.speculative_accepted_tokens / status.speculative_proposed_tokens
    )


def test_model_info_says_what_is_configured(speculating, servers, tiny_dir):
    with speculating.client() as client:
        info = client.model_info()
    assert (info.speculative, info.speculative_tokens, info.draft_model) == ("ngram", 6, "")
    with servers("continuous").client() as client:  # the session's tiny server: no --speculative
        info = client.model_info()
    assert (info.speculative, info.speculative_tokens) == ("none", 0)
    drafted = tiny_server(tiny_dir, "--speculative", "draft", "--draft-model", str(tiny_dir))
    try:
        with drafted.client() as client:
            info = client.model_info()
            done = client.generate(RAW[1], max_new_tokens=8, ignore_eos=True)
    finally:
        drafted.stop()
    assert (info.speculative, info.speculative_tokens, info.draft_model) == ("draft", 5, str(tiny_dir))
    assert done.usage.accepted_tokens > 0  # the model drafting for itself


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--speculative-tokens", "17"], "--speculative-tokens 17: must be in [1, 16]"),
        (["--speculative", "draft"], "--speculative draft: needs --draft-model"),
        (["--draft-model", "x.gguf"], "--draft-model x.gguf: needs --speculative draft"),
    ],
)
def test_bad_speculation_flags_fail_at_start_in_one_line(flags, line):  # before any model loads
    result = run_braid("serve", *flags, timeout=60)
    assert result.returncode == 2
    assert line in result.stderr.strip().splitlines()[-1]


# ---- a draft model (--speculative draft) ------------------------------------------------------


@pytest.fixture(scope="module")
def other_tiny_dir(tmp_path_factory, smol_dir):
    """A second tiny random Llama of the same vocabulary: a draft that is almost always wrong."""
    import torch

    path = save_model(
        tmp_path_factory.mktemp("other-tiny"), tiny_model(tie_word_embeddings=True), smol_dir, WITH_TEMPLATE
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(1)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def drafts(tiny_dir, other_tiny_dir) -> dict[str, Model]:
    """Draft runners of their own (each with its own KV cache), as --draft-model builds them: the tiny
    model itself, and another tiny random model of the same vocabulary."""
    return {"same": load_model(tiny_dir, tiny_dir.parent), "other": load_model(other_tiny_dir, other_tiny_dir.parent)}


@pytest.mark.parametrize("mode", MODES)
def test_tiny_greedy_tokens_are_the_same_with_a_draft_in_every_mode(tiny_loaded, drafts, plain_in_process, mode):
    """In process, the engine in each mode with --speculative draft (--speculative-tokens 4): the
    model drafting for itself has (nearly) every proposal accepted, a random draft (nearly) none; the
    tokens are the same as without, and no page is held after (in_process.generate checks)."""
    expected = plain_in_process(mode)
    for name, accepted in (("same", 0.9), ("other", 0.0)):
        draft = drafts[name]
        got = generate(
            tiny_loaded,
            _tops_requested(),
            draft,
            **_TINY,
            mode=mode,
            speculative="draft",
            draft_model=draft.path,
            speculative_tokens=4,
        )
        for g, e in zip(got, expected):
            _same_but_for_a_near_tie(g.token_ids, e.token_ids, _tops(e.logprobs), tiny_loaded.runner.kernels)
        proposed = sum(g.final.proposed_tokens for g in got)
        assert proposed > 0 and sum(g.final.accepted_tokens for g in got) >= accepted * proposed, name


def test_embedded_model_with_a_random_draft_gives_the_same_tokens(smol_loaded, drafts, expected_greedy):
    """In process, continuous mode: the embedded model with the tiny random one drafting for it (as
    --speculative draft --draft-model does) gives the server's tokens without speculation."""
    expected = expected_greedy
    draft = drafts["same"]
    got = generate(
        smol_loaded, _tops_requested(), draft, mode="continuous", speculative="draft", draft_model=draft.path
    )
    for g, (e_ids, _, _, e_logprobs) in zip(got, expected):
        _same_but_for_a_near_tie(g.token_ids, e_ids, _tops(e_logprobs), smol_loaded.runner.kernels)
    assert sum(g.final.proposed_tokens for g in got) > 0


def test_a_draft_of_another_vocabulary_fails_at_start_naming_both_sizes(tmp_path, tiny_dir):
    save_model(tmp_path, tiny_model(vocab_size=1000), tiny_dir, ("tokenizer.json",))
    serve = ("serve", "--model", str(tiny_dir), "--port", "0", "--speculative", "draft", "--draft-model")
    missing = run_braid(*serve, str(tmp_path / "none"), timeout=300)
    assert (
        missing.stderr.strip().splitlines()[-1]
        == f"braid: error: --draft-model {tmp_path / 'none'}: no such file or directory"
    )
    result = run_braid(*serve, str(tmp_path), timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"braid: error: --draft-model {tmp_path}: its vocabulary has 1000 tokens, the model's 49152"
    )


def test_metrics_and_the_request_log_report_proposed_and_accepted_tokens(speculating):
    """/metrics counts what ServerStatus counts (the module's earlier calls included), and a call's
    request log line its own proposed and accepted tokens."""
    from test_request_log import request_lines
    from test_telemetry import scrape, value

    fast = speculating
    [(_, _, final, _)] = asyncio.run(_run(fast.target, [dict(messages=COPY, max_new_tokens=60, request_id="copy")]))
    usage = final.usage
    assert usage.accepted_tokens > 0
    with fast.client() as client:
        status = wait_for(lambda: (s := client.server_status()).sessions_active == 0 and s)
    samples = scrape(fast)
    for outcome, total in (
        ("proposed", status.speculative_proposed_tokens),
        ("accepted", status.speculative_accepted_tokens),
    ):
        assert value(samples, "braid_speculative_tokens_total", braid_speculative_outcome=outcome) == total
    rate = [v for (name, _), v in samples.items() if name.startswith("braid_speculative_acceptance_rate")]
    assert rate == [pytest.approx(status.speculative_accepted_tokens / status.speculative_proposed_tokens)]
    line = wait_for(lambda: request_lines(fast.log_path).get("copy"))
    assert (line["proposed_tokens"], line["accepted_tokens"]) == (
        str(usage.proposed_tokens),
        str(usage.accepted_tokens),
    )
