"""Where the limit is: Nsight Compute (``ncu``) readings of the fused
kernels turned into a bound. The work behind ``scripts/ncu_bounds.py``.

For each graph and setting, one process runs the fused attention's forward
and backward under ``ncu`` (``target``: a warm-up call, then one profiled
forward + backward between ``cudaProfilerStart`` / ``Stop``), which reads,
per kernel (forward, the backward's dQ pass and its dK/dV pass), its
duration and the achieved share of peak of each unit over the kernel's
elapsed cycles: DRAM, L2 (``lts``), L1 / shared (``l1tex``), the SMs'
issue (``sm__throughput``) and, where the sections report it, the tensor
pipe. A unit at share ``f`` of its peak for ``T`` would need ``f T`` at
peak: the kernel cannot run faster than the largest of those, the bound
``max_u f_u T``, which names the dominant unit; the distance from it is
``T / bound = 1 / max_u f_u``.

Clocks are left as they run (``--clock-control none``), as in the timing
benchmarks; ``ncu`` replays each kernel (restoring the memory it writes),
so a reading costs about a second per kernel.
"""
from __future__ import annotations

import csv
import io
import math
import os
import shutil
import subprocess
import sys

#: the sections read (known names: an unknown metric would fail the whole run)
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis")
#: bytes moved, read beside the sections where the GPU knows them
EXTRA_METRICS = ("dram__bytes.sum", "lts__t_bytes.sum")
#: unit -> the metric of its achieved share of peak (percent, over elapsed
#: cycles where there is one); the tensor pipe's name varies by GPU and ncu
UNITS = {
    "dram": ("dram__throughput.avg.pct_of_peak_sustained_elapsed",
             "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    "l2": ("lts__throughput.avg.pct_of_peak_sustained_elapsed",),
    "l1": ("l1tex__throughput.avg.pct_of_peak_sustained_elapsed",
           "l1tex__throughput.avg.pct_of_peak_sustained_active"),
    "sm": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "tensor": ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
               "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
               "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active",
               "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
               "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
}
#: DRAM peak (bytes/s) by device name, for a DRAM share computed from the
#: bytes moved where ncu's raw page has no DRAM throughput (ncu 2025.3.1 on
#: an H100 had none under the names above; its dram__bytes.sum was there)
DRAM_PEAK = {"NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H200": 4.8e12}
DEFAULT_GRAPHS = ("github", "peptides", "powerlaw200k")
DEFAULT_SETTINGS = ("d128h1fp16", "d64h8bf16")
COLUMNS = ["graph", "N", "E", "setting", "kernel", "time_ms", "dram_pct", "l2_pct", "l1_pct", "sm_pct",
           "tensor_pct", "bound_unit", "bound_ms", "distance", "dram_gb", "l2_gb", "gpu", "git"]


def kernel_label(name: str) -> str:
    """fwd / bwd_dq / bwd_dkdv / the name, from a fused kernel's demangled name
    (``fused3s_bwd_kernel<T, D, kDKV, kEdges>``: kDKV true is the dK/dV pass)."""
    if "fused3s_fwd_kernel" in name:
        return "fwd"
    if "fused3s_bwd_kernel" in name:     # ncu may print the bool as true or (bool)1
        args = name.split("<", 1)[1].split(",") if "<" in name else []
        return "bwd_dkdv" if len(args) > 2 and args[2].strip().endswith(("true", "1")) else "bwd_dq"
    return name.split("(")[0].split("<")[0].rsplit("::", 1)[-1]


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return math.nan


def parse_raw_csv(text: str) -> list[dict]:
    """The kernel rows of ``ncu --csv --page raw`` output: {column: text}
    (the first data line after the header holds the units: dropped)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]   # ncu's own notes are not quoted
    if not lines:
        return []
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    return [r for r in rows if r.get("ID", "").strip().isdigit()]


def _pct(row: dict, unit: str) -> float:
    for name in UNITS[unit]:
        if name in row:
            value = _number(row[name])
            if not math.isnan(value):
                return value
    return math.nan


def with_bound(row: dict, dram_peak: float | None = None) -> dict:
    """``row`` (time_ms, <unit>_pct, dram_gb) with the DRAM share filled in
    from the bytes moved where ncu gave none (``dram_peak`` bytes/s), and the
    dominant unit, the bound and the distance from it."""
    row = dict(row)
    if math.isnan(row.get("dram_pct", math.nan)) and dram_peak and row.get("time_ms", 0) > 0:
        row["dram_pct"] = 100 * row.get("dram_gb", math.nan) * 1e9 / (row["time_ms"] * 1e-3) / dram_peak
    known = {u: row[f"{u}_pct"] for u in UNITS if not math.isnan(row.get(f"{u}_pct", math.nan))}
    unit = max(known, key=known.get) if known else ""
    top = known.get(unit, math.nan)
    row.update(bound_unit=unit, bound_ms=row["time_ms"] * top / 100 if top == top else math.nan,
               distance=100 / top if top and top == top else math.nan)
    return row


def bound_row(raw: dict, dram_peak: float | None = None) -> dict:
    """A kernel's reading as the table's columns: time, shares of peak, the
    dominant unit, the bound and the distance from it."""
    row = {"kernel": kernel_label(raw.get("Kernel Name", "")),
           "time_ms": _number(raw.get("gpu__time_duration.sum", "nan")) / 1e6,   # ncu's base unit: ns
           **{f"{u}_pct": _pct(raw, u) for u in UNITS}}
    for metric, col in (("dram__bytes.sum", "dram_gb"), ("lts__t_bytes.sum", "l2_gb")):
        row[col] = _number(raw.get(metric, "nan")) / 1e9
    return with_bound(row, dram_peak)


def ncu_command(ncu: str, log_file: str, extra_metrics: bool) -> list[str]:
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--kernel-name", "regex:fused3s_",
           "--csv", "--page", "raw", "--print-units", "base", "--log-file", log_file]
    for s in SECTIONS:
        cmd += ["--section", s]
    if extra_metrics:
        cmd += ["--metrics", ",".join(EXTRA_METRICS)]
    return cmd


def read_case(graph: str, setting: str, ncu: str, tmp: str, log=print) -> list[dict]:
    """Profile one (graph, setting) in its own process; its kernels' rows.
    Without the extra byte metrics if this ncu does not know them."""
    target = [sys.executable, "-m", "gt_fused3s.bench.ncu_bounds", "target", graph, setting]
    for extra in (True, False):
        if os.path.exists(tmp):
            os.remove(tmp)
        run = subprocess.run(ncu_command(ncu, tmp, extra) + target, capture_output=True, text=True)
        text = open(tmp).read() if os.path.exists(tmp) else ""
        kernels = parse_raw_csv(text)
        if run.returncode == 0 and kernels:
            break
        log(f"{graph} {setting}: ncu {'with' if extra else 'without'} {','.join(EXTRA_METRICS)} gave "
            f"exit {run.returncode}, {len(kernels)} kernel rows: {(run.stderr or text)[-600:]}")
    info = dict(line.split("=", 1) for line in run.stdout.splitlines() if line.startswith(("N=", "E=", "gpu=", "git=")))
    peak = DRAM_PEAK.get(info.get("gpu", ""))
    return [{"graph": graph, "setting": setting, "N": info.get("N"), "E": info.get("E"), "gpu": info.get("gpu"),
             "git": info.get("git"), **bound_row(k, peak)} for k in kernels]


def target(graph: str, setting: str) -> None:
    """The profiled process: forward + backward of the fused attention on
    ``graph`` in ``setting``, once warm, between profiler start and stop."""
    import torch

    from ..ops import fused3s_attention
    from ..plan import GraphPlan
    from .common import git_sha
    from .kernel import SETTINGS, load_graph
    D, H, dtype = SETTINGS[setting]
    ei, n = load_graph(graph, "cuda")
    plan = GraphPlan.from_edge_index(ei, n).prepare(H, D)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(n, H, D, device="cuda", generator=g, dtype=dtype) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step():
        out = fused3s_attention(*leaves, plan)
        torch.autograd.grad(out, leaves, do)

    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"N={n}\nE={ei.size(1)}\ngpu={torch.cuda.get_device_name()}\ngit={git_sha()}")


def format_table(rows: list[dict]) -> str:
    head = ("| graph | setting | kernel | ms | DRAM % | L2 % | L1 % | SM % | tensor % | bound by | "
            "bound ms | distance |")
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]

    def f(x, spec):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
    for r in rows:
        lines.append(f"| {r['graph']} | {r['setting']} | {r['kernel']} | {f(r['time_ms'], '.3f')} | "
                     f"{f(r['dram_pct'], '.0f')} | {f(r['l2_pct'], '.0f')} | {f(r['l1_pct'], '.0f')} | "
                     f"{f(r['sm_pct'], '.0f')} | {f(r['tensor_pct'], '.0f')} | {r['bound_unit'] or '-'} | "
                     f"{f(r['bound_ms'], '.3f')} | {f(r['distance'], '.2f')}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="profile every graph and setting (needs ncu and a CUDA GPU)")
    r.add_argument("--graphs", nargs="+", default=list(DEFAULT_GRAPHS))
    r.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS))
    r.add_argument("--ncu", default=shutil.which("ncu") or "ncu")
    r.add_argument("--csv", help="write the rows here")
    t = sub.add_parser("target", help="the profiled process (run by 'run' under ncu)")
    t.add_argument("graph")
    t.add_argument("setting")
    a = p.parse_args(argv)
    if a.what == "target":
        target(a.graph, a.setting)
        return 0
    if shutil.which(a.ncu) is None:
        print(f"ncu_bounds: no Nsight Compute here ({a.ncu} not found)", file=sys.stderr)
        return 2
    rows = []
    tmp = os.path.abspath("ncu_bounds_raw.csv")
    for graph in a.graphs:
        for setting in a.settings:
            got = read_case(graph, setting, a.ncu, tmp, log=lambda m: print(m, file=sys.stderr))
            rows += got
            print(format_table(got).split("\n", 2)[-1] if got else f"{graph} {setting}: no kernel rows",
                  flush=True)
    if os.path.exists(tmp):
        os.remove(tmp)
    print(format_table(rows))
    if a.csv:
        with open(a.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
