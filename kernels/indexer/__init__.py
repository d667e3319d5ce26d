"""DeepSeek-V4 Lightning Indexer: index scores and top-k entry selection (PyTorch and Triton).

References for all of them are in `kvmesh.kernels.indexer.ref`.
"""

from kvmesh.kernels.indexer.ops import indexer_scores, indexer_topk
from kvmesh.kernels.indexer.triton_indexer import indexer_scores_triton

__all__ = ["indexer_scores", "indexer_scores_triton", "indexer_topk"]
