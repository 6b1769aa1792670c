"""Model FLOPs utilisation, nanoGPT/PaLM style.

FLOPs per token = 6*N + 12*L*H*Q*T, where N counts the parameters that do a
multiply-add per token: every weight matrix and norm, but NOT the token-embedding
lookup table (a gather, no FLOPs) - unless embeddings are tied, in which case the
shared matrix is counted once, as the output projection it also is. The second
term is attention's QK^T and AV (forward + backward) over a T-token context.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense bf16 peak FLOP/s (no sparsity), by a substring of torch.cuda.get_device_name().
# Order matters: the first match wins, so specific names come before generic ones.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM / HBM3
    ("A100", 312e12),
)


def peak_flops(device_name: str) -> float | None:
    """None for a device we have no trustworthy number for (CPU, unknown GPU)."""
    for key, value in PEAK_BF16_FLOPS:
        if key in device_name:
            return value
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
