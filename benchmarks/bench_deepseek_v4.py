"""DeepSeek-V4-shaped model on CPU: kiln vs transformers, same weights, same inputs, one process.

A random DeepSeek-V4 (4 layers: sliding only, CSA (every 4 tokens, indexer keeping 32), HCA (every 16), CSA;
a hash-routed layer then top-k over 32 experts (top 4), 4 hyper-connected streams, hidden 512, 8 heads of 64,
window 128) is built by transformers, saved once and loaded by both. Measured with rounds interleaved
(transformers, kiln, ...) after a warm-up:
- one training step (forward, LM loss, backward, AdamW step) on a (2, 256) batch;
- greedy decoding after a 384-token prompt (longer than the window, so the sliding and compressed caches
  both work), the decode steps alone: a 1-token generate timed in the same round is subtracted.
Outputs are checked first (bit-identical logits, the same greedy tokens). Throughput ratios kiln/transformers
are printed last (> 1: kiln is faster); with BENCH_JSON set, both rows go to the results table.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import loaded_pair, report, setup_torch

SIZE = dict(vocab_size=8192, hidden_size=512, moe_intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=1, head_dim=64, partial_rotary_factor=0.25, q_lora_rank=192,
            o_groups=4, o_lora_rank=128, n_routed_experts=32, num_experts_per_tok=4,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            index_n_heads=8, index_head_dim=32, index_topk=32, sliding_window=128, hc_mult=4, hc_sinkhorn_iters=20,
            max_position_embeddings=4096)
BATCH, LENGTH = 2, 256
PROMPT, NEW = 384, 16
WARMUP, ROUNDS = 1, int(os.environ.get("BENCH_ROUNDS", 4))


def _interleave(peer, kiln) -> dict[str, list[float]]:
    """Warm both, then alternate rounds; seconds per round for each side."""
    for _ in range(WARMUP):
        peer()
        kiln()
    out: dict[str, list[float]] = {"peer": [], "kiln": []}
    for _ in range(ROUNDS):
        for side, fn in (("peer", peer), ("kiln", kiln)):
            t0 = time.perf_counter()
            own = fn()
            out[side].append(own if own is not None else time.perf_counter() - t0)
    return out


def _train_step(model, batch, opt, **kw):
    def run():
        model(**batch, **kw).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def _decode_only(generate, prompt, kw):
    def run():
        t0 = time.perf_counter()
        generate(prompt, max_new_tokens=1, **kw)
        t1 = time.perf_counter()
        generate(prompt, max_new_tokens=NEW, **kw)
        return (time.perf_counter() - t1) - (t1 - t0)
    return run


def main() -> None:
    import transformers


    setup_torch()
    transformers.logging.set_verbosity_error()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, SIZE["vocab_size"], (BATCH, LENGTH), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    torch.manual_seed(0)
    built = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**SIZE))
    with torch.no_grad():
        for name, buf in built.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.05)  # a trained-looking balancing bias
            elif name.endswith("tid2eid"):  # a hash table spreading tokens over the experts
                buf.copy_(torch.stack([torch.randperm(SIZE["n_routed_experts"], generator=g)[:buf.shape[1]]
                                       for _ in range(buf.shape[0])]))
    peer, ours, n_params = loaded_pair(built)
    del built

    with torch.no_grad():
        same = torch.equal(peer.eval()(**batch).logits, ours.eval()(**batch).logits)
    prompt = torch.randint(3, SIZE["vocab_size"], (1, PROMPT), generator=g)
    kw = dict(eos_token_id=None, pad_token_id=0)
    peer.generation_config.eos_token_id = None
    ours.config.eos_token_id = None
    tokens_equal = torch.equal(peer.generate(prompt, do_sample=False, max_new_tokens=NEW, **kw),
                               ours.generate(prompt, max_new_tokens=NEW, **kw))
    print(f"DeepSeek-V4-shaped: {n_params / 1e6:.1f}M params; batch {BATCH} x {LENGTH}; decode {PROMPT} + {NEW} "
          f"tokens; {ROUNDS} rounds after {WARMUP} warm-up; torch threads {torch.get_num_threads()}")
    print(f"check: logits bit-identical {same}; greedy tokens equal {tokens_equal}")
    if not (same and tokens_equal):
        sys.exit("kiln and transformers disagree: the timings below would compare different work")

    peer.train(), ours.train()
    train = _interleave(_train_step(peer, batch, torch.optim.AdamW(peer.parameters(), lr=1e-5), use_cache=False),
                        _train_step(ours, batch, torch.optim.AdamW(ours.parameters(), lr=1e-5)))
    peer.eval(), ours.eval()
    decode = _interleave(_decode_only(lambda p, **a: peer.generate(p, do_sample=False, **a), prompt, kw),
                         _decode_only(ours.generate, prompt, kw))
    tokens = BATCH * LENGTH
    report("DeepSeek-V4 train step (4 layers: sliding, CSA, HCA; hash + top-k MoE)", "transformers", "tokens/s",
           [tokens / s for s in train["kiln"]], [tokens / s for s in train["peer"]], goal=">= 1.0x",
           note="kiln exact path (bit-identical)")
    report(f"DeepSeek-V4 greedy decode ({PROMPT}-token prompt, window {SIZE['sliding_window']})", "transformers",
           "tokens/s", [(NEW - 1) / s for s in decode["kiln"]], [(NEW - 1) / s for s in decode["peer"]],
           goal=">= 1.0x", note="sliding + compressed caches, exact path")


if __name__ == "__main__":
    main()
