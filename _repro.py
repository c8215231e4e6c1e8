import sys, torch
sys.path.insert(0, "tests/engine")
torch.set_num_threads(1)
from compaction_gym.models.tiny import make_tiny_model
import tempfile
import test_continuous as T
from compaction_gym.engine import CreateRequest, SamplingParams
path = make_tiny_model(tempfile.mkdtemp())
for prefill in (True, False):
    eng, ref = T._engine(path), T._engine(path)
    for e in (eng, ref): T._reset(e)
    sp = lambda n: SamplingParams(temperature=0.0, top_k=0, seed=0, max_new_tokens=n)
    reqs = [(0, CreateRequest(T.make_prompt(1, seed=100), T.CONFIGS["kv"], sp(0), "c0")),
            (1, CreateRequest(T.make_prompt(1, seed=101), T.CONFIGS["kv"], sp(1), "c1")),
            (0, CreateRequest(T.make_prompt(9, seed=102), T.CONFIGS["kv_raw"], sp(51), "c2"))]
    arr = [[],[]]
    for r, q in reqs: arr[r].append(q)
    got = T._drive(eng, arr, [1], prefill)
    for _, q in reqs: T._one_by_one(ref, q)
    for sid in ref.session_ids:
        diffs = [(x - y).abs().max().item() for x, y in zip(eng.read_cache(sid), ref.read_cache(sid))]
        ev = len(eng.session(sid).events)
        print(prefill, sid, "events", ev, "max|dK| |dV| |dB|", ["%.1e" % d for d in diffs])
