"""Human-readable tables (rich) for memory reports and evaluation results."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def print_memory_report(rep: dict, title: str = "KV cache memory", per_layer: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for col in ("held", "uncompressed", "ratio", "bits/elem", "payload", "metadata", "windows", "tokens held/seen"):
        t.add_column(col, justify="right")
    t.add_row(
        fmt_bytes(rep["held_bytes"]),
        fmt_bytes(rep["uncompressed_bytes"]),
        f"{rep['compression_ratio']:.2f}x",
        f"{rep['bits_per_element']:.2f}",
        fmt_bytes(rep["payload_bytes"]),
        fmt_bytes(rep["metadata_bytes"]),
        fmt_bytes(rep["window_bytes"]),
        f"{rep['tokens_held']}/{rep['tokens_seen']}",
    )
    console = Console()
    console.print(t)
    if per_layer:
        lt = Table(title="per layer")
        for col in ("layer", "payload", "metadata", "windows", "held", "tokens"):
            lt.add_column(col, justify="right")
        for m in rep["layers"]:
            lt.add_row(str(m["layer"]), fmt_bytes(m["payload_bytes"]), fmt_bytes(m["metadata_bytes"]),
                       fmt_bytes(m["window_bytes"]), fmt_bytes(m["held_bytes"]), str(m["tokens_held"]))
        console.print(lt)
