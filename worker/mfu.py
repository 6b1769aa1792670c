"""Model FLOPs utilisation, nanoGPT/PaLM style.

The convention (PaLM appendix B; nanoGPT's estimate_mfu; the same as llm-foundry and
torchtitan report): FLOPs per token = 6*N + 12*L*H*Q*T.

- 6*N: each parameter that does a multiply-add per token costs 2 FLOPs forward and
  4 backward. N counts every weight matrix and norm but NOT the token-embedding
  lookup (a gather, no FLOPs), unless embeddings are tied, in which case the shared
  matrix is counted once, as the output projection it also is.
- 12*L*H*Q*T: attention's QK^T and AV (2 matmuls x 2 FLOPs x 3 for forward+backward)
  for L layers, H heads of dim Q, over a T-token context. The causal mask is not
  discounted (PaLM's choice), and recomputation under activation checkpointing is not
  counted: MFU measures useful model FLOPs, not what the GPU happened to execute.

MFU = tokens/s x FLOPs per token / the device's dense bf16 peak.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Dense bf16 tensor-core peak FLOP/s (no 2:4 sparsity), from each vendor data sheet,
# keyed by a model name as torch.cuda.get_device_name() spells it. A key matches as a
# whole word ("H20" is not in "H200", "L4" not in "L40S", "H200" not in "GH200") and
# the longest matching key wins ("H100 NVL" before "H100").
PEAK_BF16_FLOPS = {
    "B200": 2250e12,
    "H100": 989e12,  # SXM5 / HBM3
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200": 989e12,
    "H200 NVL": 835e12,
    "GH200": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "RTX A6000": 155e12,
    # GeForce spec sheet figure (FP16 accumulate); torch's bf16 matmuls accumulate in
    # fp32, which GeForce boards run at half that rate, so MFU reads low here.
    "RTX 4090": 165e12,
}


def peak_flops(device_name: str) -> float | None:
    """None for a device we have no trustworthy number for (CPU, unknown GPU)."""
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name):
            return PEAK_BF16_FLOPS[key]
    return None


@dataclass(frozen=True)
class FlopsModel:
    flops_per_token: float
    peak: float | None  # per device

    @classmethod
    def for_model(cls, matmul_params: int, n_layers: int, n_heads: int, head_dim: int,
                  seq_len: int, device_name: str) -> FlopsModel:
        per_token = 6 * matmul_params + 12 * n_layers * n_heads * head_dim * seq_len
        return cls(float(per_token), peak_flops(device_name))

    def tflops(self, tokens_per_s: float) -> float:
        return tokens_per_s * self.flops_per_token / 1e12

    def mfu(self, tokens_per_s: float) -> float | None:
        """Fraction of this device's peak, from this device's tokens/s."""
        if self.peak is None:
            return None
        return tokens_per_s * self.flops_per_token / self.peak
