"""DeepSeek-V3-shaped model on CPU: kiln vs transformers, same weights, same inputs, one process.

A random DeepSeek-V3 (64 routed experts, top 6 of 8 groups keeping 4, 2 shared experts, hidden
512, MLA with a query latent, 3 layers of which the first is dense, yarn rope) is built by
transformers, saved once and loaded by both. Measured, with rounds interleaved (peer, kiln,
kiln, peer, ...: who goes first alternates) after warm-up, min and median over rounds, wall clock and
process CPU time (the steadier of the two on a shared machine):
- one MoE block (layer 1), forward + backward to its weights and its (B, T, C) input, 3x the rounds
  of the rest (a block step is short), kiln on its fast path as
  `kiln train` runs it (`set_fast`: one autograd node for the routed experts, moe_fast.py);
- one full training step (forward, LM loss, backward, AdamW step), kiln fast as `kiln train` runs it
  (fused head + loss, fast MoE); both sides with torch's fused AdamW, what each trainer picks on CPU
  (kiln's `train.optim.adamw`, transformers' default `adamw_torch_fused`);
- greedy decoding after a long prompt, the decode steps alone (a 1-token generate is timed in
  every round too; its least disturbed time, the shared prefill, is subtracted from each round's
  NEW-token generate, so one slowed 1-token run cannot fake a fast round), with each side's cache (both
  hold the compressed latent): kiln exact (bit-identical; re-expands the cached latent every
  step, as transformers does) and kiln with the absorbed fast path (`set_fast`: attends over the
  latent; float rounding apart).
Outputs are checked first (bit-identical logits, same greedy tokens on every path, the fast MoE
block within fp32 rounding). The kiln/transformers speed ratios are printed last (> 1 means kiln is
faster).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import loaded_pair, report, setup_torch

SIZE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
            num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
            q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4, n_shared_experts=2,
            max_position_embeddings=2048, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                               mscale=1.0, mscale_all_dim=1.0,
                                                               original_max_position_embeddings=512))
BATCH, LENGTH = 2, 256
PROMPT, NEW = 768, 16
WARMUP, ROUNDS = 1, int(os.environ.get("BENCH_ROUNDS", 5))


def _time(fn) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    own = fn()  # a step may time itself (decode: the NEW-token generate alone)
    return own if own is not None else (time.perf_counter() - t0, time.process_time() - c0)


def _interleave(peer, kiln, rounds: int = ROUNDS) -> dict[str, dict[str, list[float]]]:
    """Warm both, then alternate rounds; returns {side: {"wall": [...], "cpu": [...]}}."""
    for _ in range(WARMUP):
        peer()
        kiln()
    out = {"peer": {"wall": [], "cpu": []}, "kiln": {"wall": [], "cpu": []}}
    for r in range(rounds):
        for side, fn in (("peer", peer), ("kiln", kiln))[:: 1 if r % 2 == 0 else -1]:
            wall, cpu = _time(fn)
            out[side]["wall"].append(wall)
            out[side]["cpu"].append(cpu)
    return out


def _decode_only(generate, prompt, kw):
    """Run generate(1 token) then generate(NEW tokens); this round's time is the latter. The 1-token
    times are kept on the function (`prefill`) for `_minus_prefill`."""
    def run():
        t0, c0 = time.perf_counter(), time.process_time()
        generate(prompt, max_new_tokens=1, **kw)
        t1, c1 = time.perf_counter(), time.process_time()
        generate(prompt, max_new_tokens=NEW, **kw)
        t2, c2 = time.perf_counter(), time.process_time()
        run.prefill.append((t1 - t0, c1 - c0))
        return t2 - t1, c2 - c1
    run.prefill = []
    return run


def _minus_prefill(r: dict, peer, kiln) -> dict:
    """Each round's NEW-token time minus that side's fastest 1-token time (the prefill and first token)."""
    for side, fn in (("peer", peer), ("kiln", kiln)):
        wall, cpu = min(w for w, _ in fn.prefill), min(c for _, c in fn.prefill)
        r[side] = {"wall": [w - wall for w in r[side]["wall"]], "cpu": [c - cpu for c in r[side]["cpu"]]}
        fn.prefill.clear()
    return r


def _moe_step(block, x: torch.Tensor):
    def run():  # the input takes a gradient too, as a layer's input does in training
        block.zero_grad(set_to_none=True)
        y = block(x.detach().requires_grad_())
        y.float().pow(2).mean().backward()
    return run


def _train_step(model, batch, opt, **kw):
    def run():
        loss = model(**batch, **kw).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def main() -> None:
    import transformers

    from kiln.models.common.fast import set_fast

    transformers.logging.set_verbosity_error()
    setup_torch()  # BENCH_THREADS (default 1), as every benchmark here
    load0 = os.getloadavg()[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, SIZE["vocab_size"], (BATCH, LENGTH), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**SIZE)
    built = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, buf in built.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.05)  # a trained-looking balancing bias
    peer, ours, n_params = loaded_pair(built)
    del built

    with torch.no_grad():
        same = torch.equal(peer.eval()(**batch).logits, ours.eval()(**batch).logits)
    prompt = torch.randint(3, SIZE["vocab_size"], (1, PROMPT), generator=g)  # (1, PROMPT)
    kw = dict(eos_token_id=None, pad_token_id=0)
    peer.generation_config.eos_token_id = None
    ours.config.eos_token_id = None
    reference = peer.generate(prompt, do_sample=False, max_new_tokens=NEW, **kw)
    tokens_equal = torch.equal(reference, ours.generate(prompt, max_new_tokens=NEW, **kw))
    fast_equal = torch.equal(reference, set_fast(ours).generate(prompt, max_new_tokens=NEW, **kw))
    set_fast(ours, False)

    x = torch.randn(BATCH, LENGTH, SIZE["hidden_size"], generator=g)
    block_p, block_k = peer.model.layers[1].mlp.train(), set_fast(ours.model.layers[1].mlp.train())
    with torch.no_grad():
        block_diff = float((block_p(x) - block_k(x)).abs().max() / block_p(x).abs().max())
    # a block step is short: three times the rounds, to see past the machine's other work
    results = {"MoE block fwd+bwd": _interleave(_moe_step(block_p, x), _moe_step(block_k, x), 3 * ROUNDS)}
    peer.train(), set_fast(ours.train())
    opt_p = torch.optim.AdamW(peer.parameters(), lr=1e-5, fused=True)
    opt_k = torch.optim.AdamW(ours.parameters(), lr=1e-5, fused=True)
    results["train step"] = _interleave(_train_step(peer, batch, opt_p, use_cache=False),
                                        _train_step(ours, batch, opt_k))
    set_fast(ours, False)
    peer.eval(), ours.eval()
    hf_generate = _decode_only(lambda p, **a: peer.generate(p, do_sample=False, **a), prompt, kw)
    kiln_generate = _decode_only(ours.generate, prompt, kw)
    results["decode exact"] = _minus_prefill(_interleave(hf_generate, kiln_generate), hf_generate, kiln_generate)
    set_fast(ours)
    results["decode absorbed"] = _minus_prefill(_interleave(hf_generate, kiln_generate), hf_generate, kiln_generate)

    print(f"DeepSeek-V3-shaped: {n_params / 1e6:.1f}M params, {SIZE['num_hidden_layers']} layers "
          f"({SIZE['n_routed_experts']} experts top {SIZE['num_experts_per_tok']}, {SIZE['n_shared_experts']} shared), "
          f"hidden {SIZE['hidden_size']}; batch {BATCH} x {LENGTH}; decode {PROMPT} + {NEW} tokens; "
          f"{ROUNDS} rounds after {WARMUP} warm-up; torch threads {torch.get_num_threads()}")
    print(f"check: logits bit-identical {same}; greedy tokens equal: exact {tokens_equal}, absorbed {fast_equal}; "
          f"fast MoE block output max rel diff {block_diff:.1e}")
    print(f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} cores)")
    ratios = []
    for what, r in results.items():
        for side, label in (("peer", "transformers"), ("kiln", "kiln")):
            w, c = r[side]["wall"], r[side]["cpu"]
            line = f"{what:>24} {label:>12}: min {min(w) * 1e3:8.1f} ms  median {statistics.median(w) * 1e3:8.1f} ms  " \
                   f"(CPU min {min(c) * 1e3:8.1f} ms)"
            if what.startswith("decode"):
                line += f"  {(NEW - 1) / min(w):7.1f} tokens/s"
            print(line)
        ratios.append((what, min(r["peer"]["wall"]) / min(r["kiln"]["wall"]),
                       statistics.median(r["peer"]["wall"]) / statistics.median(r["kiln"]["wall"]),
                       min(r["peer"]["cpu"]) / min(r["kiln"]["cpu"])))
    for what, by_min, by_median, by_cpu in ratios:
        print(f"ratio kiln/transformers (speed) {what}: {by_min:.3f} (min), {by_median:.3f} (median), "
              f"{by_cpu:.3f} (CPU time)")
    if os.environ.get("BENCH_JSON"):  # rows for run_all.py's table (tokens/s per round)
        per_round = {"MoE block fwd+bwd": BATCH * LENGTH, "train step": BATCH * LENGTH,
                     "decode exact": NEW - 1, "decode absorbed": NEW - 1}
        for (what, r), (_, _, _, by_cpu) in zip(results.items(), ratios):
            kiln_path = "exact path, bit-identical" if what == "decode exact" else "fast path"
            report(f"DeepSeek-V3-shaped {what}", "transformers", "tokens/s",
                   [per_round[what] / t for t in r["kiln"]["wall"]], [per_round[what] / t for t in r["peer"]["wall"]],
                   goal=">= 1.0x" if what != "MoE block fwd+bwd" else ">= 1.0x, faster",
                   note=f"kiln {kiln_path}; by process CPU time {by_cpu:.2f}x")


if __name__ == "__main__":
    main()
