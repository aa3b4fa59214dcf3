"""Tile configurations per arch and token tier, and the lookup every launch uses.

The table (kimi_k3_moe/configs/tables/flydsl_tiles.json) lists tiers by
`max_tokens`, ascending; a token count takes the first tier whose max_tokens
is >= it, and the last tier (max_tokens null) takes every larger count. There
is no other rule and no heuristic: every count >= 1 gets exactly one tier, and
`stage_configs` fits that tier's tile to the layer's shape (same rules on every
path: narrower tiles when N is not a multiple of the tile width, never an error
for a shape the kernels can serve).

A tier's stage tile is a `config.Tile`; its JSON row names waves, n_rep, kb_unroll and
the K-loop `schedule` (optionally k_waves and waves_per_eu). Rows written before the
schedule (a_lds / prefetch / load_first booleans, e.g. older `kimi-k3-moe tune` tables)
are read as the same tiles.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from importlib import resources

from kimi_k3_moe.act_quant import BF16
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.amd_archs import AMD_ARCHS
from kimi_k3_moe.configs import user_tables
from kimi_k3_moe.kernels.flydsl import layout
from kimi_k3_moe.kernels.flydsl.config import (
    REDUCTIONS,
    Activation,
    FlyKernelConfig,
    GemmShape,
    KLoop,
    Reduction,
    RowBlocks,
    Tile,
    check_arch,
)

TABLE = "flydsl_tiles.json"
MAX_BM = 128  # the forward pass sizes its 32-bit offsets for alignment blocks up to this


@dataclass(frozen=True)
class Tier:
    max_tokens: int | None
    BM: int
    stage1: Tile
    stage2: Tile
    # the direct layout (no alignment launch) where the routing allows it: one pair per block
    direct: bool = False
    # the top-k sum by default ("auto"): deterministic slots rows, or fp32 atomics where those model faster
    reduce: str = "slots"

    def serves(self, num_tokens: int) -> bool:
        return self.max_tokens is None or num_tokens <= self.max_tokens


def _validate(arch: str, tiers: list[Tier]) -> None:
    if not tiers:
        raise ValueError(f"{TABLE}: no tiers for {arch}")
    bounds = [t.max_tokens for t in tiers]
    if bounds[-1] is not None or any(b is None for b in bounds[:-1]):
        raise ValueError(f"{TABLE}[{arch}]: only the last tier may (and must) have max_tokens null; got {bounds}")
    if any(not isinstance(b, int) or b < 1 for b in bounds[:-1]) or bounds[:-1] != sorted(set(bounds[:-1])):
        raise ValueError(f"{TABLE}[{arch}]: max_tokens must be positive ints, strictly increasing; got {bounds}")
    for t in tiers:
        if t.reduce not in REDUCTIONS:
            raise ValueError(f"{TABLE}[{arch}] tier {t.max_tokens}: reduce {t.reduce!r} not in {REDUCTIONS}")
        if not isinstance(t.direct, bool) or (t.direct and t.BM != layout.MFMA_TILE):
            raise ValueError(f"{TABLE}[{arch}] tier {t.max_tokens}: direct must be true or false, and true "
                             f"only with BM {layout.MFMA_TILE} (one pair per block); got {t.direct!r}, BM={t.BM}")
        if not isinstance(t.BM, int) or not 16 <= t.BM <= MAX_BM or t.BM % 16:
            raise ValueError(f"{TABLE}[{arch}] tier {t.max_tokens}: BM={t.BM} must be a multiple of 16 "
                             f"in [16, {MAX_BM}]")


def _tier(arch: str, row: dict) -> Tier:
    where = f"{TABLE}[{arch}] tier {row.get('max_tokens')}"
    return Tier(row["max_tokens"], row["BM"], Tile.from_row(row["stage1"], f"{where}: stage1"),
                Tile.from_row(row["stage2"], f"{where}: stage2"), row.get("direct", False), row.get("reduce", "slots"))


def tier_row(tier: Tier) -> dict:
    """The table's JSON row of `tier` (what load_table reads back)."""
    row = {"max_tokens": tier.max_tokens, "BM": tier.BM, "stage1": tier.stage1.to_row(),
           "stage2": tier.stage2.to_row(), "reduce": tier.reduce}
    return {**row, "direct": True} if tier.direct else row


def load_table(data: dict | None = None) -> dict[str, tuple[Tier, ...]]:
    """arch -> tiers, checked: ascending bounds, one open-ended last tier, complete tiles."""
    if data is None:
        data = json.loads(resources.files("kimi_k3_moe.configs").joinpath("tables", TABLE).read_text())
    table = {}
    for arch, rows in data.items():
        if arch == "about":
            continue
        check_arch(arch)
        tiers = [_tier(arch, r) for r in rows]
        _validate(arch, tiers)
        table[arch] = tuple(tiers)
    return table


@functools.lru_cache(maxsize=1)
def default_table() -> dict[str, tuple[Tier, ...]]:
    return load_table()


def shape_key(weight_format: str, hidden: int, inter: int, top_k: int) -> str:
    """A user table's entry key for a layer of this shape."""
    return f"{weight_format}/N{2 * inter}_K{hidden}_top{top_k}"


def _user_row(r: dict) -> dict:
    return {k: r[k] for k in ("max_tokens", "BM", "stage1", "stage2", "direct", "reduce") if k in r}


def _user_tiers(entry: dict) -> list:
    rows = entry.get("tiers") if isinstance(entry, dict) else None
    return [r.get("tuned_at_tokens") for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def _check_user_entry(key: str, entry: dict) -> None:
    # the tiers' checks hold on every arch; the entry's own arch is the table's target_arch
    load_table({next(iter(AMD_ARCHS)): [_user_row(r) for r in entry["tiers"]]})


# what `kimi-k3-moe tune` writes for this backend (configs/user_tables.py reads and checks it)
USER_TABLE = user_tables.TableKind("flydsl", _user_tiers, _check_user_entry)


def user_tiers(arch: str, weight_format: str, hidden: int, inter: int, top_k: int):
    """{arch: tiers} from a user table for this exact shape on this GPU, else None."""
    table, path = user_tables.load(USER_TABLE)
    if table is None or table.get("target_arch") != arch:
        return None
    entry = table["entries"].get(shape_key(weight_format, hidden, inter, top_k))
    if entry is None:
        return None
    try:  # checked for gfx950 when read; this arch's rules may refuse it
        return load_table({arch: [_user_row(r) for r in entry["tiers"]]})
    except user_tables.DATA_ERRORS as exc:
        user_tables.refused(path, f"entry {shape_key(weight_format, hidden, inter, top_k)} cannot serve {arch}: {exc}")
        return None


def tier_for(arch: str, num_tokens: int, table: dict | None = None) -> Tier:
    check_arch(arch)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
    table = default_table() if table is None else table
    for tier in table[arch]:
        if tier.serves(num_tokens):
            return tier
    raise AssertionError("unreachable: the last tier is open-ended (checked at load)")


def _fit(tile: Tile, BM: int, N: int, K: int, pairs: bool = False, lds: bool = True) -> Tile:
    """The tier's tile, narrowed until it divides this shape (n_rep first, then waves; k_waves for K).

    `pairs` (stage 1 with quantized activations: a wave's output columns must come in
    32-column scale groups) keeps n_rep even, turning an odd n_rep into twice as many
    sub-tiles on half the waves; `lds=False` (quantized activations) drops the LDS staging.
    """
    if N % layout.MFMA_TILE or K % layout.K_BLOCK:
        raise ValueError(f"FlyDSL kernels need N % {layout.MFMA_TILE} == 0 and K % {layout.K_BLOCK} == 0 "
                         f"(got N={N}, K={K})")
    waves, n_rep, unroll = tile.waves, tile.n_rep, tile.kb_unroll
    low = 2 if pairs else 1
    if pairs and n_rep % 2:
        n_rep, waves = n_rep * 2, max(1, waves // 2)
    if pairs and N % (2 * layout.MFMA_TILE):
        raise ValueError(f"quantized activations need N % 32 == 0 (one e8m0 scale per 32 columns), got N={N}")
    while N % (waves * n_rep * layout.MFMA_TILE):
        if n_rep > low:
            n_rep //= 2
        else:
            waves //= 2
    while K % (layout.K_BLOCK * unroll):
        unroll //= 2
    schedule, k_waves = tile.schedule, tile.k_waves
    if not lds:   # quantized activations: loaded by each wave, their loops keep waiting on a prefetched
        schedule, k_waves = KLoop.GLOBAL, 1   # block (ISA), and they are not split over waves
    elif schedule.staged and (BM * 16 * unroll) % (waves * layout.LANES):
        schedule = schedule.with_staging(False)
    while (K // (layout.K_BLOCK * unroll)) % k_waves:
        k_waves -= 1
    return replace(tile, waves=waves, n_rep=n_rep, kb_unroll=unroll, k_waves=k_waves, schedule=schedule)


def stage_configs(arch: str, weight_format: str, *, hidden: int, inter: int, top_k: int, num_tokens: int,
                  activation: ActivationSpec, betas: str = "const", has_offsets: bool = False,
                  reduce: str = "auto", act_dtype: str = BF16,
                  direct_experts: int | None = None, table: dict | None = None,
                  bf16_out: bool = True) -> tuple[FlyKernelConfig, FlyKernelConfig]:
    """(stage 1, stage 2) kernel configs for a layer of this shape at this token count.

    `direct_experts`: the layer's expert count where the routing can take the direct layout (int32
    ids, no expert map; the forward decides); a tier marked direct then takes it, bf16 activations only.
    `reduce`: "auto" takes the tier's top-k sum, "slots", "fused" or "atomic" that one at every tier.
    "fused" needs the alignment (it zeroes the counters), bf16 activations and a bf16 output
    (`bf16_out`, what the engines pass); elsewhere the same rows are summed by "slots".
    """
    if table is None:  # a valid user table (kimi-k3-moe tune) for exactly this GPU and shape comes first
        table = user_tiers(arch, weight_format, hidden, inter, top_k)
    tier = tier_for(arch, num_tokens, table)
    quantized = act_dtype != BF16
    direct = tier.direct and direct_experts is not None and not quantized
    common = dict(arch=arch, weight_format=weight_format, has_offsets=has_offsets, act_dtype=act_dtype,
                  rows=RowBlocks(tier.BM, direct_experts if direct else 0))
    s1 = FlyKernelConfig(shape=GemmShape(inter, hidden, top_k), epilogue=Activation.of(activation, betas),
                         tile=_fit(tier.stage1, tier.BM, inter, hidden, pairs=quantized, lds=not quantized), **common)
    reduce = tier.reduce if reduce == "auto" else reduce
    if reduce == "fused" and (direct or quantized or not bf16_out):
        reduce = "slots"
    s2 = FlyKernelConfig(shape=GemmShape(hidden, inter, top_k), epilogue=Reduction(reduce),
                         tile=_fit(tier.stage2, tier.BM, hidden, inter, lds=not quantized), **common)
    return s1, s2


def sweep_configs(arch: str, weight_format: str, *, hidden: int, inter: int, top_k: int,
                  activations: list[ActivationSpec], has_offsets: bool = False, act_dtype: str = BF16,
                  num_experts: int | None = None, table: dict | None = None) -> list[FlyKernelConfig]:
    """Every distinct config the table yields for this shape, per activation (CI compiles these);
    with `num_experts`, the direct tiers' configs too."""
    table = default_table() if table is None else table
    seen: dict[FlyKernelConfig, None] = {}
    for tier in table[check_arch(arch)]:
        n = tier.max_tokens or (table[arch][-2].max_tokens + 1 if len(table[arch]) > 1 else 1)
        for act in activations:
            for direct_experts in {None, num_experts}:
                for cfg in stage_configs(arch, weight_format, hidden=hidden, inter=inter, top_k=top_k,
                                         num_tokens=n, activation=act, has_offsets=has_offsets,
                                         act_dtype=act_dtype, direct_experts=direct_experts, table=table):
                    seen.setdefault(cfg)
    return list(seen)
