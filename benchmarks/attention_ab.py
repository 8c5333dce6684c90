#!/usr/bin/env python
"""One layer's decode attention, fused kernel (reads the pool in place) vs the pure-torch
path (gather of each request's K/V + fixed-block attention), same inputs, interleaved runs.

    python benchmarks/attention_ab.py 64 130     # rows, context per row
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
from shepherd.config import EngineConfig
from shepherd.engine.torch_executor import TorchExecutor
from shepherd.step import NewRequest, ScheduledSeq
from shepherd.request import Request, SamplingParams
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
rows=int(sys.argv[1]); ctx=int(sys.argv[2])
ex=TorchExecutor(EngineConfig(dtype="bfloat16", max_total_tokens=rows*(ctx+8)+64, kernels="fused", num_threads=1))
m=ex.model
seqs=[]
for i in range(rows):
    r=Request(f"r{i}", [5]*ctx, SamplingParams(max_tokens=4))
    r.slots=list(range(i*(ctx+8), i*(ctx+8)+ctx+1)); r.prompt_ids=[5]*ctx; r.output_ids=[7]
    ex.add(NewRequest(r.req_id, r.prompt_ids, r.params))
    seqs.append(ScheduledSeq(r.req_id, [7], ctx, True, 0, list(r.slots)))
fi,_=ex.build_input_fused(seqs); ti,_=ex.build_input_torch(seqs)
ex.kv_pool.normal_()
T=fi.num_tokens
qkv=torch.randn(T,(m.H+2*m.KVH)*m.hd).bfloat16()
pool=ex.kv_pool[0]; rowsz=pool.shape[0]*pool.shape[1]
kvp=pool.view(rowsz,m.hd).view(m._word)
def fused(): return m.kernels.attention(qkv,pool,m.H,m.KVH,m.hd,fi.slot_tab,fi.row_off,fi.row_ctx,fi.max_ctx,m.scale)
def torchp(): return m.attention(qkv[:, :m.q_size].view(T,m.H,m.hd), kvp, ti.groups, T)
res={}
with torch.inference_mode():
  for rep in range(5):
    for n,f in (("fused",fused),("torch",torchp)):
        f(); t=time.perf_counter()
        for _ in range(5): f()
        res.setdefault(n,[]).append((time.perf_counter()-t)/5*1e3)
print(rows, ctx, {n: round(min(v),3) for n,v in res.items()}, "ms per layer")
a, b = fused().float()[:rows], torchp().float()[:rows]
print("max |fused - torch| over the real rows:", (a - b).abs().max().item())
