"""llguidance vs xgrammar on the bundled SmolLM2 tokenizer: tokenizer setup, JSON-schema compile,
and the next-token mask at each token of a real JSON output (CPU, one thread), side by side.

specmesh ships llguidance; xgrammar is not a dependency: install it for this comparison only
(`pip install --no-deps xgrammar apache-tvm-ffi`). Writes loadtest/results/grammar_engines.json.

Usage: python -m loadtest.bench_grammar_engines
"""
import json
import subprocess
import time

import numpy as np
import torch

torch.set_num_threads(1)
from specmesh.loader import bundled_target_path, load_tokenizer
tok = load_tokenizer(bundled_target_path())
V = 49152
schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "city": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
text = '{"name": "Ann", "age": 31, "city": "Oslo", "hobbies": ["chess", "hiking", "reading"]}'
ids = tok.encode(text, add_special_tokens=False)
out = {"cpu": subprocess.run("lscpu | grep 'Model name' | cut -d: -f2", shell=True, capture_output=True, text=True).stdout.strip(), "tokens": len(ids)}
import llguidance, llguidance.hf
t = time.perf_counter(); lt = llguidance.hf.from_tokenizer(tok, n_vocab=V); out["llguidance_tokenizer_s"] = time.perf_counter() - t
t = time.perf_counter(); m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(schema), log_level=0); out["llguidance_compile_s"] = time.perf_counter() - t
ts = []
for i in ids:
    t = time.perf_counter(); m.compute_bitmask(); ts.append(time.perf_counter() - t); assert m.consume_token(i)
out["llguidance_mask_us_median"] = float(np.median(ts) * 1e6); out["llguidance_mask_us_max"] = float(max(ts) * 1e6)
import xgrammar as xgr
t = time.perf_counter(); info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V); comp = xgr.GrammarCompiler(info, max_threads=1); out["xgrammar_tokenizer_s"] = time.perf_counter() - t
t = time.perf_counter(); cg = comp.compile_json_schema(json.dumps(schema)); out["xgrammar_compile_s"] = time.perf_counter() - t
mx = xgr.GrammarMatcher(cg); bm = xgr.allocate_token_bitmask(1, V); ts = []
for i in ids:
    t = time.perf_counter(); mx.fill_next_token_bitmask(bm); ts.append(time.perf_counter() - t); assert mx.accept_token(i)
out["xgrammar_mask_us_median"] = float(np.median(ts) * 1e6); out["xgrammar_mask_us_max"] = float(max(ts) * 1e6)
print(json.dumps(out))
with open("loadtest/results/grammar_engines.json", "w") as f:
    json.dump(out, f, indent=1)
