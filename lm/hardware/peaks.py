"""Dense peak FLOP/s per device for the accelerators meshlm knows (vendor figures, no
sparsity): what MFU divides by, and what the planner's step time starts from."""

PEAK_FLOPS = {
    ("H200", "bfloat16"): 989e12,
    ("H100", "bfloat16"): 989e12,
    ("H100", "float32"): 67e12,
    ("H100", "float8"): 1979e12,
    ("H200", "float8"): 1979e12,
    ("H200", "float32"): 67e12,
    ("A100", "bfloat16"): 312e12,
    ("A100", "float32"): 19.5e12,
    ("TPU v4", "bfloat16"): 275e12,
    ("TPU v5p", "bfloat16"): 459e12,
    ("TPU v5 lite", "bfloat16"): 197e12,
}
