"""Weight-only quantization of a loaded model's linear layers (`--quantization int8|int4`).

The model code does not know which precision it runs: `quantize_model` swaps its `nn.Linear`
modules for drop-in replacements after loading, before the runner (and torch.compile) sees it.
"""

from kvserve.engine.quantization.int4_linear import Int4Linear
from kvserve.engine.quantization.int8_linear import Int8Linear
from kvserve.engine.quantization.quantize_model import QUANTIZATION_MODES, QuantizationSummary, quantize_model

__all__ = ["Int4Linear", "Int8Linear", "QUANTIZATION_MODES", "QuantizationSummary", "quantize_model"]
