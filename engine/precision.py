"""`--dtype`: the precision a model service computes in and keeps its KV pages in, chosen once at
start, as vLLM's and SGLang's `--dtype` are.

- `float32` (`float`, `fp32`): weights, activations and pages in fp32; greedy tokens equal
  transformers' fp32 token for token (the parity tests).
- `bfloat16` (`bf16`): weights, GEMMs, attention and pages in bf16, accumulation in fp32 where the
  reference accumulates so; logits, the sampler, logprobs and grammar masks stay fp32. Judged by
  the acceptance rule in docs/precision.md, not by equality with fp32.
- `auto` (the default): bf16 where the hardware computes it natively, else fp32: a CUDA device of
  compute capability 8.0 or newer (Ampere on), or a CPU whose flags (`/proc/cpuinfo`) name
  `amx_bf16` or `avx512_bf16`. Read from the flags, never guessed from the vendor; a model family
  whose runner computes in fp32 only takes fp32 whatever the hardware.

`resolve_dtype` returns the choice with the reason, which every service logs at start. This module
loads torch only where a device is asked about, so command lines check `--dtype` without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_CHOICES = "auto|float32|bfloat16"

_NAMES = {"float32": "float32", "float": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
"""Each accepted spelling -> the dtype's name (torch's, without its prefix)."""

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU flags (Linux's names in /proc/cpuinfo) of native bf16 arithmetic: AMX's bf16 tiles, or
AVX-512's bf16 dot products (Intel Cooper Lake and Sapphire Rapids on, AMD Zen 4 on)."""


@dataclass(frozen=True)
class Precision:
    """What `--dtype` resolved to on this machine, and why."""

    name: str
    """'float32' or 'bfloat16': the name stats, Reserve's layout and the logs carry."""
    reason: str
    """One clause for the start-up log, e.g. 'auto: the CPU has avx512_bf16'."""

    @property
    def dtype(self) -> torch.dtype:
        """torch.float32 or torch.bfloat16."""
        import torch

        return getattr(torch, self.name)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (torch's own name without its prefix)."""
    return str(dtype).removeprefix("torch.")


def check_dtype_spec(spec: str) -> None:
    """Raise ValueError unless `spec` is auto or names float32 or bfloat16 (float, fp32, bf16 too)."""
    if spec != "auto" and spec not in _NAMES:
        hint = " (fp16 is not served: its range overflows on long prompts; use bfloat16)" if "16" in spec else ""
        raise ValueError(f"--dtype must be one of {DTYPE_CHOICES}, got {spec!r}{hint}")


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags as Linux reports them ('flags' line of /proc/cpuinfo);
    empty where the file is missing or has no such line (another OS, a sandbox)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16(device: torch.device, flags: frozenset[str] | None = None) -> str:
    """Why `device` computes bf16 natively ('' when it does not): the CUDA compute capability
    (8.0 on), or the CPU flag that says so (`flags`, default `cpu_flags()`)."""
    if device.type == "cuda":
        import torch

        major, minor = torch.cuda.get_device_capability(device)
        return f"CUDA sm{major}{minor} computes bf16 natively" if major >= 8 else ""
    found = [f for f in BF16_CPU_FLAGS if f in (cpu_flags() if flags is None else flags)]
    return f"the CPU has {' and '.join(found)}" if found else ""


def resolve_dtype(
    spec: str,
    device: torch.device,
    family_dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    family: str = "",
    flags: frozenset[str] | None = None,
) -> Precision:
    """The dtype `spec` (auto|float32|bfloat16) means for a model family computing in
    `family_dtypes` (names) on `device`, with the reason.

    auto: bf16 when the family computes it and `native_bf16(device, flags)` says the hardware
    does, else fp32. Raises ValueError for a malformed spec, or a dtype the family does not
    compute (naming the family and what it computes).
    """
    check_dtype_spec(spec)
    if spec == "auto":
        if "bfloat16" not in family_dtypes:
            return Precision("float32", f"auto: {family or 'this model'} computes in float32 only")
        native = native_bf16(device, flags)
        if native:
            return Precision("bfloat16", f"auto: {native}")
        if device.type == "cuda":
            return Precision("float32", "auto: this CUDA device predates sm80 (no native bf16)")
        return Precision("float32", f"auto: the CPU has none of {', '.join(BF16_CPU_FLAGS)}")
    dtype = _NAMES[spec]
    if dtype not in family_dtypes:
        raise ValueError(f"--dtype {spec}: {family or 'this model'} computes in {', '.join(family_dtypes)} only")
    if dtype == "bfloat16" and device.type == "cpu" and not native_bf16(device, flags):
        return Precision(dtype, "asked for; this hardware has no native bf16, so it runs emulated (slower than fp32)")
    return Precision(dtype, "asked for")


QUANTIZATION_CHOICES = ("none", "int8")
"""`--quantization` on a model service: none (the layers' matmuls take activations in --dtype), or
int8 (each row's inputs as int8 blocks, W4A8 against the GGUF file's Q4_1 weights:
`kvmesh.kernels.quant_a8`, llama.cpp's Q8 activations), in prefill and decode alike."""


def check_quantization_spec(spec: str) -> None:
    """Raise ValueError unless `spec` is one of QUANTIZATION_CHOICES."""
    if spec not in QUANTIZATION_CHOICES:
        raise ValueError(f"--quantization must be one of {'|'.join(QUANTIZATION_CHOICES)}, got {spec!r}")


def apply_quantization(runner: object, spec: str) -> str:
    """Switch `runner`'s matmuls to `spec` (QUANTIZATION_CHOICES) and say what they compute with,
    for the start-up log. Raises ValueError for a malformed spec, a runner without an int8 path
    (DeepSeek-V4's), or one whose layers have no GGUF blocks here (a GPU, no GGUF file)."""
    check_quantization_spec(spec)
    if spec == "none":
        return "the layers' matmuls take activations in the model's dtype"
    use = getattr(runner, "use_int8_activations", None)
    if use is None:
        raise ValueError(f"--quantization {spec}: {type(runner).__name__} has no int8 path (Llama on the CPU only)")
    use()
    return "the layers' matmuls take int8 activations against the Q4_1 blocks (W4A8; the lm_head as --dtype)"
