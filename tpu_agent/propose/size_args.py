"""Where a size goes in PyTorch code (the nn modules, factories, tensor methods and keywords whose arguments are dims),
and what padding it changes: the model, the training (batch, sequence) or the data."""

from __future__ import annotations

import re
from typing import Literal

Effect = Literal["model", "training", "data"]  # what padding a literal changes (plan.actions.Effect's non-exact)

# nn modules: which positional args / keywords are tensor dims.
MODULE_DIMS: dict[str, tuple[tuple[int | None, str], ...]] = {
    "Linear": ((0, "in_features"), (1, "out_features")),
    "LazyLinear": ((0, "out_features"),),
    "Bilinear": ((0, "in1_features"), (1, "in2_features"), (2, "out_features")),
    "Embedding": ((0, "num_embeddings"), (1, "embedding_dim")),
    "EmbeddingBag": ((0, "num_embeddings"), (1, "embedding_dim")),
    "LayerNorm": ((0, "normalized_shape"),),
    "RMSNorm": ((0, "normalized_shape"),),
    "GroupNorm": ((1, "num_channels"),),
    "MultiheadAttention": ((0, "embed_dim"), (1, "num_heads")),
    "TransformerEncoderLayer": ((0, "d_model"), (1, "nhead"), (None, "dim_feedforward")),
    "TransformerDecoderLayer": ((0, "d_model"), (1, "nhead"), (None, "dim_feedforward")),
    "Transformer": ((0, "d_model"), (1, "nhead"), (None, "dim_feedforward")),
    "LSTM": ((0, "input_size"), (1, "hidden_size")),
    "GRU": ((0, "input_size"), (1, "hidden_size")),
    "RNN": ((0, "input_size"), (1, "hidden_size")),
    "LSTMCell": ((0, "input_size"), (1, "hidden_size")),
    "GRUCell": ((0, "input_size"), (1, "hidden_size")),
}
for _n in ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"):
    MODULE_DIMS[_n] = ((0, "in_channels"), (1, "out_channels"))
for _n in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"):
    MODULE_DIMS[_n] = ((0, "num_features"),)

# torch factories whose positional args (or the tuple among them) are sizes.
FACTORIES = {"randn", "rand", "zeros", "ones", "empty", "randint", "full", "arange", "eye", "randperm", "linspace"}
# Tensor methods whose args are sizes.
SIZE_METHODS = {"view", "reshape", "expand", "repeat", "tile", "new_zeros", "new_ones", "new_empty", "new_full",
                "unflatten"}
# Keywords that carry a dim in any call (a DataLoader's batch_size, a user's GPT(vocab_size=...)).
DIM_KEYWORDS = {
    "batch_size", "hidden_size", "hidden_dim", "embed_dim", "embedding_dim", "d_model", "dim_feedforward",
    "in_features", "out_features", "num_embeddings", "in_channels", "out_channels", "num_classes", "vocab_size",
    "n_embd", "d_ff", "intermediate_size", "num_features", "seq_len", "max_seq_len", "block_size", "n_positions",
    "max_position_embeddings", "num_heads", "n_head", "nhead", "size",
}
# Base classes whose subclasses hold data: a size inside one shapes the data, not the model.
DATA_BASES = {"Dataset", "IterableDataset", "TensorDataset", "Sampler", "BatchSampler"}
BATCH_NAME = re.compile(r"(^|_)(batch|batch_?size|bs)$", re.I)

# What a keyword's value sizes when it is not a model dim: the batch, or the sequence (both training choices).
KEYWORD_ROLES = {"batch_size": "batch", "seq_len": "sequence", "max_seq_len": "sequence", "block_size": "sequence"}
SEQUENCE_NAME = re.compile(r"(^|_)(seq|seq_?len|sequence_?length|block_?size|context_?len(gth)?|n_ctx|ctx)$", re.I)


def effect_of(ident: str | None, batch: bool, roles: dict[str, str]) -> tuple[Effect, str]:
    """What padding this literal changes, and the use that says so. The batch and the sequence length are
    training choices even where they shape the (synthetic) data; any other dim of a tensor made outside the
    model's classes is the data's own (its features, its token ids), which the tuner never changes."""
    if batch:
        return "training", "it sets the batch size (time is compared per sample)"
    if "sequence" in roles or (ident and SEQUENCE_NAME.search(ident)):
        return "training", f"it sets the sequence length ({roles.get('sequence') or ident}; time is compared per step)"
    if "data" in roles:
        return "data", f"it shapes the data: {roles['data']}"
    return "model", f"it sizes the model: {roles.get('model') or roles.get('follows') or 'a tensor dim'}"
