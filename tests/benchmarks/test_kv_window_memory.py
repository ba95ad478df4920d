"""benchmarks/kv_window_memory.py counts what the engine's block tables hold: a window group stays
at ceil((w-1)/16)+1 blocks while decoding, global groups grow with the context."""

from __future__ import annotations

from kv_window_memory import measure, report

from kvserve.paging.kv_sizing import ModelShape


def test_a_1k_window_model_holds_a_window_of_blocks_at_10k_tokens():
    shape = ModelShape("w1k", num_layers=8, num_heads=8, num_kv_heads=8, head_dim=128, sliding_window=1024,
                       num_window_layers=7)
    rows = measure(shape, 10240, 512, 512, 2)
    decoding = [row for row in rows if row["decoding"] and row["tokens"] >= 1024]
    assert {row["window_group_blocks"] for row in decoding} == {64, 65}
    last = rows[-1]
    page = 2 * 8 * 128 * 2 * 16  # one layer's block
    assert last["global_bytes"] == 640 * page and last["window_bytes"] in (7 * 64 * page, 7 * 65 * page)
    assert "max 65 (cap 65)" in "\n".join(report(shape, rows, 2))
