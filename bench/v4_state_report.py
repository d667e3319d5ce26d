"""`python -m kvmesh.bench.v4_state_report`: DeepSeek-V4 state bytes per token, computed
from configs (the tiny test config and transformers' DeepSeek-V4-Flash defaults) through
`V4StateLayout` (engine/deepseek_v4/state.py)."""

from __future__ import annotations

from kvmesh.engine.deepseek_v4.state import V4StateLayout


def main() -> None:
    """Print page and slot bytes of each config."""
    from transformers import DeepseekV4Config

    from kvmesh.bench.tiny_models import deepseek_v4_tiny_config

    for name, cfg in (
        ("tiny test config", deepseek_v4_tiny_config()),
        ("DeepSeek-V4-Flash (transformers' defaults)", DeepseekV4Config()),
    ):
        lay = V4StateLayout.from_config(cfg, V4StateLayout.default_page_size(cfg))
        print(
            f"{name}: page {lay.page_size} tokens, {lay.page_floats * 4} B/page fp32, "
            f"{lay.bytes_per_token(4):.0f} B/token fp32 ({lay.bytes_per_token(2):.0f} in bf16), "
            f"slot {lay.slot_floats * 4} B per running request"
        )


if __name__ == "__main__":
    main()
