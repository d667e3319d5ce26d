"""DeepSeek-V4 checkpoint tensors: upstream names to transformers' names, checked against the config.

A checkpoint may use transformers' parameter names (`model.layers.0.self_attn.q_a_proj.weight`,
`...mlp.experts.gate_up_proj`) or the upstream DeepSeek names that transformers' own
`save_pretrained` writes and its loader renames (`layers.0.attn.wq_a.weight`,
`...ffn.experts.3.w1.weight`); `normalize_names` maps the second to the first, following
transformers' conversion mapping for `deepseek_v4` (conversion_mapping.py). `check_and_take`
checks them against every tensor the config implies (kvmesh.engine.deepseek_v4.shapes), so
loading names the first missing, misshapen or unknown tensor instead of failing deep inside a
forward.
"""

from __future__ import annotations

import re

import torch

from kvmesh.engine.deepseek_v4.shapes import MTP_PREFIX, expected_shapes, mtp_shapes

# (pattern, replacement) applied in order to keys under model.layers.
_LAYER_RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn$", ".attn_hc.fn"),
    (r"\.hc_attn_base$", ".attn_hc.base"),
    (r"\.hc_attn_scale$", ".attn_hc.scale"),
    (r"\.hc_ffn_fn$", ".ffn_hc.fn"),
    (r"\.hc_ffn_base$", ".ffn_hc.base"),
    (r"\.hc_ffn_scale$", ".ffn_hc.scale"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.self_attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
_TOP_RENAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_EXPERT = re.compile(r"^((?:model\.layers\.\d+|mtp\.0)\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")
_MAIN_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(?:(gate_up_proj|down_proj)|(\d+)\.(w[123])\.weight)$")
MTP_OWN = (
    *("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "norm.weight"),
    *("hc_head_fn", "hc_head_base", "hc_head_scale"),
)
"""The MTP tensors beyond its transformer block, named as DeepSeek-V4's inference/model.py
(`MTPBlock`) and its released checkpoints name them."""


def normalize_key(key: str) -> str | None:
    """One checkpoint key in transformers' naming (`normalize_names`' renaming, before the
    per-expert weights are stacked: `model.layers.3.mlp.experts.5.w1.weight` stays per expert);
    None for a deeper MTP module's key, which is dropped."""
    mtp = re.match(r"^(?:model\.)?mtp\.(\d+)\.(.*)$", key)
    if mtp:
        if mtp.group(1) != "0":
            return None
        rest = mtp.group(2)
        if rest not in MTP_OWN:
            for pat, rep in _LAYER_RENAMES:
                rest = re.sub(pat, rep, "." + rest)[1:]
        key = MTP_PREFIX + rest
    key = _TOP_RENAMES.get(key, key)
    if key.startswith("layers."):
        key = "model." + key
    if key.startswith("model.layers."):
        for pat, rep in _LAYER_RENAMES:
            key = re.sub(pat, rep, key)
    return key


def routed_expert_key(name: str) -> tuple[int, int | None, str] | None:
    """(layer, expert or None when fused, part) of a main-model layer's routed-expert tensor
    under its normalized name: part is `gate_up_proj` / `down_proj` for transformers' fused
    [E, ...] tensors, `w1` / `w2` / `w3` for one expert's; None for any other tensor."""
    m = _MAIN_EXPERT.match(name)
    if m is None:
        return None
    if m.group(2) is not None:
        return int(m.group(1)), None, m.group(2)
    return int(m.group(1)), int(m.group(3)), m.group(4)


def normalize_names(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Rename upstream DeepSeek keys to transformers' and stack per-expert weights.

    Returns a new dict keyed by transformers' names; keys already in that form pass through.
    The multi-token-prediction module (`mtp.0.*`, which transformers does not instantiate) keeps
    its own tensors' names (`MTP_OWN`) and gets its block's renamed as a layer's
    (`mtp.0.attn.wq_a.weight` -> `mtp.0.self_attn.q_a_proj.weight`); deeper MTP modules
    (`mtp.1.*`, ...; the released V4 checkpoints have one) are dropped. Raises ValueError when an
    expert's w1/w2/w3 set is incomplete.
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        name = normalize_key(key)
        if name is None:
            continue
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
            continue
        out[name] = t
    for prefix, per_expert in experts.items():
        ids = sorted(per_expert)
        if ids != list(range(num_experts)) or any(len(per_expert[e]) != 3 for e in ids):
            raise ValueError(
                f"checkpoint tensors {prefix}.N.w1/w2/w3 must cover experts 0..{num_experts - 1} "
                f"with all three weights, got experts {ids}"
            )
        out[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([per_expert[e]["w1"], per_expert[e]["w3"]]) for e in ids]
        )
        out[prefix + ".down_proj"] = torch.stack([per_expert[e]["w2"] for e in ids])
    return out


def has_mtp(tensors) -> bool:
    """Whether a checkpoint's tensor names (either naming) include an MTP module's."""
    return any(re.match(r"^(?:model\.)?mtp\.0\.", k) for k in tensors)


def check_and_take(
    tensors: dict[str, torch.Tensor], config, name: str, routed_experts: bool = True
) -> dict[str, torch.Tensor]:
    """Normalize names and check every tensor against the config; fp32 copies of float tensors.
    A checkpoint with any `mtp.0.*` tensor must carry the whole MTP module (`mtp_shapes`).
    routed_experts=False: the main layers' routed experts are not expected (an expert-parallel
    rank reads only its own, `kvmesh.engine.ep.expert_weights`); `tensors` must not hold them either.

    Raises ValueError naming the first missing tensor, the first with a wrong shape, or the
    first the config does not use.
    """
    mtp = has_mtp(tensors)
    tensors = normalize_names(tensors, config.n_routed_experts)
    if config.tie_word_embeddings and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    out = {}
    expected = expected_shapes(config)
    if mtp:
        expected.update(mtp_shapes(config))
    for key, shape in expected.items():
        if not routed_experts and routed_expert_key(key) is not None:
            continue
        t = tensors.pop(key, None)
        if t is None:
            what = "multi-token-prediction tensor" if key.startswith(MTP_PREFIX) else "tensor"
            raise ValueError(f"checkpoint of {name!r} lacks {what} {key!r}")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"tensor {key!r} of {name!r} has shape {tuple(t.shape)}, expected {shape} from its config.json"
            )
        out[key] = t.float() if t.is_floating_point() else t.long()
    if tensors:
        raise ValueError(f"checkpoint of {name!r} has tensors its config does not use, e.g. {sorted(tensors)[:3]}")
    return out
