"""The names of the layouts moe_lab.formats reads (no torch: the command line's parser lists them)."""

LINE_FORMATS = (  # a JSONL line's routed_experts, one layout a line (formats.jsonl.LINE_READERS reads each)
    "vllm",
    "sglang",
    "nemo_rl",
    "prime_rl",
    "verl",
)
FILE_FORMATS = ("trace", "slime")  # a whole file: moe_lab's trace (.safetensors), slime's debug dump (.pt)
FORMATS = ("auto", *LINE_FORMATS, *FILE_FORMATS)
LAYER_NUMBERINGS = ("moe", "decoder", "moe+mtp", "decoder+mtp")  # a layout's layer axis (formats.layers.layer_maps)
