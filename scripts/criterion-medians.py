#!/usr/bin/env python3
"""Prints the median of every criterion benchmark under target/criterion (after `cargo bench`)."""
import json
import pathlib

root = pathlib.Path(__file__).resolve().parent.parent / "target" / "criterion"
for est in sorted(root.glob("**/new/estimates.json")):
    bench = est.parent.parent.relative_to(root)
    median_ns = json.loads(est.read_text())["median"]["point_estimate"]
    shown = f"{median_ns / 1000:.2f} µs" if median_ns >= 1000 else f"{median_ns:.0f} ns"
    print(f"{str(bench):<60} median {shown}")
