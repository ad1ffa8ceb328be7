import os, random, time, torch
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams
import logging; logging.basicConfig(level=logging.INFO)
on = os.environ.get("BLOCKS","1")=="1"
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype="float32", num_threads=2, show_progress=False, gguf_blocks=on, enable_prefix_caching=False))
print("blocks", eng.model.gguf_blocks is not None)
rng = random.Random(1)
outs=[]
for rnd in range(3):
    ids = [rng.randrange(100, 40000) for _ in range(128)]
    eng.add_request(f"r{rnd}", ids, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    toks=[]
    d=eng.step(); t0=time.perf_counter(); n=0
    while eng.has_unfinished():
        for x in eng.step(): toks+=x.new_token_ids if hasattr(x,'new_token_ids') else x.token_ids
        n+=1
    print(f"blocks={on}: {(time.perf_counter()-t0)/n*1e3:.2f} ms/step", flush=True)
    outs.append(toks)
import json; json.dump(outs, open(f"/tmp/s22/toks_{int(on)}.json","w"))
