"""Small random checkpoints for tests and benchmarks: `kvmesh make-tiny-model --arch deepseek_v4 OUT`.

transformers builds and saves the model (config.json + model.safetensors, its own parameter
names), seeded so the same call writes the same weights; the tokenizer is the default model's
(SmolLM2, vocab 49152), so text prompts work through the mesh. Nothing is downloaded.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

ARCHITECTURES = ("deepseek_v4",)


def deepseek_v4_tiny_config(**overrides):
    """A DeepSeek-V4 config small enough for CPU tests that still exercises every part.

    4 layers: sliding, CSA, HCA, CSA attention (compress rates 4 and 16, sliding window 8, so
    a 20-token prompt already crosses windows of every kind); hash-MoE then top-k MoE with 8
    routed experts (top 2) and a shared expert; 2 hyper-connection streams; YaRN on the
    compress rope. `overrides` replace any field (e.g. index_topk=64 to cover every entry).
    """
    from transformers import DeepseekV4Config

    fields = dict(
        vocab_size=49152,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=32,
        partial_rotary_factor=0.25,
        num_experts_per_tok=2,
        n_routed_experts=8,
        n_shared_experts=1,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        hc_mult=2,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        swiglu_limit=10.0,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=8,
        index_head_dim=16,
        index_topk=4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return DeepseekV4Config(**fields)


HOT_EXPERTS = (0, 1)
"""The experts `skew_routers` makes hot in every MoE layer: neighbours, so experts-in-order
placement puts both on one rank, as an unlucky real placement does."""


def _skew_hash_table(table, p_hot: float, gen) -> None:
    """Give each row of a hash-MoE table [vocab, k] (distinct experts a row) a hot expert first
    with probability p_hot, keeping the row's experts distinct."""
    import torch

    picks = torch.rand(table.shape[0], generator=gen) < p_hot
    hot = torch.tensor(HOT_EXPERTS)[torch.randint(len(HOT_EXPERTS), (table.shape[0],), generator=gen)]
    for row in torch.nonzero(picks).flatten().tolist():
        e = int(hot[row])
        where = (table[row] == e).nonzero().flatten()
        if len(where):  # already in the row: move it first
            table[row, int(where[0])] = table[row, 0]
        table[row, 0] = e


_MTP_UPSTREAM = {  # kvmesh's (transformers-style) name of an MTP block tensor -> DeepSeek's
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.sinks": "attn.attn_sink",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
}


def random_mtp_tensors(config, seed: int = 0) -> dict:
    """A random multi-token-prediction module for `config`, named as DeepSeek-V4's released
    checkpoints name it (`mtp.0.enorm.weight`, `mtp.0.attn.wq_a.weight`,
    `mtp.0.ffn.experts.3.w1.weight`, `mtp.0.hc_attn_fn`, ...; shapes from
    kvmesh.engine.deepseek_v4.shapes.mtp_shapes). Matrices std 0.02, norms 1, and random values
    where init leaves zeros the tests would not see through (sinks, hyper-connection biases,
    router biases), as `make_tiny_model` does for the target."""
    import torch

    from kvmesh.engine.deepseek_v4.shapes import MTP_PREFIX, mtp_shapes

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in mtp_shapes(config).items():
        name = key[len(MTP_PREFIX) :]
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith(("sinks", "base")) or name == "mlp.gate.e_score_correction_bias":
            t = torch.randn(shape, generator=gen) * 0.5
        elif name.endswith(("scale",)):
            t = 1.0 + torch.randn(shape, generator=gen) * 0.1
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        if name == "mlp.experts.gate_up_proj":
            half = shape[1] // 2
            for e in range(shape[0]):
                out[f"{MTP_PREFIX}ffn.experts.{e}.w1.weight"] = t[e, :half].clone()
                out[f"{MTP_PREFIX}ffn.experts.{e}.w3.weight"] = t[e, half:].clone()
        elif name == "mlp.experts.down_proj":
            for e in range(shape[0]):
                out[f"{MTP_PREFIX}ffn.experts.{e}.w2.weight"] = t[e].clone()
        else:
            out[MTP_PREFIX + _MTP_UPSTREAM.get(name, name)] = t
    return out


def make_tiny_model(
    arch: str, out_dir: str | Path, seed: int = 0, skew_routers: float = 0.0, mtp: bool = True, **overrides
) -> Path:
    """Write a random `arch` checkpoint plus SmolLM2's tokenizer into `out_dir`; return it.

    Weights are drawn with std 0.02 like the models' own init, except what init leaves at
    zero and would make the test blind: attention sinks, compressor position biases, the
    hyper-connection biases, router correction biases and the hash-MoE table get random
    values too.

    skew_routers: tiny random routers spread tokens almost evenly over the experts, unlike
    trained ones; s > 0 makes `HOT_EXPERTS` hot in every MoE layer, as real traffic does: their
    top-k selection bias (`e_score_correction_bias`, which picks experts but does not weigh
    them) grows by s, and each hash-MoE table row takes a hot expert with probability
    min(1, 4 s). EPLB (kvmesh.engine.ep.eplb) has something to balance then. Raises ValueError for an
    unknown arch or s < 0.

    mtp: also write a random multi-token-prediction module (`random_mtp_tensors`, DeepSeek's
    names) into model.safetensors, as the released checkpoints carry one; transformers ignores
    those tensors, kvmesh's `--speculative mtp` drafts with them.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; known: {list(ARCHITECTURES)}")
    if skew_routers < 0:
        raise ValueError(f"skew_routers must be >= 0, got {skew_routers}")
    import torch
    from transformers import DeepseekV4ForCausalLM

    from kvmesh.engine.checkpoint import load_tokenizer
    from kvmesh.engine.loader import resolve_model

    out = Path(out_dir)
    config = deepseek_v4_tiny_config(**overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
            elif name.endswith(("hc.scale", "hc_scale")):
                t.copy_(1.0 + torch.randn(t.shape, generator=gen) * 0.1)
        model.lm_head.weight.mul_(5.0)  # wider logit gaps: greedy picks that rounding cannot flip
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
                b[list(HOT_EXPERTS)] += skew_routers
            elif name.endswith("tid2eid"):
                # distinct experts per token, as the real table has
                b.copy_(
                    torch.stack(
                        [
                            torch.randperm(config.n_routed_experts, generator=gen)[: b.shape[1]]
                            for _ in range(b.shape[0])
                        ]
                    )
                )
                if skew_routers:
                    _skew_hash_table(b, min(1.0, 4 * skew_routers), torch.Generator().manual_seed(seed + 2))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if mtp:
        from safetensors.torch import load_file, save_file

        path = out / "model.safetensors"
        tensors = load_file(path)
        tensors.update(random_mtp_tensors(config, seed + 3))
        save_file(tensors, path, metadata={"format": "pt"})
    load_tokenizer(resolve_model(None)).save_pretrained(out)
    logger.info("wrote a tiny %s checkpoint to %s", arch, out)
    return out
