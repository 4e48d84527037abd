"""The CPU linear kernels: the packed fp32/bf16 layer, int8 quantized kernels, and the measured
choice among them at load.

- packed.py: `Linear` and the oneDNN-packed weights it can carry
- quant.py: the int8 and bf16 kernels (`KERNELS`) a layer can be given
- select.py: `choose_linears`, each layer shape timed once per machine (models/measure_cache.py)
"""
