"""The model and op names `attnlab bench` measures, importable without torch (the CLI's help text lists them)."""

FLA_MODELS = ("fla-gla", "fla-forgetting-transformer", "fla-nsa", "fla-mamba2")
PRESETS = ("softmax", "gla", "mamba2", "nsa", "2mamba", "2mamba-e", "gated_softmax", "softmax_divs",
           "softmax_taylor_80terms", "linear_elu", "linear__output_norm")
TRAIN_PEERS = ("hf-llama", *FLA_MODELS)
OP_PRESETS = ("2mamba", "2mamba-e", "gated_softmax", "softmax_divs", "softmax_taylor_80terms", "linear_elu", "linear__output_norm")
OP_PEERS = ("sdpa", "fla-parallel_forgetting_attn", "fla-chunk_gla")
# `attnlab-<mixer>-stats`: the model stepped with its training-health statistics recorded, as
# `attnlab train` steps it (NSA's gate and selection statistics); beside `attnlab-<mixer>`, their cost
STATS_SUFFIX = "-stats"
SCALE_MODELS = ("2mamba", "hf-llama")  # what `attnlab bench scale` measures by default
