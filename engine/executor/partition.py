"""Which decoder layers each pipeline stage runs.

Stage s of P holds the layers [start, end) of the checkpoint, contiguous and in order;
the first stage also holds the token embedding, the last the final norm and the output
head. A partition is even by default, the remainder going to the first stages (they also
embed, but the last one computes logits and samples, the costliest extra):

    pp_layer_partition(3, 2)  -> [(0, 2), (2, 3)]
    pp_layer_partition(10, 4) -> [(0, 3), (3, 6), (6, 8), (8, 10)]

or given explicitly as a count of layers per stage (`pp_layer_partition=[1, 2]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineStage:
    """One stage's share of the model."""

    # 0-based position in the pipeline, and the number of stages.
    index: int
    num_stages: int
    # The checkpoint's layers [start_layer, end_layer); local layer i is layer start + i.
    start_layer: int
    end_layer: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.num_stages:
            raise ValueError(f"stage index {self.index} is outside [0, {self.num_stages})")
        if not 0 <= self.start_layer < self.end_layer:
            raise ValueError(f"stage {self.index} has no layers: "
                             f"[{self.start_layer}, {self.end_layer})")

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        """The single stage of a model that is not split."""
        return cls(0, 1, 0, num_layers)

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    @property
    def is_first(self) -> bool:
        """Reads token ids (or prompt embeddings) and embeds them."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Applies the final norm, computes logits and samples."""
        return self.index == self.num_stages - 1


def pp_layer_partition(
    num_layers: int, pp_size: int, override: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """The `[start, end)` layer range of each of `pp_size` stages.

    `override` gives the number of layers of each stage instead of the even split; it must
    have `pp_size` entries, each at least 1, adding up to `num_layers`.
    """
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    if num_layers < pp_size:
        raise ValueError(f"cannot split {num_layers} layers over {pp_size} pipeline stages: "
                         "every stage needs at least one layer")
    counts = _even_counts(num_layers, pp_size) if override is None else list(override)
    if override is not None:
        _check_override(counts, num_layers, pp_size)
    ranges = []
    start = 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def pipeline_stages(
    num_layers: int, pp_size: int, override: Sequence[int] | None = None
) -> list[PipelineStage]:
    """`pp_layer_partition` as `PipelineStage`s."""
    ranges = pp_layer_partition(num_layers, pp_size, override)
    return [PipelineStage(i, pp_size, start, end) for i, (start, end) in enumerate(ranges)]


def _even_counts(num_layers: int, pp_size: int) -> list[int]:
    base, remainder = divmod(num_layers, pp_size)
    return [base + 1 if i < remainder else base for i in range(pp_size)]


def _check_override(counts: list[int], num_layers: int, pp_size: int) -> None:
    if len(counts) != pp_size:
        raise ValueError(f"pp_layer_partition has {len(counts)} entries ({counts}); "
                         f"pipeline_parallel_size is {pp_size}: give one layer count per stage")
    if any(not isinstance(c, int) or isinstance(c, bool) for c in counts):
        raise ValueError(f"pp_layer_partition must hold integers, got {counts}")
    if min(counts) < 1:
        raise ValueError(f"pp_layer_partition {counts} gives a stage no layers: every stage "
                         "needs at least one")
    if sum(counts) != num_layers:
        raise ValueError(f"pp_layer_partition {counts} covers {sum(counts)} layers; the "
                         f"model has {num_layers}")
