"""Every tensor a DeepSeek-V4 config implies, by name (transformers' naming; `mtp.0.` for the
multi-token-prediction module) and shape: what kvmesh.engine.deepseek_v4.weights checks a
checkpoint against, and what kvmesh.bench.tiny_models fills with random values.
"""

from __future__ import annotations

from kvmesh.engine.deepseek_v4.state import CSA, HCA, SLIDING

MTP_PREFIX = "mtp.0."
"""Where the multi-token-prediction module's tensors live, in either naming."""


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor name (transformers' naming) a `DeepseekV4Config` implies, with its shape.

    Raises ValueError for a layer or MLP type this model does not know.
    """
    c = config
    H, V, N = c.hidden_size, c.vocab_size, c.hc_mult
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (V, H),
        "lm_head.weight": (V, H),
        "model.norm.weight": (H,),
        "model.hc_head.hc_fn": (N, N * H),
        "model.hc_head.hc_base": (N,),
        "model.hc_head.hc_scale": (1,),
    }
    for i, (attn, mlp) in enumerate(zip(c.layer_types, c.mlp_layer_types)):
        if attn not in (SLIDING, CSA, HCA):
            raise ValueError(f"layer_types[{i}] is {attn!r}; known: {[SLIDING, CSA, HCA]}")
        if mlp not in ("hash_moe", "moe"):
            raise ValueError(f"mlp_layer_types[{i}] is {mlp!r}; known: ['hash_moe', 'moe']")
        shapes.update(_block_shapes(c, f"model.layers.{i}.", attn, mlp))
    return shapes


def mtp_shapes(config) -> dict[str, tuple[int, ...]]:
    """The multi-token-prediction module's tensors (kvmesh's naming, `mtp.0.` + a layer's
    names) with their shapes, after DeepSeek-V4's inference/model.py `MTPBlock`: enorm, hnorm,
    norm [H]; e_proj, h_proj [H, H]; its own hyper-connection head hc_head_fn [N, N*H],
    hc_head_base [N], hc_head_scale [1]; and one block of the model's kind: sliding-window
    attention (compress ratio 0, as the released configs' compress_ratios give the MTP layer)
    and a top-k routed MoE (its layer id is past the hash-routed ones)."""
    c = config
    H, N = c.hidden_size, c.hc_mult
    p = MTP_PREFIX
    shapes = {
        p + "enorm.weight": (H,),
        p + "hnorm.weight": (H,),
        p + "norm.weight": (H,),
        p + "e_proj.weight": (H, H),
        p + "h_proj.weight": (H, H),
        p + "hc_head_fn": (N, N * H),
        p + "hc_head_base": (N,),
        p + "hc_head_scale": (1,),
    }
    shapes.update(_block_shapes(c, p, SLIDING, "moe"))
    return shapes


def _block_shapes(c, p: str, attn: str, mlp: str) -> dict[str, tuple[int, ...]]:
    """One transformer block's tensors under prefix p (`model.layers.3.`, `mtp.0.`)."""
    return {
        **_norm_and_hc_shapes(c, p),
        **_attention_shapes(c, p + "self_attn."),
        **_mlp_shapes(c, p + "mlp.", mlp),
        **_compressor_shapes(c, p + "self_attn.compressor.", attn),
    }


def _norm_and_hc_shapes(c, p: str) -> dict[str, tuple[int, ...]]:
    """A block's two norms and its two hyper-connections (attn_hc, ffn_hc)."""
    H, N = c.hidden_size, c.hc_mult
    mix = (2 + N) * N
    return {
        p + "input_layernorm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        p + "attn_hc.fn": (mix, N * H),
        p + "attn_hc.base": (mix,),
        p + "attn_hc.scale": (3,),
        p + "ffn_hc.fn": (mix, N * H),
        p + "ffn_hc.base": (mix,),
        p + "ffn_hc.scale": (3,),
    }


def _attention_shapes(c, p: str) -> dict[str, tuple[int, ...]]:
    """The attention's own tensors under p (`model.layers.3.self_attn.`), compressors aside."""
    H, D = c.hidden_size, c.head_dim
    nh, qr, g, olr = c.num_attention_heads, c.q_lora_rank, c.o_groups, c.o_lora_rank
    return {
        p + "q_a_proj.weight": (qr, H),
        p + "q_a_norm.weight": (qr,),
        p + "q_b_proj.weight": (nh * D, qr),
        p + "kv_proj.weight": (D, H),
        p + "kv_norm.weight": (D,),
        p + "o_a_proj.weight": (g * olr, nh * D // g),
        p + "o_b_proj.weight": (H, g * olr),
        p + "sinks": (nh,),
    }


def _mlp_shapes(c, p: str, mlp: str) -> dict[str, tuple[int, ...]]:
    """The MoE's tensors under p (`model.layers.3.mlp.`): router, routed and shared experts."""
    H, V = c.hidden_size, c.vocab_size
    E, I, K = c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok
    shapes: dict[str, tuple[int, ...]] = {
        p + "gate.weight": (E, H),
        p + "experts.gate_up_proj": (E, 2 * I, H),
        p + "experts.down_proj": (E, H, I),
        p + "shared_experts.gate_proj.weight": (I, H),
        p + "shared_experts.up_proj.weight": (I, H),
        p + "shared_experts.down_proj.weight": (H, I),
    }
    if mlp == "hash_moe":
        shapes[p + "gate.tid2eid"] = (V, K)
    else:
        shapes[p + "gate.e_score_correction_bias"] = (E,)
    return shapes


def _compressor_shapes(c, cp: str, attn: str) -> dict[str, tuple[int, ...]]:
    """The compressors' tensors under cp (`model.layers.3.self_attn.compressor.`): HCA's, or
    CSA's and its Lightning Indexer's; none for a sliding-window layer."""
    H, D, qr = c.hidden_size, c.head_dim, c.q_lora_rank
    Hi, Di = c.index_n_heads, c.index_head_dim
    if attn == HCA:
        r = c.compress_rates[HCA]
        return {
            cp + "kv_proj.weight": (D, H),
            cp + "gate_proj.weight": (D, H),
            cp + "position_bias": (r, D),
            cp + "kv_norm.weight": (D,),
        }
    if attn == CSA:
        r = c.compress_rates[CSA]
        ip = cp + "indexer."
        return {
            cp + "kv_proj.weight": (2 * D, H),
            cp + "gate_proj.weight": (2 * D, H),
            cp + "position_bias": (r, 2 * D),
            cp + "kv_norm.weight": (D,),
            ip + "kv_proj.weight": (2 * Di, H),
            ip + "gate_proj.weight": (2 * Di, H),
            ip + "position_bias": (r, 2 * Di),
            ip + "kv_norm.weight": (Di,),
            ip + "q_b_proj.weight": (Hi * Di, qr),
            ip + "scorer.weights_proj.weight": (Hi, H),
        }
    return {}
