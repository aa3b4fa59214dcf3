"""The bench's outputs: a rich table for the terminal and a JSON file a user can send us."""
from __future__ import annotations

import json
from pathlib import Path

COLUMNS = ("tokens", "row", "time us", "x floor", "x best other", "rel L2", "note")


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table_rows(result: dict) -> list[tuple[str, ...]]:
    """One line per (token count, entry): the figures, or why there are none."""
    entries = result["entries"]
    out = []
    for row in result["rows"]:
        out.append((str(row["tokens"]), "floor", _fmt(row["floor_us"], ".1f"), "1.00", "-", "-",
                    "compute" if row["floor_compute_us"] > row["floor_bw_us"] else "bandwidth"))
        for name in entries:
            res = row["results"].get(name)
            if res is None:  # not available here: said once, under the table
                continue
            note = res.get("why", "") if res.get("status") != "ok" else res.get("config", "")
            if res.get("route_us") is not None:
                note = (note + "; " if note else "") + f"routing/align {res['route_us']:.1f} us not included"
            time = _fmt(res.get("median_us"), ".1f") if res.get("status") == "ok" else res.get("status", "?").upper()
            out.append((str(row["tokens"]), name, time, _fmt(res.get("x_floor"), ".2f"),
                        _fmt(res.get("x_best_other"), ".2f"), _fmt(res.get("rel_l2"), ".1e"), note))
    return out


def render(result: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log or a pipe: wide enough that rows stay one line
            console = Console(width=160)
    info = result.get("info", {})
    dev = info.get("device", {})
    sh = result["shape"]
    title = (f"Kimi-K3 MoE {sh['name']} (H {sh['hidden']}, I {sh['inter']}, E {sh['num_experts']}, top-{sh['topk']}) "
             f"on {dev.get('name', '?')} [{dev.get('arch', '?')}, {dev.get('driver', '?')}]")
    table = Table(title=title, caption=f"{result['timing']}; {result['activation']}; copy "
                  f"{result['ceilings']['copy_GBps']:.0f} GB/s, bf16 {result['ceilings']['bf16_TFLOPs']:.0f} "
                  f"TFLOP/s (this run); checked to rel L2 <= {result['bound_rel_l2']:.0e} before timing")
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("row", "note") else "right")
    for line in table_rows(result):
        table.add_row(*line)
    console.print(table)
    for name, meta in result["entries"].items():
        console.print(f"  {name}: {meta['label']}: {meta['found']}" +
                      "".join(f"; {n}" for n in meta.get("notes", [])))


def require_writable(path) -> Path:
    """`--json PATH` checked before any GPU work (a run must not end unable to save what it timed):
    its folder created as write_json would, the file opened for appending; else ValueError naming it."""
    path = Path(path)
    existed = path.exists()
    nearest = next((p for p in path.parents if p.exists()), None)
    if nearest is not None and not nearest.is_dir():  # mkdir would only say "File exists"
        raise ValueError(f"--json {path} cannot be written: {nearest} is a file, not a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
    except OSError as exc:
        raise ValueError(f"--json {path} cannot be written: {exc.strerror or exc}") from None
    if not existed:
        path.unlink()  # leave nothing behind if the run stops before its first row
    return path


def write_json(path, result: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    return path


def row_line(row: dict) -> str:
    """A compact one-line summary of a finished row (progress output)."""
    parts = [f"{row['tokens']} tokens: floor {row['floor_us']:.1f}"]
    for name, res in row["results"].items():
        if res.get("status") == "ok":
            parts.append(f"{name} {res['median_us']:.1f} us ({res['rel_l2']:.1e})")
        else:
            parts.append(f"{name} {res.get('status', '?').upper()} ({res.get('why', '')[:80]})")
    return "; ".join(parts)
