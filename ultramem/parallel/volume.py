"""Bytes one rank sends per memory-layer forward, by the paper's formulas (appendix "partition details").

bs = tokens on the rank, K = H*m selected slots per token, Dv the value dim, P the shard-group size. The paper
counts one score per slot and one pooled row per token; with MCS (h cores) and IVE (E groups) those become h
scores per slot and E pooled rows per token. Owner-side pooling is predicted for uniformly spread rows.
"""

from __future__ import annotations

from dataclasses import dataclass

INDEX_BYTES = 8  # int64 row indices


@dataclass(frozen=True)
class LookupShape:
    """What the formulas need of a config and a batch."""

    tokens: int  # bs
    slots: int  # K = H * m
    value_dim: int  # Dv
    num_cores: int  # h
    num_groups: int  # E
    value_bytes: int = 4  # element size of values and scores
    row_bytes: int | None = None  # a row as stored and sent back number-wise (None: value_bytes * Dv; quantized: less)
    pooled_bytes: int | None = None  # element size of pooled rows (None: value_bytes; quantized stores pool in fp32)

    def __post_init__(self) -> None:
        if self.row_bytes is None:
            object.__setattr__(self, "row_bytes", self.value_bytes * self.value_dim)
        if self.pooled_bytes is None:
            object.__setattr__(self, "pooled_bytes", self.value_bytes)


def number_volume(shape: LookupShape, size: int) -> dict[str, float]:
    """All-to-all of the indices to their owners, all-to-all of the rows back; pooling at the source."""
    remote = shape.tokens * shape.slots * (size - 1) / size
    return {"indices": INDEX_BYTES * remote, "values": shape.row_bytes * remote}


def number_owner_volume(shape: LookupShape, size: int) -> dict[str, float]:
    """Indices and scores to the owners; each owner returns one pooled row per (token, group) it serves."""
    remote = shape.tokens * shape.slots * (size - 1) / size
    cells = size * shape.num_groups  # (owner, group) cells a slot falls in
    served = (size - 1) * shape.num_groups * (1 - (1 - 1 / cells) ** shape.slots)  # expected remote cells per token
    return {
        "indices": INDEX_BYTES * remote,
        "scores": shape.value_bytes * remote * shape.num_cores,
        "pooled": shape.pooled_bytes * shape.tokens * served * shape.value_dim,
    }


def dimension_volume(shape: LookupShape, size: int) -> dict[str, float]:
    """All-gather of indices and scores, all-to-all of the pooled column slices back."""
    gathered = shape.tokens * shape.slots * (size - 1)
    return {
        "indices": INDEX_BYTES * gathered,
        "scores": shape.value_bytes * gathered * shape.num_cores,
        "pooled": shape.pooled_bytes * shape.tokens * shape.num_groups * shape.value_dim * (size - 1) / size,
    }


VOLUMES = {"number": number_volume, "number_owner": number_owner_volume, "dimension": dimension_volume}
"""Predicted per-rank forward bytes of each partitioning (the backward sends the differentiable parts again)."""
