"""The kernel list: each distinct kernel name with its classification, by share of GPU time (`kvtrace
kernels`, and the per-name totals `--verify` checks against NVIDIA's tools)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import polars as pl

from kvtrace import __version__
from kvtrace.analyzer.classify import KV_SEGMENTS, RecipeSet
from kvtrace.analyzer.compare import classify_signatures, default_label
from kvtrace.analyzer.results import Arm, schema_first
from kvtrace.analyzer.load import Trace


@dataclass
class KernelList:
    """Distinct kernel names with their classification, by share of GPU time."""

    arm: Arm
    recipes: tuple[str, ...]
    only_unclassified: bool
    rows: list[dict] = field(default_factory=list)
    schema: str = "kvtrace.kernels/1"
    kvtrace_version: str = __version__

    def to_dict(self) -> dict:
        return schema_first(asdict(self))


def list_kernels(trace: Trace, recipes: RecipeSet, *, unclassified: bool = False, segment: str | None = None,
                 label: str | None = None) -> KernelList:
    classes = classify_signatures(trace, recipes)
    per_sig = trace.calls.cells.group_by("sig").agg(pl.col("calls").sum().cast(pl.UInt32),
                                                    pl.col("total_ns").sum())
    total_ns = int(per_sig["total_ns"].sum())
    kv = classes.filter(pl.col("segment").is_in(list(KV_SEGMENTS)))["kv_dtype"].drop_nulls().unique().sort()
    arm = Arm(label=label or default_label([trace]), info=trace.info, total_ns=total_ns, kv_dtypes=tuple(kv))
    kernels = per_sig.join(classes, on="sig")
    if unclassified:
        kernels = kernels.filter(pl.col("recipe").is_null())
    if segment:
        kernels = kernels.filter(pl.col("segment") == segment)
    table = (kernels.sort("sig").group_by("demangled", maintain_order=True)
             .agg(pl.col("segment").first(), pl.col("recipe").first(), pl.col("family_label").first(),
                  pl.col("kv_dtype").first(), pl.col("calls").sum(), pl.col("total_ns").sum())
             .with_columns((pl.col("total_ns") / pl.col("calls")).alias("mean_ns"),
                           (pl.col("total_ns") / arm.total_ns).alias("share"))
             .sort("total_ns", descending=True, maintain_order=True)
             .select("segment", "family_label", "kv_dtype", "calls", "total_ns", "mean_ns", "share", "recipe",
                     "demangled"))
    return KernelList(arm=arm, recipes=tuple(recipes.files), only_unclassified=unclassified,
                      rows=table.to_dicts())
