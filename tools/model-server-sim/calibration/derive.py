#!/usr/bin/env python3
"""Recompute the simulated server's constants from the calibration files next to this script.

Prints a, b, c (StepCost::LLAMA3_8B_H100) and the KV capacity with each input it uses, so that
tools/model-server-sim/README.md ("Calibration") can be checked against the files. Standard
library only.
"""

import csv
from pathlib import Path

HERE = Path(__file__).resolve().parent


def vidur(gpu: str, model: str, tokens: int) -> float:
    with open(HERE / "vidur_derived_nonattention_forward_ms.csv", newline="") as f:
        for row in csv.DictReader(f):
            if (row["gpu"], row["model"], row["tensor_parallel"], row["num_tokens"]) == (gpu, model, "1", str(tokens)):
                return float(row["forward_nonattn_ms_est"])
    raise SystemExit(f"no Vidur row for {gpu} {model} {tokens}")


def musgrave_itl_ms() -> float:
    with open(HERE / "published_latency_points.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["source"] == "johnmusgrave_blog" and row["concurrency"] == "1":
                return float(row["itl_ms"].lstrip("~"))
    raise SystemExit("no johnmusgrave_blog row")


def main() -> None:
    # a: one token through Llama-3-8B on H100 (non-attention), plus per-step overhead.
    h100_7b_1 = vidur("h100", "Llama-2-7b-hf", 1)
    ratio_1 = vidur("a100", "Meta-Llama-3-8B", 1) / vidur("a100", "Llama-2-7b-hf", 1)
    forward_1 = h100_7b_1 * ratio_1
    overhead_a100 = musgrave_itl_ms() - vidur("a100", "Meta-Llama-3-8B", 1)
    # A100 HBM 1.6-2.0 TB/s against H100 3.35 TB/s: the upper end (2.0 / 3.35), since part of the
    # overhead is CPU-side and does not shrink with a faster GPU.
    overhead_h100 = overhead_a100 * 2.0 / 3.35
    a = forward_1 + overhead_h100
    print(f"a: Vidur H100 Llama-2-7B 1 token {h100_7b_1} ms x (Llama-3-8B / Llama-2-7B on A100 = {ratio_1:.3f})"
          f" = {forward_1:.2f} ms; + overhead {overhead_a100:.1f} ms on A100 (ITL {musgrave_itl_ms()} ms - Vidur"
          f" {vidur('a100', 'Meta-Llama-3-8B', 1)} ms) scaled by bandwidth = {overhead_h100:.2f} ms"
          f" -> a = {a:.2f} ms (model: 8.0)")
    # b: per prompt token, from the 4096-token forward.
    h100_7b_4096 = vidur("h100", "Llama-2-7b-hf", 4096)
    ratio_4096 = vidur("a100", "Meta-Llama-3-8B", 4096) / vidur("a100", "Llama-2-7b-hf", 4096)
    per_token = (h100_7b_4096 * ratio_4096 - forward_1) / 4095
    b = per_token * 1.10
    print(f"b: Vidur H100 Llama-2-7B 4096 tokens {h100_7b_4096} ms x {ratio_4096:.3f} = {h100_7b_4096 * ratio_4096:.1f} ms;"
          f" ({h100_7b_4096 * ratio_4096:.1f} - {forward_1:.2f}) / 4095 = {per_token:.4f} ms/token; +10 % attention"
          f" -> b = {b:.4f} ms (model: 0.022)")
    # c: KV read per context token in decode.
    kv_bytes = 32 * 8 * 128 * 2 * 2
    c = kv_bytes / 3.35e12 * 1e3
    print(f"c: {kv_bytes} bytes of KV per token (32 layers x 8 KV heads x 128 x K,V x bf16) / 3.35 TB/s"
          f" -> c = {c:.3g} ms (model: 3.91e-05)")
    # KV capacity (LATENCY_NOTES.md section 4).
    free_gb = 80 * 0.9 - 16.1 - 3.0
    tokens = free_gb * 1e9 / kv_bytes
    print(f"KV: 80 GB x 0.9 - 16.1 GB weights - ~3 GB activations = {free_gb:.1f} GB / {kv_bytes} B ="
          f" {tokens / 1e3:.0f}k tokens -> 25,000 blocks of 16 = 400k (model)")


if __name__ == "__main__":
    main()
