"""The Nsight Compute bound table (gt_fused3s/bench/ncu_bounds.py) on the
CPU: ncu's raw CSV parsed, kernels named, the dominant unit, bound and
distance computed; the readings themselves come from the GPU machine."""
from __future__ import annotations

import math

from gt_fused3s.bench import ncu_bounds

RAW = '''==PROF== Connected to process 1
"ID","Kernel Name","gpu__time_duration.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed","lts__throughput.avg.pct_of_peak_sustained_elapsed","l1tex__throughput.avg.pct_of_peak_sustained_active","sm__throughput.avg.pct_of_peak_sustained_elapsed","dram__bytes.sum"
"","","nsecond","%","%","%","%","byte"
"0","void gt_fused3s::fused3s_fwd_kernel<__half, 128, 0>(gt_fused3s::Fused3SParams)","2,000","25.5","40","62.5","30","1,000,000,000"
"1","void gt_fused3s::fused3s_bwd_kernel<__half, 128, false, 0>(gt_fused3s::Fused3SBwdParams)","4000","80","20","10","50","n/a"
"2","void gt_fused3s::fused3s_bwd_kernel<__half, (int)128, (bool)1, (int)0>(gt_fused3s::Fused3SBwdParams)","1000","1","2","3","4","0"
==PROF== Disconnected from process 1
'''


def test_parse_and_bound():
    rows = [ncu_bounds.bound_row(r) for r in ncu_bounds.parse_raw_csv(RAW)]
    assert [r["kernel"] for r in rows] == ["fwd", "bwd_dq", "bwd_dkdv"]
    fwd, dq, dkdv = rows
    assert fwd["time_ms"] == 0.002 and fwd["bound_unit"] == "l1" and fwd["l1_pct"] == 62.5
    assert math.isclose(fwd["bound_ms"], 0.002 * 0.625) and math.isclose(fwd["distance"], 1.6)
    assert fwd["dram_gb"] == 1.0 and math.isnan(fwd["tensor_pct"])     # a unit ncu did not report
    assert dq["bound_unit"] == "dram" and math.isclose(dq["distance"], 1.25) and math.isnan(dq["dram_gb"])
    assert dkdv["bound_unit"] == "sm" and math.isclose(dkdv["distance"], 25.0)


def test_dram_share_from_bytes_where_ncu_gave_none():
    raw = ncu_bounds.parse_raw_csv(RAW)[0]
    del raw["dram__throughput.avg.pct_of_peak_sustained_elapsed"]
    row = ncu_bounds.bound_row(raw, dram_peak=1e12)          # 1 GB in 2 us: 500 TB/s, 50000% of 1 TB/s
    assert math.isclose(row["dram_pct"], 50000) and row["bound_unit"] == "dram"
    assert math.isnan(ncu_bounds.bound_row(raw)["dram_pct"])  # no peak known: no share


def test_table_marks_missing_units():
    rows = [{"graph": "g", "setting": "s", **ncu_bounds.bound_row(r)} for r in ncu_bounds.parse_raw_csv(RAW)]
    table = ncu_bounds.format_table(rows)
    assert table.count("\n") == 4 and "| g | s | fwd | 0.002 | 26 | 40 | 62 | 30 | - | l1 | 0.001 | 1.60x |" in table


def test_run_without_ncu_says_so(capsys):
    assert ncu_bounds.main(["run", "--ncu", "/nonexistent/ncu"]) == 2
    assert "no Nsight Compute here" in capsys.readouterr().err
