"""Tile configurations of the Triton MoE backend: tuned tables and a heuristic.

A table (JSON under configs/tables/, one file per device, written by
`kimi-k3-moe tune --packaged`, `merge_into_table`) holds one section per Triton version (major.minor) the
entries were tuned under; each maps (weight format, shape E/N/K, token tier) to a
`MoEConfig`. The running Triton's section serves. Without an entry there, the
nearest version's entry serves only after the caller's check (the backend compiles
its launches under the running Triton and refuses spills; once per config), else the
heuristic; the lookup's `source` says which. The tier rule is the only rule, for
every token count:

    tier = the smallest tuned tier >= T, or the largest tier when T exceeds all

so a tuned shape never falls to the heuristic at some token count (a token count between
two tiers, or above the last, once served an untuned config). A device without a table of its own
takes its arch's (`packaged_key`). Shapes or devices without an entry get `heuristic_config`,
which is valid for every T too. Plain Python: importing this needs no triton.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from importlib import resources
from pathlib import Path

from kimi_k3_moe.configs import user_tables
from kimi_k3_moe.configs.user_tables import (
    device_key,  # noqa: F401  (the packaged tables' file names)
    triton_version,
)
from kimi_k3_moe.kernels.triton._details.constants import (
    KOrder,  # its home (with each order's code); imported from here too
)

PATHS = ("gemv", "aligned", "direct", "split")
DECODES = ("ptx", "bits")  # ptx: inline PTX bf16x2 decode (CUDA only); bits: portable Triton code
# row blocks: a power of two, or a power-of-two main tile plus a smaller power-of-two tail tile
# (row_tiles); the kernels take both tiles on one decoded weight tile
BLOCK_MS = (16, 32, 48, 64, 96, 128, 160, 192, 256)
DIRECT_BLOCK_M = 16
TABLE_PACKAGE = "kimi_k3_moe.configs"
TABLE_DIR = "tables"
TABLE_FORMAT = 2


def row_tiles(block_m: int) -> tuple[int, int]:
    """block_m -> (main, tail) tile rows, each a power of two (tail 0 for a power-of-two block)."""
    main = 1 << (block_m.bit_length() - 1)
    return main, block_m - main


def parse_order(value, what: str = "order") -> KOrder:
    try:
        return KOrder(value)
    except ValueError:
        raise ValueError(f"{what} {value!r} not in {tuple(o.value for o in KOrder)}") from None


# what a stage config said instead of `order` in the tables of earlier releases (users' tables live on)
LEGACY_ORDER_FLAGS = ("interleave", "pairs", "stack_gate_up", "plain_inter")


def order_from_flags(what: str = "order", *, interleave: bool = True, pairs: bool = False,
                     stack_gate_up: bool = False, plain_inter: bool = False) -> KOrder:
    """The K order an earlier release's stage config meant by its LEGACY_ORDER_FLAGS (pairs won over
    interleave; stack_gate_up and plain_inter each refined pairs)."""
    if stack_gate_up or plain_inter:
        if not pairs or (stack_gate_up and plain_inter):
            raise ValueError(f"{what}: stack_gate_up and plain_inter each refine pairs (got pairs={pairs}, "
                             f"stack_gate_up={stack_gate_up}, plain_inter={plain_inter})")
        return KOrder.STACKED if stack_gate_up else KOrder.PLAIN_INTER
    if pairs:
        return KOrder.PAIRS
    return KOrder.INTERLEAVE if interleave else KOrder.WORDS


@dataclass(frozen=True)
class KernelConfig:
    """One stage's launch parameters. block_n/block_k are over that stage's N and K."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = True  # aligned path: weights as the MMA's M operand (good for few tokens per tile)
    order: KOrder = KOrder.INTERLEAVE  # aligned path: see KOrder
    # aligned stage 2: N tiles per program, K unrolled and the tile loop pipelined (its K = I is a few
    # steps only, so per-tile loads would otherwise start from an empty pipeline at every tile)
    n_tiles: int = 1
    k_split: int = 1  # stage 1 of paths split, direct: K parts per (pair, N tile) (_details/split_kernels.py)

    def __post_init__(self):
        if not isinstance(self.order, KOrder):  # "pairs" and KOrder.PAIRS: one config
            object.__setattr__(self, "order", parse_order(self.order))

    def validate(self, k: int, what: str, min_block_n: int = 16) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"{what}.{name} = {v} must be a power of two")
        if self.block_n < min_block_n:
            raise ValueError(f"{what}.block_n = {self.block_n} must be >= {min_block_n}")
        if self.block_k < 32 or k % self.block_k:
            raise ValueError(f"{what}.block_k = {self.block_k} must be >= 32 and divide K = {k}")
        if self.num_stages < 1:
            raise ValueError(f"{what}.num_stages = {self.num_stages} must be >= 1")
        if self.n_tiles < 1:
            raise ValueError(f"{what}.n_tiles = {self.n_tiles} must be >= 1")
        if self.k_split < 1 or k % (self.k_split * self.block_k):
            raise ValueError(f"{what}.k_split = {self.k_split}: K = {k} must split into whole block_k steps")
        if why := self.order.misfit(self.block_k, self.n_tiles):
            raise ValueError(f"{what}: {why}")

    def to_json(self) -> dict:
        d = {**asdict(self), "order": self.order.value}
        return d if self.k_split > 1 else {k: v for k, v in d.items() if k != "k_split"}

    @classmethod
    def from_json(cls, d: dict, what: str = "stage") -> KernelConfig:
        """Also reads the form of earlier releases (LEGACY_ORDER_FLAGS instead of `order`)."""
        d = dict(d)
        if d.pop("ws", False):
            raise ValueError(f"{what}.ws: {WS_REMOVED}")
        flags = {name: bool(d.pop(name)) for name in LEGACY_ORDER_FLAGS if name in d}
        if flags and "order" in d:
            raise ValueError(f"{what}: both order and {', '.join(flags)}")
        order = order_from_flags(what, **flags) if flags else parse_order(d.pop("order", KOrder.INTERLEAVE),
                                                                          f"{what}.order")
        return cls(**d, order=order)


@dataclass(frozen=True)
class MoEConfig:
    """How the whole MoE runs for one token tier.

    path "gemv": no token alignment; one program per (token, slot) x N tile in
    stage 1 and per token x N tile (looping over its slots) in stage 2.
    path "aligned": (token, slot) pairs grouped by expert into blocks of
    `block_m` rows; both stages are tiled matmuls over those blocks. Stage 2
    takes blocks of its own when `stage2_block_m` is set (a second alignment:
    four more small launches).
    path "direct": the aligned path's matmuls with every pair a block of its
    own (block_m 16: one row and padding), so nothing is launched to group the
    pairs; for a few tokens, whose pairs nearly all have an expert to themselves.
    path "split": a tensor-core stage 1 over K in stage1.k_split parts, gemv's stage 2.
    """

    path: str = "aligned"
    block_m: int = 16
    stage1: KernelConfig = field(default_factory=KernelConfig)
    stage2: KernelConfig = field(default_factory=KernelConfig)
    decode: str = "bits"
    stage2_block_m: int | None = None
    # every launch after the first is a programmatic dependent of the one before it (griddepcontrol,
    # NVIDIA sm_90+): its programs start while that one drains and wait for its output there (the
    # GEMV stages request their first weights before waiting). A small batch's launches are short,
    # so each drain and start-up was a visible part of the whole
    pdl: bool = False

    def __post_init__(self):
        if self.stage2_block_m == self.block_m:  # one config, one JSON form: "its own blocks" = the same blocks
            object.__setattr__(self, "stage2_block_m", None)

    @property
    def block_ms(self) -> tuple[int, int]:
        """(stage 1's, stage 2's) row blocks."""
        return self.block_m, self.stage2_block_m or self.block_m

    def validate(self, hidden: int, inter: int) -> MoEConfig:
        if self.path not in PATHS:
            raise ValueError(f"path {self.path!r} not in {PATHS}")
        if self.decode not in DECODES:
            raise ValueError(f"decode {self.decode!r} not in {DECODES}")
        if self.path == "aligned":
            self._validate_row_blocks()
        elif self.stage2_block_m is not None:
            raise ValueError(f"stage2_block_m: the {self.path} path has no row blocks of its own")
        if self.path == "direct" and self.block_m != DIRECT_BLOCK_M:
            raise ValueError(f"block_m {self.block_m}: the direct path's blocks are one pair in "
                             f"{DIRECT_BLOCK_M} rows (the MMA's least)")
        min_n = 16 if self.path in ("aligned", "direct") else 2  # tl.dot needs 16; the FMA path does not
        self.stage1.validate(hidden, "stage1", 8 if self.path == "split" else min_n)  # 2 x 8 stacked rows
        self.stage2.validate(inter, "stage2", min_n)
        if self.stage2.k_split != 1 or (self.stage1.k_split != 1 and self.path not in ("split", "direct")):
            raise ValueError("k_split: only stage 1 of paths split and direct splits K")
        for n, stage in ((1, self.stage1), (2, self.stage2)):
            if why := stage.order.misfit(stage.block_k, stage.n_tiles, n):
                raise ValueError(f"stage{n}: {why}")
        if self.stage1.n_tiles != 1 or (self.path in ("gemv", "split") and self.stage2.n_tiles != 1):
            raise ValueError("n_tiles: only the aligned stage 2 takes several N tiles per program")
        return self

    def _validate_row_blocks(self) -> None:
        for bm, stage, name in ((self.block_m, self.stage1, "block_m"),
                                (self.block_ms[1], self.stage2, "stage2_block_m")):
            if bm not in BLOCK_MS:
                raise ValueError(f"{name} {bm} not in {BLOCK_MS}")
            if row_tiles(bm)[1]:
                # the tail tile is a second MMA on the same weights: tokens must be the MMA's N side
                if not stage.swap:
                    raise ValueError(f"{name} {bm} (a main and a tail tile) needs that stage's swap")

    def to_json(self) -> dict:
        d = {**asdict(self), "stage1": self.stage1.to_json(), "stage2": self.stage2.to_json()}
        if self.stage2_block_m is None:
            del d["stage2_block_m"]
        if not self.pdl:
            del d["pdl"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> MoEConfig:
        s2_bm = d.get("stage2_block_m")
        if d["path"] == "ws":
            raise ValueError(f"path 'ws': {WS_REMOVED}")
        return cls(path=d["path"], block_m=int(d.get("block_m", 16)), decode=d.get("decode", "bits"),
                   stage1=KernelConfig.from_json(d["stage1"], "stage1"),
                   stage2=KernelConfig.from_json(d["stage2"], "stage2"),
                   stage2_block_m=None if s2_bm is None else int(s2_bm), pdl=bool(d.get("pdl", False)))

    def for_target(self, is_cuda: bool, has_pdl: bool = True) -> MoEConfig:
        """The PTX decode exists on NVIDIA only; elsewhere the portable decode. Programmatic
        dependent launch needs NVIDIA sm_90+ (`has_pdl`, the backend knows the arch)."""
        cfg = self if is_cuda or self.decode == "bits" else replace(self, decode="bits")
        return cfg if cfg.pdl is False or (is_cuda and has_pdl) else replace(cfg, pdl=False)


# what reading a config of the releases that had warp-specialised stages says of one that used them
WS_REMOVED = ("the warp-specialised kernels were removed (slower than the aligned ones on the H200 and H100, "
              "docs/TRITON.md); run `kimi-k3-moe tune` again")


@dataclass(frozen=True)
class Lookup:
    config: MoEConfig
    source: str  # "table <file> tier <t>" or "heuristic"


def shape_key(weight_format: str, num_experts: int, n: int, k: int) -> str:
    """Table key of a layer: weight format and stage-1 shape (E experts, N = 2I, K = H)."""
    return f"{weight_format}/E{num_experts}_N{n}_K{k}"


def parse_shape_key(key: str) -> tuple[str, int, int, int]:
    """`shape_key`'s inverse: 'mxfp4/E896_N768_K3584' -> ('mxfp4', 896, 768, 3584)."""
    weight_format, shape = key.split("/")
    e, n, k = (int(x[1:]) for x in shape.split("_"))
    return weight_format, e, n, k


def table_path(dev_key: str) -> Path:
    return Path(str(resources.files(TABLE_PACKAGE).joinpath(TABLE_DIR, f"triton_{dev_key}.json")))


# a GPU without a packaged table of its own takes its arch's: the H100, H800 and GH200 carry the H200's
# GH100 die, and on an H100 the H200's entries ran 1.6-3.9x faster than the heuristic from 16 tokens up
# (docs/PERF.md)
ARCH_TABLES = {"sm_90": "nvidia_h200"}


def packaged_key(dev_key: str, arch: str | None) -> str | None:
    """The packaged table that serves a device: its own, else its arch's (ARCH_TABLES), else none."""
    return dev_key if table_path(dev_key).is_file() else ARCH_TABLES.get(arch)


def _arch_note(served: str, dev_key: str, arch: str | None, who: str) -> str:
    """What a source line adds when `served` is not the device's own table but its arch's."""
    return "" if served == dev_key else f" (the {arch} table; none for {who})"


@cache
def load_table(dev_key: str) -> dict | None:
    path = table_path(dev_key)
    if not path.is_file():
        return None
    with open(path) as f:
        table = json.load(f)
    check_table(table, str(path))
    return table


def check_table(table: dict, what: str) -> None:
    if table.get("format_version") != TABLE_FORMAT:
        raise ValueError(f"{what}: unsupported format_version {table.get('format_version')!r}")
    tritons = table.get("tritons")
    if not isinstance(tritons, dict) or not tritons:
        raise ValueError(f"{what}: no 'tritons' sections (Triton major.minor -> tuned entries)")
    for version, section in tritons.items():
        if not _version_tuple(version) or not isinstance(section.get("entries"), dict):
            raise ValueError(f"{what}: section {version!r} must be a Triton major.minor holding 'entries'")


def merge_into_table(path: Path, version: str, key: str, entry: dict, *, tuned_with: dict,
                     header: dict) -> None:
    """The packaged tables' one writer (`kimi-k3-moe tune --packaged`): `entry`'s tiers replace the same
    tiers of `key` in the section of Triton `version`; that entry's other tiers, the section's other
    entries and the other sections stay. A tier left out would otherwise be served by its nearest
    neighbour's config. A tier the run did not tune (`tuned: false`: its budget ran out) fills a gap
    only: it never replaces a config already there. `header` starts a new file; the result is
    checked before it replaces the old."""
    path = Path(path)
    table = json.loads(path.read_text()) if path.is_file() else {**header, "format_version": TABLE_FORMAT,
                                                                    "tritons": {}}
    section = table["tritons"].setdefault(version, {"entries": {}})
    section["tuned_with"] = tuned_with
    old = section["entries"].get(key, {}).get("tiers", {})
    new = {t: cfg for t, cfg in entry["tiers"].items() if cfg.get("tuned", True) or t not in old}
    section["entries"][key] = {**entry, "tiers": dict(sorted({**old, **new}.items(), key=lambda kv: int(kv[0])))}
    section["tiers"] = sorted({t for e in section["entries"].values() for t in tiers_of(e)})
    check_table(table, str(path))
    for e in section["entries"].values():
        for cfg in e["tiers"].values():
            MoEConfig.from_json(cfg)  # a bad config fails here, not at a user's lookup
    user_tables.replace_file(path, json.dumps(table, indent=1, default=str) + "\n")
    load_table.cache_clear()


def _version_tuple(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def versions_nearest_first(table: dict, running: str) -> list[str]:
    """The table's Triton versions: the running one first, then by distance (the newer on a tie)."""
    want = _version_tuple(running) or (0, 0)

    def distance(v):
        major, minor = _version_tuple(v)
        return abs((major - want[0]) * 1000 + minor - want[1]), -major, -minor
    return sorted(table.get("tritons", {}), key=distance)


def tiers_of(entry: dict) -> list[int]:
    return sorted(int(t) for t in entry["tiers"])


def _check_user_entry(key: str, entry: dict) -> None:
    _, _, n, k = parse_shape_key(key)
    for cfg in entry["tiers"].values():
        MoEConfig.from_json(cfg).validate(k, n // 2)


def _user_tiers(entry: dict) -> list[int]:
    """`tiers_of` for an entry read from a user's file, which may hold anything: [] when malformed."""
    return tiers_of(entry) if isinstance(entry, dict) and isinstance(entry.get("tiers"), dict) else []


def describe_packaged(identity: dict) -> str:
    """Which section of this device's packaged table serves under the running Triton (doctor, the log)."""
    key = packaged_key(identity["key"], identity.get("arch"))
    if key is None:
        return f"none for {identity['name']}: the heuristic serves"
    table = load_table(key)
    which = key + _arch_note(key, identity["key"], identity.get("arch"), identity["name"])
    running = identity.get("triton") or triton_version()
    versions = versions_nearest_first(table, running)
    if running in table["tritons"]:
        return f"{which}: Triton {running}'s entries serve (sections {', '.join(sorted(versions))})"
    return (f"{which}: no entries for Triton {running}; Triton {versions[0]}'s serve where they compile "
            f"without spills under {running}, else the heuristic")


# what `kimi-k3-moe tune` writes for this backend (configs/user_tables.py reads and checks it)
USER_TABLE = user_tables.TableKind("triton", _user_tiers, _check_user_entry, describe_packaged)


def _user_entry(dev_key: str, weight_format: str, num_experts: int, n: int, k: int):
    """((key, entry), origin) of a user table for exactly this shape on this device, else None."""
    identity = user_tables.device_identity()
    if identity["key"] != dev_key:
        return None
    key = shape_key(weight_format, num_experts, n, k)
    found = user_tables.entry(USER_TABLE, key, identity)
    return None if found is None else ((key, found[0]), found[1])


def pick_tier(tiers: list[int], num_tokens: int) -> int:
    """The smallest tier >= num_tokens, else the largest (one rule, no edge exceptions)."""
    if not tiers:
        raise ValueError("a table entry without tiers")
    for t in tiers:
        if num_tokens <= t:
            return t
    return tiers[-1]


def find_entry(entries: dict, weight_format: str, num_experts: int, n: int, k: int) -> tuple[str, dict] | None:
    """Exact shape first; else the same (N, K) tuned with another expert count (EP slices)."""
    key = shape_key(weight_format, num_experts, n, k)
    if key in entries:
        return key, entries[key]
    suffix = f"_N{n}_K{k}"
    same_nk = sorted(name for name in entries if name.startswith(f"{weight_format}/") and name.endswith(suffix))
    if same_nk:
        return same_nk[0], entries[same_nk[0]]
    return None


def find_versioned(table: dict, running: str, weight_format: str, num_experts: int, n: int,
                   k: int) -> tuple[str, str, dict] | None:
    """(Triton version, key, entry): the running version's section first, then the nearest that has the shape."""
    for version in versions_nearest_first(table, running):
        found = find_entry(table["tritons"][version]["entries"], weight_format, num_experts, n, k)
        if found is not None:
            return (version, *found)
    return None


# verify(config, weight_format, num_experts, hidden, inter, tier) -> None when the config compiles under the running
# Triton without spills, else why not (the backend's check; lookups without one serve foreign entries unchecked)
Verify = Callable[[MoEConfig, str, int, int, int, int], "str | None"]


def lookup(dev_key: str, weight_format: str, num_experts: int, hidden: int, inter: int, num_tokens: int,
           *, is_cuda: bool, table: dict | None = None, triton: str | None = None,
           verify: Verify | None = None, arch: str | None = None, user_table: bool = True) -> Lookup:
    """The config for `num_tokens` tokens; valid for every num_tokens >= 0. `triton`: the running
    Triton's major.minor (default: this process's). Without `table`, the device's packaged table or
    its `arch`'s (packaged_key); `user_table=False` leaves out the user's (what the package alone serves)."""
    running = triton_version() if triton is None else triton
    # a valid user table (kimi-k3-moe tune, under this Triton) for exactly this device and shape comes first
    user = _user_entry(dev_key, weight_format, num_experts, 2 * inter, hidden) if table is None and user_table else None
    if user is not None:
        (key, entry), _ = user
        tier = None
        try:  # a user's file is data: one it validated but that cannot serve this call is refused, not raised
            tier = pick_tier(tiers_of(entry), num_tokens)
            MoEConfig.from_json(entry["tiers"][str(tier)]).for_target(is_cuda).validate(hidden, inter)
        except user_tables.DATA_ERRORS as exc:
            user_tables.refused(user_tables.load(USER_TABLE)[1], f"entry {key} tier {tier} cannot serve "
                                f"H={hidden}, I={inter}: {exc}")
            user = None
    version = running
    if user is not None:
        found, origin = user
    else:
        served = dev_key
        if table is None:
            served = packaged_key(dev_key, arch)
            table = None if served is None else load_table(served)
        hit = None if table is None else find_versioned(table, running, weight_format, num_experts, 2 * inter, hidden)
        found = None if hit is None else hit[1:]
        version = running if hit is None else hit[0]
        origin = f"table {served} triton {version}" + _arch_note(served, dev_key, arch, dev_key)
    if found is None:
        return Lookup(heuristic_config(hidden, inter, num_tokens, is_cuda=is_cuda), "heuristic")
    key, entry = found
    tier = pick_tier(tiers_of(entry), num_tokens)
    cfg = MoEConfig.from_json(entry["tiers"][str(tier)]).for_target(is_cuda)
    try:
        cfg.validate(hidden, inter)
    except ValueError as exc:
        raise ValueError(f"tuned config {dev_key} {key} tier {tier} is invalid for "
                         f"H={hidden}, I={inter}: {exc}") from exc
    source = f"{origin} {key} tier {tier}"
    if version == running:
        return Lookup(cfg, source)
    if verify is None:
        return Lookup(cfg, f"{source} (tuned under Triton {version}; not checked under Triton {running})")
    why = verify(cfg, weight_format, num_experts, hidden, inter, tier)
    if why:
        return Lookup(heuristic_config(hidden, inter, num_tokens, is_cuda=is_cuda),
                      f"heuristic ({source}, tuned under Triton {version}: {why} under Triton {running})")
    return Lookup(cfg, f"{source} (tuned under Triton {version}; compiled without spills under Triton {running})")


def _fit_block_k(k: int, want: int) -> int:
    bk = min(want, k)
    bk = 1 << (bk.bit_length() - 1)
    while bk > 32 and k % bk:
        bk //= 2
    return bk


def heuristic_config(hidden: int, inter: int, num_tokens: int, *, is_cuda: bool) -> MoEConfig:
    """A reasonable config for untuned devices and shapes; valid for any token count."""
    decode = "ptx" if is_cuda else "bits"
    stages = 3 if is_cuda else 2
    if num_tokens <= 8:
        cfg = MoEConfig(
            path="gemv", block_m=16, decode=decode,
            stage1=KernelConfig(block_n=16, block_k=_fit_block_k(hidden, 512), num_warps=4, num_stages=stages),
            stage2=KernelConfig(block_n=8, block_k=_fit_block_k(inter, 64), num_warps=4, num_stages=stages))
    else:
        block_m = 16 if num_tokens <= 64 else 32 if num_tokens <= 512 else 64 if num_tokens <= 2048 else 128
        swap = block_m <= 64
        warps = 4 if block_m <= 32 else 8
        # gfx942 has 64 KB of LDS per workgroup: 128-row activation tiles get K steps of 64 there
        bk = 64 if not is_cuda and block_m >= 128 else 128
        cfg = MoEConfig(
            path="aligned", block_m=block_m, decode=decode,
            stage1=KernelConfig(block_n=64, block_k=_fit_block_k(hidden, bk), num_warps=warps,
                                num_stages=stages, swap=swap),
            stage2=KernelConfig(block_n=64 if block_m <= 32 else 128, block_k=_fit_block_k(inter, bk),
                                num_warps=warps, num_stages=stages, swap=swap))
    return cfg.validate(hidden, inter)
