"""How a KV push reaches pages that live on a GPU: UCX moves them itself, or they pass through
host buffers.

- `host`: the pages are in host memory; UCX reads and writes them in place (shared memory, cma,
  tcp), as on every CPU instance.
- `direct`: the pages are device memory and UCX has a CUDA transport loaded (`cuda_copy`, with
  `cuda_ipc` between GPUs of one node and RDMA with GPUDirect across nodes where present): the
  buffers go to UCX as they are (`__cuda_array_interface__`), as Dynamo's and SGLang's NIXL
  and Mooncake paths do.
- `staged`: the pages are device memory but UCX cannot touch it (a UCX built without CUDA, or
  UCX_TLS leaving the CUDA transports out): the sender copies each page into a host buffer
  (pinned when CUDA is there) and pushes those; the receiver lands them in host buffers and
  copies them into its pages once the push is complete (vLLM's `kv_buffer_device=cpu` for NIXL).

The path is chosen once per instance (`choose_push_path`) and logged at start. It works on CPU
tensors too, which is how the tests exercise `staged` here: the same copies, host to host.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

PUSH_PATHS = ("auto", "direct", "staged")
"""`--kv-push-path` values: auto picks `host`, `direct` or `staged` from the pages' device and UCX."""

CUDA_TRANSPORTS = ("cuda_copy", "cuda_ipc", "gdr_copy")


def check_push_path(name: str) -> None:
    """Raise ValueError unless `name` is one of PUSH_PATHS."""
    if name not in PUSH_PATHS:
        raise ValueError(f"KV push path must be one of {list(PUSH_PATHS)}, got {name!r}")


def ucx_transports() -> set[str]:
    """The transports UCX loaded in this process (`ucxx.get_active_transports`, e.g. tcp, posix,
    cma, cuda_copy, cuda_ipc, rc)."""
    import ucxx

    return set(ucxx.get_active_transports())


def choose_push_path(device: str, asked: str = "auto", transports: set[str] | None = None) -> tuple[str, str]:
    """(path, why): how pushes reach pages on `device` ("cpu", "cuda:N"), for `asked` (auto,
    direct, staged). Host pages always move in place (`host`). `transports`: UCX's, read when
    None and needed. Raises ValueError when `direct` is asked and UCX has no CUDA transport."""
    check_push_path(asked)
    if device == "cpu" and asked == "auto":
        return "host", "pages in host memory: UCX reads and writes them in place"
    if asked == "staged":
        return "staged", f"pages on {device}, copied through host buffers ({'pinned' if _pinned() else 'pageable'})"
    have = ucx_transports() if transports is None else transports
    cuda = sorted(t for t in have if t in CUDA_TRANSPORTS)
    if cuda:
        return "direct", f"pages on {device}, moved by UCX itself ({', '.join(cuda)})"
    if asked == "direct":
        raise ValueError(
            f"--kv-push-path direct: UCX loaded no CUDA transport (it has {sorted(have)}); use a CUDA build of UCX "
            "(ucxx-cu12 brings one) and leave UCX_TLS unset, or --kv-push-path staged"
        )
    return "staged", f"pages on {device}; UCX has no CUDA transport ({sorted(have)}): copied through host buffers"


def _pinned() -> bool:
    return torch.cuda.is_available()


def _host_like(buf: np.ndarray | torch.Tensor) -> np.ndarray:
    """An empty 1-D uint8 host buffer of buf's bytes (pinned where CUDA is)."""
    nbytes = buf.nbytes if isinstance(buf, np.ndarray) else buf.numel() * buf.element_size()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=_pinned()).numpy()


def _tensor(buf: np.ndarray | torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf


def stage_out(buffers: Sequence[np.ndarray | torch.Tensor]) -> list[np.ndarray]:
    """Host copies (1-D uint8) of page buffers, in order, for a staged push; returns once copied."""
    out = []
    for buf in buffers:
        host = _host_like(buf)
        torch.from_numpy(host).copy_(_tensor(buf))  # device to host, waits for the page's writes
        out.append(host)
    return out


class StagedLanding:
    """The host buffers a staged push lands in for a request's page buffers, and the copy into
    those pages once the push is complete (`land`)."""

    def __init__(self, buffers: Sequence[np.ndarray | torch.Tensor]) -> None:
        self.targets = list(buffers)
        self.host = [_host_like(b) for b in self.targets]
        """What the KV receiver lands the push in: one uint8 host buffer a page (then the slot)."""

    def land(self) -> None:
        """Copy every landed host buffer into its page (host to device)."""
        for target, host in zip(self.targets, self.host):
            _tensor(target).copy_(torch.from_numpy(host))
