"""Quantized weights: which formats the engine serves and how `--quantization` selects them
(config), the linear layers' method of each format (fp8, int4; layers/linear_method.py is the
seam), and which method a layer takes (methods)."""
