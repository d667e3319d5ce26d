"""DeepSeek-V4 mixture of experts: routers and routed experts (PyTorch and Triton paths).

References for all of them are in `kernels.moe.ref`.
"""

from kernels.moe.experts import moe_experts
from kernels.moe.routing import route_hash, route_topk
from kernels.moe.triton_moe import moe_experts_triton

__all__ = ["moe_experts", "moe_experts_triton", "route_hash", "route_topk"]
