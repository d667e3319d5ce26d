"""DeepSeek-V4 mixture of experts: routers and routed experts (PyTorch and Triton paths).

References for all of them are in `kvmesh.kernels.moe.ref`.
"""

from kvmesh.kernels.moe.experts import moe_experts
from kvmesh.kernels.moe.routing import route_hash, route_topk
from kvmesh.kernels.moe.triton_moe import moe_experts_triton

__all__ = ["moe_experts", "moe_experts_triton", "route_hash", "route_topk"]
