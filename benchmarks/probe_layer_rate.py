"""How fast one transformer layer runs at a published row's per-rank shapes, against the device's large-GEMM rate
(GPU only; the evidence behind bench_published.py's diagnosis, issue 21).

    python3 benchmarks/probe_layer_rate.py        # ~20 s on one H100; writes $OUT/layer_rate.json (or ./)

For each row of bench_published.py's Megatron tables: one Megatron-style layer (LayerNorm, QKV, attention,
output projection, dropout, residual, MLP with GELU) at that row's tensor-parallel shard (hidden h/t, heads a/t,
the run's micro-batch x 2048 tokens), forward + backward in bf16, no communication, timed with CUDA events;
its model FLOPs ``3 (24 b s h^2 / t + 4 b s^2 h / t)`` per second set against an 8192^3 bf16 matmul (the
device's MAMF). Attention two ways: unfused (scores materialized, softmax, dropout: Megatron 2021's data
flow without its fused softmax kernel) and torch's SDPA (flash). The fraction of MAMF is what a single
``device_tflops`` cannot express: it depends on the shard's width and on the attention's s x s traffic.
"""
import json, sys, torch, torch.nn.functional as F
dev = "cuda"; dt = torch.bfloat16; S = 2048
def timeit(fn, n=6, w=2):
    for _ in range(w): fn()
    torch.cuda.synchronize(); a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n): fn()
    b.record(); torch.cuda.synchronize(); return a.elapsed_time(b) / n / 1e3
def mamf():
    x = torch.randn(8192, 8192, device=dev, dtype=dt); y = torch.randn(8192, 8192, device=dev, dtype=dt)
    return 2 * 8192**3 / timeit(lambda: x @ y, n=20) / 1e12
def layer(h, a, t, b, sdpa):
    hr, ar, d = h // t, a // t, h // a
    P = lambda *s: (torch.randn(*s, device=dev, dtype=dt) * 0.02).requires_grad_()
    wqkv, wo, w1, w2 = P(h, 3 * hr), P(hr, h), P(h, 4 * hr), P(4 * hr, h)
    ln1, ln2 = torch.nn.LayerNorm(h, device=dev, dtype=dt), torch.nn.LayerNorm(h, device=dev, dtype=dt)
    x = torch.randn(S, b, h, device=dev, dtype=dt, requires_grad=True)
    mask = torch.ones(S, S, device=dev, dtype=torch.bool).triu(1)
    def fwd():
        y = ln1(x) @ wqkv
        q, k, v = y.view(S, b, ar, 3 * d).permute(1, 2, 0, 3).chunk(3, dim=-1)
        if sdpa:
            c = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
        else:
            sc = torch.matmul(q, k.transpose(-1, -2)) * d ** -0.5
            sc = F.dropout(torch.softmax(sc.masked_fill(mask, float("-inf")), -1), 0.1)
            c = torch.matmul(sc, v)
        c = c.permute(2, 0, 1, 3).reshape(S, b, hr)
        x2 = x + F.dropout(c @ wo, 0.1)
        return x2 + F.dropout(F.gelu(ln2(x2) @ w1) @ w2, 0.1)
    g = torch.randn(S, b, h, device=dev, dtype=dt)
    sec = timeit(lambda: fwd().backward(g))
    fl = 3 * (24 * b * S * h * h / t + 4 * b * S * S * h / t)
    return fl / sec / 1e12
rows = [("1.7B", 2304, 24, 1, 16), ("3.6B", 3072, 32, 2, 16), ("7.5B", 4096, 32, 4, 16), ("18.4B", 6144, 48, 8, 8),
        ("22B", 6144, 64, 8, 1), ("39.1B", 8192, 64, 8, 4), ("76.1B", 10240, 80, 8, 2), ("145.6B", 12288, 96, 8, 2),
        ("175B", 12288, 96, 8, 1), ("310.1B", 16384, 128, 8, 1), ("529.6B", 20480, 128, 8, 1), ("1T", 25600, 160, 8, 1)]
m = mamf(); print(torch.cuda.get_device_name(), "MAMF 8192^3 bf16:", round(m), "TFLOP/s", flush=True)
out = {"device": torch.cuda.get_device_name(), "mamf": m, "rows": []}
for name, h, a, t, b in rows:
    r = {"name": name, "h_rank": h // t, "heads_rank": a // t, "mbs": b}
    for sd in (False, True):
        try: r["sdpa" if sd else "unfused"] = layer(h, a, t, b, sd)
        except Exception as e: r["sdpa" if sd else "unfused"] = str(e)[:80]
        torch.cuda.empty_cache()
    print(name, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()},
          "fraction of MAMF unfused %.2f sdpa %.2f" % (r["unfused"] / m, r["sdpa"] / m), flush=True)
    out["rows"].append(r)
import os; json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "layer_rate.json"), "w"), indent=1)
