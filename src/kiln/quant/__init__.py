"""Model quantization: schemes, round-to-nearest and GPTQ, saving and loading quantized model directories.

from kiln.quant import QuantScheme, quantize_model, save_quantized, load_quantized
"""

from kiln.quant.apply import load_quantized, quantize_model, save_quantized
from kiln.quant.scheme import QuantScheme

__all__ = ["QuantScheme", "load_quantized", "quantize_model", "save_quantized"]
