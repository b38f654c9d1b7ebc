"""Target GPU presets: each GPU's usable memory, compute capability and SM figures (`GpuPreset`), and `parse_gpu`,
which names one from `--gpu`. Sources of every figure: docs/gpus.md."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError

@dataclass(frozen=True, slots=True)
class GpuPreset:
    """A target GPU. `memory_bytes`: the device's usable total in bytes, what `torch.cuda.mem_get_info()[1]`
    (cudaMemGetInfo) reports, 470-720 MiB below nvidia-smi's total and varying by about 100 MiB with the driver:
    the lowest figure found is taken, so a verdict of "fits" holds on every driver. `sm`: compute capability × 10.
    `sm_count` and `max_threads_per_sm`: `cudaDeviceProp::multiProcessorCount` and `maxThreadsPerMultiProcessor`,
    which a CUDA reduction's launch configuration reads (analysis/cuda_reduce.py); where one preset covers several
    boards the largest SM count is taken, since more SMs never give a smaller staging buffer."""

    name: str
    memory_bytes: int
    sm: int
    sm_count: int
    max_threads_per_sm: int

    @property
    def native_bf16(self) -> bool:
        """bf16 tensor-core kernels need sm80 (Ampere) or later; `torch.cuda.is_bf16_supported()` still says True
        below it, by emulation (torch/cuda/__init__.py, `including_emulation=True`)."""
        return self.sm >= 80


MiB = 2**20
# Usable totals (cudaMemGetInfo, Linux) in MiB, from published deviceQuery / torch.cuda.get_device_properties / OOM
# outputs; the nvidia-smi totals they sit below are in the comments. Sources: docs/gpus.md.
# SM counts: NVIDIA's architecture whitepapers and product datasheets (H100 SXM5 132 / PCIe 114, H100 NVL and H200
# 132, B200 148, A100 108, RTX A6000 84, L40S 142, A10 72, A10G 80, L4 58, RTX 4090 128, RTX 3090 82, V100 80, T4 40);
# max resident threads per SM: CUDA C++ Programming Guide, "Technical Specifications per Compute Capability" (2048
# for 7.0, 8.0, 9.0, 10.0; 1536 for 8.6, 8.9; 1024 for 7.5).
GPU_PRESETS: dict[str, GpuPreset] = {
    p.name.lower(): p
    for p in (
        GpuPreset("H100-80GB", 81079 * MiB, 90, 132, 2048),  # SXM, PCIe (114 SMs); nvidia-smi 81559 MiB
        GpuPreset("H100-NVL", 95330 * MiB, 90, 132, 2048),  # 94 GB; nvidia-smi 95830 MiB
        GpuPreset("H200", 143156 * MiB, 90, 132, 2048),  # 141 GB; nvidia-smi 143771 MiB
        GpuPreset("B200", 182631 * MiB, 100, 148, 2048),  # nvidia-smi 183359 MiB
        GpuPreset("A100-80GB", 81051 * MiB, 80, 108, 2048),  # nvidia-smi 81920 MiB
        GpuPreset("A100-40GB", 40339 * MiB, 80, 108, 2048),  # nvidia-smi 40960 MiB
        GpuPreset("A6000", 48676 * MiB, 86, 84, 1536),  # RTX A6000 48 GB; nvidia-smi 49140 MiB
        GpuPreset("L40S", 45373 * MiB, 89, 142, 1536),  # 48 GB; nvidia-smi 46068 MiB
        GpuPreset("A10", 22516 * MiB, 86, 72, 1536),  # 24 GB; nvidia-smi 23028 MiB
        GpuPreset("A10G", 22587 * MiB, 86, 80, 1536),  # AWS g5; nvidia-smi 23028 MiB
        GpuPreset("L4", 22518 * MiB, 89, 58, 1536),  # 24 GB; nvidia-smi 23034 MiB
        GpuPreset("RTX4090", 24081 * MiB, 89, 128, 1536),  # nvidia-smi 24564 MiB
        GpuPreset("RTX3090", 24238 * MiB, 86, 82, 1536),  # nvidia-smi 24576 MiB
        GpuPreset("V100-32GB", 32480 * MiB, 70, 80, 2048),  # nvidia-smi 32510 MiB
        GpuPreset("V100-16GB", 16128 * MiB, 70, 80, 2048),  # nvidia-smi 16160 MiB
        GpuPreset("T4", 14918 * MiB, 75, 40, 1024),  # 16 GB; nvidia-smi 15360 MiB
    )
}
_GPU_ALIASES = {"h100": "h100-80gb", "h100-sxm": "h100-80gb", "h100-pcie": "h100-80gb", "h100nvl": "h100-nvl",
                "a100": "a100-80gb", "4090": "rtx4090", "3090": "rtx3090", "rtx-a6000": "a6000", "rtxa6000": "a6000",
                "v100": "v100-32gb", "rtx-4090": "rtx4090", "rtx-3090": "rtx3090"}


def parse_gpu(name: str) -> GpuPreset:
    """The preset named `name` (case-insensitive; aliases such as 'h100', '4090'). Raises UsageError listing the
    presets and `--gpu-memory` for any other device."""
    key = name.lower().replace("_", "-").replace(" ", "-")
    key = _GPU_ALIASES.get(key, key)
    if key not in GPU_PRESETS:
        valid = ", ".join(p.name for p in GPU_PRESETS.values())
        raise UsageError(f"unknown GPU {name!r}; choose one of: {valid} (or give any device's capacity with "
                         "--gpu-memory, e.g. 48GiB)")
    return GPU_PRESETS[key]


# Words of `torch.cuda.get_device_name()` (e.g. "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB") naming a preset,
# most specific first: each entry's words must all appear in the name (upper-cased, '-' and '_' read as spaces).
_DEVICE_NAME_WORDS = (
    (("H100", "NVL"), "H100-NVL"), (("H100",), "H100-80GB"), (("H200",), "H200"), (("B200",), "B200"),
    (("A100", "40GB"), "A100-40GB"), (("A100",), "A100-80GB"), (("A6000",), "A6000"), (("L40S",), "L40S"),
    (("A10G",), "A10G"), (("A10",), "A10"), (("L4",), "L4"), (("4090",), "RTX4090"), (("3090",), "RTX3090"),
    (("V100", "16GB"), "V100-16GB"), (("V100",), "V100-32GB"), (("T4",), "T4"),
)


def preset_for_device(name: str) -> GpuPreset | None:
    """The preset of a CUDA device named `name` as `torch.cuda.get_device_name()` reports it, or None when no
    preset matches (then the caller names one, or gives the capacity)."""
    words = set(name.upper().replace("-", " ").replace("_", " ").split())
    for needed, preset in _DEVICE_NAME_WORDS:
        if all(w in words for w in needed):
            return GPU_PRESETS[preset.lower()]
    return None
