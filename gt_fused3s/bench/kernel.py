"""Kernel-only benchmark of the fused 3S forward pass against the unfused
backends, one process, one GPU (the work behind ``scripts/bench_kernel.py``).

Backends, side by side on the same q, k, v:

* ``fused3s``  : ``torch.ops.gt_fused3s.fwd`` called directly with the
  plan's BSB and schedule (kernel + output allocation); the public
  ``fused3s_attention`` call on the prepared plan (Python checks included)
  is timed too (``fused3s_api_ms``), and what a user waits for one such call
  (``fused3s_wall_ms``: synchronised; ``fused3s_host_ms``: until it returns)
  against the kernel's device time (``fused3s_kernel_ms``), forward and
  forward + backward (``fused3s_fb_*``).
* ``reference``: this package's unfused PyTorch 3S (fp32 math).
* ``pyg``      : PyG's unfused message passing (``torch_geometric.utils.softmax``
  + scatter-add), the computation of ``TransformerConv``.
* ``flex``     : FlexAttention (``torch.compile``) with a block mask of the
  graph, built from a dense N x N mask, so only for N <= ``--flex-max-nodes``.

Timing: CUDA events around each call, L2 flushed (a 256 MB memset) before each
call, warm-up first, median and the 10th/90th percentiles of the repetitions
(``*_ms``: the op as called, device side). ``fused3s_kernel_ms`` is the median
duration of the forward kernel alone as the profiler (CUPTI) reports it.

Bytes (``gbps_min``): the compulsory traffic, each of q, k, v read once and
out written once, plus the BSB arrays:
``(4 N H D) * elem + T (8*4 + 16) + 8 R``. ``gbps_gather``: the traffic of the
gathered design, q read and out written once, one K and one V row slice per
valid TCB column and head: ``(2 N H D + 2 C H D) * elem + T (8*4 + 16) + 8 R``
(C = number of non-padding TCB columns). Tensor-core FLOPs:
``T * H * 2 * (2 * 16 * 8 * D)`` (SDDMM and SpMM, padding included).
"""
from __future__ import annotations

import csv
import math
import os
import platform
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from ..data.base import data_dirs
from .common import free_cuda_memory, git_sha, short_error
from .timing import kernel_time, time_cuda, time_host, time_wall

SINGLE_GRAPHS = ("cora", "citeseer", "pubmed", "github")
COLLECTIONS = ("molhiv", "zinc", "peptides")
SYNTHETIC = {"powerlaw200k": 200_000, "powerlaw1m": 1_000_000}
ALL_GRAPHS = SINGLE_GRAPHS + COLLECTIONS + tuple(SYNTHETIC)
QUICK_GRAPHS = ("cora", "pubmed", "github", "molhiv", "powerlaw200k")

# name -> (head dim D, heads H, dtype)
SETTINGS = {
    "d128h1fp16": (128, 1, torch.float16),
    "d32h8bf16": (32, 8, torch.bfloat16),
    "d64h8bf16": (64, 8, torch.bfloat16),
}
BACKENDS = ("fused3s", "reference", "pyg", "flex")

# Synthetic power law of issue 3: Zipf(2.1) weights clipped to [1, 5000],
# Chung-Lu endpoints, symmetrised. Generated on an H100, avg_degree 40.2 gave
# 6.31M and 43.4 gave 7.00M directed edges at N = 200k; 42.5 aims at ~6.8M.
POWERLAW = dict(alpha=2.1, max_degree=5000, avg_degree=42.5, seed=0)


# --------------------------------------------------------------------- data
def _find(name: str) -> Path | None:
    for d in data_dirs():
        if (d / f"{name}.npz").is_file():
            return d / f"{name}.npz"
    return None


def available_graphs() -> list[str]:
    """Names of the real graphs whose .npz file is found."""
    return [n for n in SINGLE_GRAPHS + COLLECTIONS if _find(n) is not None]


def load_graph(name: str, device, batch: int = 1024) -> tuple[torch.Tensor, int]:
    """(edge_index int64 [2, E] on ``device``, N) of a real graph (whole) or of
    the first ``batch`` graphs of a collection (block-diagonal), or of a
    synthetic power-law graph generated on ``device``."""
    if name in SYNTHETIC:
        from ..data.synthetic import power_law_graph
        n = SYNTHETIC[name]
        return power_law_graph(n, device=device, **POWERLAW), n
    path = _find(name)
    if path is None:
        raise FileNotFoundError(f"{name}.npz not found in {[str(d) for d in data_dirs()]}")
    with np.load(path) as z:
        d = {k: z[k] for k in z.files}
    if "graph_ptr" in d:
        gp, ep = d["graph_ptr"], d["edge_ptr"]
        count = min(batch, gp.size - 1)
        n0, n1, e0, e1 = int(gp[0]), int(gp[count]), int(ep[0]), int(ep[count])
        src = torch.from_numpy(d["src"][e0:e1].astype(np.int64) - n0)
        dst = torch.from_numpy(d["dst"][e0:e1].astype(np.int64) - n0)
        n = n1 - n0
    else:
        n = int(d["num_nodes"])
        indptr = torch.from_numpy(d["indptr"].astype(np.int64))
        src = torch.from_numpy(d["indices"].astype(np.int64))
        dst = torch.repeat_interleave(torch.arange(n), indptr[1:] - indptr[:-1])
    return torch.stack([src, dst]).to(device), n


# --------------------------------------------------------------------- env
def env_info() -> dict:
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "git_sha": git_sha(),
        "python": platform.python_version(),
    }


# --------------------------------------------------------------------- run
def _measure_backward(row: dict, q, k, v, plan, graph, scale: float, backends, reps: dict, ops) -> None:
    """Forward + backward timings of one graph and setting, into ``row``.

    ``fused3s_bwd_ms``: the backward op alone (dQ pass + dK/dV pass) on the
    saved out and lse; ``fused3s_fb_ms``: forward op + backward op;
    ``fused3s_fb_api_ms``: ``fused3s_attention`` + ``torch.autograd.grad``
    (Python and autograd included); ``{pyg,reference}_fb_ms``: their forward +
    ``torch.autograd.grad``. Peak memory above the inputs in ``*_fb_peak_mb``.
    What a user waits for one forward + backward through the API:
    ``fused3s_fb_wall_ms`` (synchronised call) and ``fused3s_fb_host_ms``
    (until the calls return), against ``fused3s_fb_kernel_ms``, the device
    time of every kernel and memset of that call.
    """
    from .. import fused3s_attention
    from ..backends import get_backend
    from ..plan import padded_head_dim
    gen = torch.Generator(device="cuda").manual_seed(1)
    dout = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
    H, Dp = q.size(1), padded_head_dim(q.size(-1))
    fwd = plan.forward_args(H, Dp)
    t0 = time.perf_counter()
    bwd_graph = plan.backward_args(H, Dp)       # transposed BSB + its schedule, once per graph
    torch.cuda.synchronize()
    row["transpose_first_call_ms"] = (time.perf_counter() - t0) * 1e3
    _, cols, bitmap, _, items, slots = fwd
    out, lse = ops.fwd(q, k, v, *fwd, scale, False)

    def backward(o, lse_):
        return ops.bwd(dout, q, k, v, o, lse_, cols, bitmap, items, slots, *bwd_graph, scale, False)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    fns = {"fused3s_bwd": lambda: backward(out, lse),
           "fused3s_fb": lambda: backward(*ops.fwd(q, k, v, *fwd, scale, False)),
           "fused3s_fb_api": lambda: torch.autograd.grad(fused3s_attention(*leaves, plan, scale), leaves, dout)}
    for be in backends:
        if be in ("pyg", "reference"):
            fns[f"{be}_fb"] = (lambda f: lambda: torch.autograd.grad(f(*leaves, graph, scale), leaves, dout))(
                get_backend(be))
    grads = {}
    for name, fn in fns.items():
        try:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            res = fn()
            torch.cuda.synchronize()
            row[f"{name}_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            if name in ("fused3s_fb_api", "reference_fb"):
                grads[name] = [g.float() for g in res]
            del res
            row[f"{name}_ms"] = time_cuda(fn, **reps)["median"]
        except torch.cuda.OutOfMemoryError:
            row["notes"] = (row.get("notes", "") + f"; {name}: out of memory").lstrip("; ")
        except Exception as e:   # a missing/broken baseline must not stop the run
            row["notes"] = (row.get("notes", "") + f"; {name}: {short_error(e)}").lstrip("; ")
        finally:
            free_cuda_memory()
    api = fns["fused3s_fb_api"]
    w = time_wall(api)
    row["fused3s_fb_wall_ms"], row["fused3s_fb_host_ms"] = w["wall"], w["host"]
    # PyTorch's own share: autograd.grad through one trivial op (engine, grad checks)
    floor = time_wall(lambda: torch.autograd.grad(leaves[0] * 2.0, leaves[0], dout))
    row["autograd_floor_host_ms"] = floor["host"]
    row["fused3s_fb_kernel_ms"] = kernel_time(api, name="", flush=False)
    if len(grads) == 2:
        row["max_grad_err_vs_reference"] = max((a - b).abs().max().item()
                                              for a, b in zip(grads["fused3s_fb_api"], grads["reference_fb"]))
    if row.get("fused3s_bwd_ms") and row.get("fused3s_ms"):
        row["bwd_over_fwd"] = row["fused3s_bwd_ms"] / row["fused3s_ms"]
    for be in ("pyg", "reference"):
        if row.get(f"{be}_fb_ms") and row.get("fused3s_fb_ms"):
            row[f"fb_speedup_vs_{be}"] = row[f"{be}_fb_ms"] / row["fused3s_fb_ms"]


def run(graphs=None, settings=None, backends=BACKENDS, *, quick: bool = False, out: str | None = None,
        flex_max_nodes: int = 65_536, flex_settings=("d128h1fp16",), flush: bool = True,
        backward: bool = True, log=print) -> list[dict]:
    from .. import BSBGraph, GraphPlan, fused3s_attention
    from .._build import load_extension
    from ..backends import AttentionGraph, get_backend
    from ..plan import padded_head_dim
    from ..reference import default_scale

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    ops = load_extension()
    env = env_info()
    graphs = list(graphs or (QUICK_GRAPHS if quick else ALL_GRAPHS))
    settings = list(settings or SETTINGS)
    reps = dict(min_reps=5, budget_ms=100.0) if quick else dict(min_reps=10, budget_ms=400.0)
    reps["flush"] = flush
    log(f"# {env['gpu']} | torch {env['torch']} | CUDA {env['cuda']} | git {env['git_sha']}")
    rows, builds = [], []
    for gname, ei, n in loaded_graphs(graphs, "cuda", log):
        torch.cuda.synchronize()
        bsb = BSBGraph.from_edge_index(ei, n)
        tb = time_host(lambda: BSBGraph.from_edge_index(ei, n), reps=5 if quick else 11)
        # the static build (capacity shapes, no host sync): its device time
        tb_static = time_cuda(lambda: BSBGraph.from_edge_index(ei, n, static=True), flush=False, **{
            k: v for k, v in reps.items() if k != "flush"})
        st = bsb.stats()
        builds.append({"graph": gname, "N": n, "nnz": bsb.num_edges, "tcbs": bsb.num_tcbs,
                       "bsb_build_ms": tb["median"], "bsb_build_min_ms": tb["min"],
                       "bsb_build_static_ms": tb_static["median"],
                       "tcb_per_rw_max": st["tcb_per_rw_max"], "nnz_per_tcb": st["nnz_per_tcb_mean"]})
        if out:
            write_csv(builds, str(Path(out).with_suffix("")) + "_bsb_build.csv")
        log(f"[graph] {gname}: N={n} nnz={bsb.num_edges} TCB={bsb.num_tcbs} max TCB/RW="
            f"{st['tcb_per_rw_max']} nnz/TCB={st['nnz_per_tcb_mean']:.2f} "
            f"BSB build {tb['median']:.3f} ms (min {tb['min']:.3f})")
        plan = GraphPlan(bsb)
        graph = AttentionGraph.from_plan(plan)
        valid_cols = int((bsb.cols >= 0).sum())
        for sname in settings:
            D, H, dtype = SETTINGS[sname]
            elem = torch.finfo(dtype).bits // 8
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(n, H, D, generator=gen, device="cuda").to(dtype) for _ in range(3))
            scale = default_scale(D)
            T, R = bsb.num_tcbs, bsb.num_windows
            bsb_bytes = T * (8 * 4 + 16) + 8 * R
            bytes_min = 4 * n * H * D * elem + bsb_bytes
            bytes_gather = (2 * n * H * D + 2 * valid_cols * H * D) * elem + bsb_bytes
            flops = T * H * 2 * (2 * 16 * 8 * D)
            row = {**env, "graph": gname, "N": n, "nnz": bsb.num_edges, "tcbs": T, "setting": sname,
                   "D": D, "H": H, "dtype": str(dtype).replace("torch.", ""), "bsb_build_ms": tb["median"],
                   **block_stat_columns(bsb, D)}
            # Schedule (once per graph and setting, in the plan), then the op alone.
            t0 = time.perf_counter()
            fwd_args = plan.forward_args(H, padded_head_dim(D))
            torch.cuda.synchronize()
            row["schedule_first_call_ms"] = (time.perf_counter() - t0) * 1e3
            items, slots = fwd_args[4], fwd_args[5]
            row["work_items"] = items.size(0)
            row["split_windows"] = int((slots[:, 1] == torch.arange(slots.size(0), device=slots.device)).sum())
            args = (q, k, v, *fwd_args, scale, False)
            fused_out = None
            for be in backends:
                note = ""
                try:
                    if be == "fused3s":
                        fn = lambda: ops.fwd(*args)   # noqa: E731
                    elif be == "flex":
                        if n > flex_max_nodes:
                            raise _Skip(f"N={n} > flex_max_nodes={flex_max_nodes} (dense mask)")
                        if sname not in flex_settings:
                            raise _Skip("setting not in --flex-settings (compile time)")
                        fb = get_backend("flex")
                        fn = lambda: fb(q, k, v, graph, scale)   # noqa: E731
                    else:
                        fb = get_backend(be)
                        fn = lambda: fb(q, k, v, graph, scale)   # noqa: E731
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    res = fn()
                    torch.cuda.synchronize()
                    row[f"{be}_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
                    o = res[0] if isinstance(res, tuple) else res
                    if be == "fused3s":
                        fused_out = o.float()
                    elif fused_out is not None and be == "reference":
                        row["max_err_vs_reference"] = (fused_out - o.float()).abs().max().item()
                    del res, o
                    t = time_cuda(fn, **reps)
                    row[f"{be}_ms"] = t["median"]
                    row[f"{be}_p10_ms"], row[f"{be}_p90_ms"] = t["p10"], t["p90"]
                    if be == "fused3s":
                        api = lambda: fused3s_attention(q, k, v, plan, scale)   # noqa: E731
                        row["fused3s_api_ms"] = time_cuda(api, **reps)["median"]
                        row["fused3s_kernel_ms"] = kernel_time(fn, flush=flush)
                        w = time_wall(api)
                        row["fused3s_wall_ms"], row["fused3s_host_ms"] = w["wall"], w["host"]
                except _Skip as e:
                    note = f"{be} skipped: {e}"
                except torch.cuda.OutOfMemoryError:
                    note = f"{be}: out of memory"
                except Exception as e:   # a missing/broken baseline must not stop the run
                    note = f"{be}: {short_error(e)}"
                    if os.environ.get("GT_FUSED3S_BENCH_TRACEBACK") == "1":
                        traceback.print_exc()
                finally:
                    fn = None
                    free_cuda_memory()
                if note:
                    row["notes"] = (row.get("notes", "") + "; " + note).lstrip("; ")
            if backward:
                _measure_backward(row, q, k, v, plan, graph, scale, backends, reps, ops)
            f_ms = row.get("fused3s_ms")
            if f_ms:
                row["gbps_min"] = bytes_min / f_ms / 1e6
                row["gbps_gather"] = bytes_gather / f_ms / 1e6
                row["tc_tflops"] = flops / f_ms / 1e9
                for be in backends:
                    if be != "fused3s" and row.get(f"{be}_ms"):
                        row[f"speedup_vs_{be}"] = row[f"{be}_ms"] / f_ms
            rows.append(row)
            log(format_row(row))
            if out:   # rewritten after every row, so a run cut short keeps its results
                write_csv(rows, out)
            del q, k, v, args, fused_out
            free_cuda_memory()
        del bsb, plan, graph, ei
        free_cuda_memory()
    if out:
        write_csv(rows, out)
        write_csv(builds, str(Path(out).with_suffix("")) + "_bsb_build.csv")
    log("")
    log(format_table(rows))
    log("")
    log(format_block_stats(rows))
    log("")
    log(format_builds(builds))
    return rows


# The block statistics printed next to the times (issue 13, FlashSparse's
# Figure 1): per head, of the 16 x 8 format the kernels run and of 8-row
# windows of 8 x 16 blocks (counted from the edges, no kernel reads them).
BLOCK_STAT_KEYS = ("num_tcbs", "mma_fwd", "mma_fwd_kernel", "nnz_per_tcb_mean", "kv_bytes_fwd",
                   "w8_num_blocks", "w8_mma_fwd", "w8_nnz_per_block_mean", "w8_kv_bytes_fwd")


def block_stat_columns(bsb, head_dim: int) -> dict:
    """The row's block statistics for head dim ``head_dim``
    (:meth:`~gt_fused3s.graph.BSBGraph.stats`), under ``stat_<key>``."""
    st = bsb.stats(head_dim=head_dim)
    return {f"stat_{k}": st[k] for k in BLOCK_STAT_KEYS}


def format_block_stats(rows: list[dict]) -> str:
    """Blocks, mma.m16n8k16 invocations and K / V bytes gathered by one
    forward per head, with the rows' kernel times: the 16 x 8 format (what
    the kernel runs: whole pairs of TCBs) and 8-row windows of 8 x 16
    blocks."""
    head = ("graph", "setting", "fused3s kernel ms", "TCBs", "nnz/TCB", "MMA (kernel)", "K/V MB",
            "8x16 blocks", "nnz/block", "8x16 MMA", "8x16 K/V MB")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "stat_num_tcbs" not in r:
            continue
        km = r.get("fused3s_kernel_ms")
        lines.append("| " + " | ".join([
            r["graph"], r["setting"], f"{km:.4f}" if isinstance(km, float) else "-",
            str(r["stat_num_tcbs"]), f"{r['stat_nnz_per_tcb_mean']:.2f}",
            f"{r['stat_mma_fwd']} ({r['stat_mma_fwd_kernel']})", f"{r['stat_kv_bytes_fwd'] / 1e6:.1f}",
            str(r["stat_w8_num_blocks"]), f"{r['stat_w8_nnz_per_block_mean']:.2f}", str(r["stat_w8_mma_fwd"]),
            f"{r['stat_w8_kv_bytes_fwd'] / 1e6:.1f}"]) + " |")
    return "\n".join(lines)


class _Skip(Exception):
    pass


def format_row(r: dict) -> str:
    f = lambda k: f"{r[k]:.4f}" if isinstance(r.get(k), float) else "-"   # noqa: E731
    return (f"[{r['graph']} {r['setting']}] fused3s {f('fused3s_ms')} ms (kernel {f('fused3s_kernel_ms')}, "
            f"api {f('fused3s_api_ms')}) "
            f"ref {f('reference_ms')} pyg {f('pyg_ms')} flex {f('flex_ms')} "
            f"x{r.get('speedup_vs_pyg', float('nan')):.1f} vs pyg; items {r.get('work_items')} "
            f"split {r.get('split_windows')} err {r.get('max_err_vs_reference', float('nan')):.2e}"
            + (f" | bwd {f('fused3s_bwd_ms')} ms ({r.get('bwd_over_fwd', float('nan')):.2f}x fwd), fwd+bwd "
               f"{f('fused3s_fb_ms')} (api {f('fused3s_fb_api_ms')}) pyg {f('pyg_fb_ms')} "
               f"x{r.get('fb_speedup_vs_pyg', float('nan')):.1f}, grad err "
               f"{r.get('max_grad_err_vs_reference', float('nan')):.2e}" if "fused3s_bwd_ms" in r else "")
            + (f" | {r['notes']}" if r.get("notes") else ""))


def format_table(rows: list[dict]) -> str:
    head = ("graph", "setting", "N", "nnz", "TCBs", "fused3s ms", "p10-p90", "kernel ms", "reference", "pyg",
            "flex", "x pyg", "GB/s min", "GB/s gath")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    geo = {}
    for r in rows:
        ms = lambda k: f"{r[k]:.4f}" if isinstance(r.get(k), float) else "-"   # noqa: E731
        spread = (f"{r['fused3s_p10_ms']:.4f}-{r['fused3s_p90_ms']:.4f}" if "fused3s_p10_ms" in r else "-")
        sp = r.get("speedup_vs_pyg")
        if sp:
            geo.setdefault(r["setting"], []).append(sp)
        lines.append("| " + " | ".join([
            r["graph"], r["setting"], str(r["N"]), str(r["nnz"]), str(r["tcbs"]), ms("fused3s_ms"), spread,
            ms("fused3s_kernel_ms"), ms("reference_ms"), ms("pyg_ms"), ms("flex_ms"), f"{sp:.1f}" if sp else "-",
            f"{r['gbps_min']:.0f}" if "gbps_min" in r else "-",
            f"{r['gbps_gather']:.0f}" if "gbps_gather" in r else "-"]) + " |")
    for s, v in geo.items():
        lines.append(f"geomean speedup over pyg, {s}: {math.exp(sum(map(math.log, v)) / len(v)):.2f}x "
                     f"over {len(v)} graphs")
    if any("fused3s_bwd_ms" in r for r in rows):
        lines += ["", format_training_table(rows)]
    if any("fused3s_wall_ms" in r for r in rows):
        lines += ["", format_host_table(rows)]
    return "\n".join(lines)


def format_host_table(rows: list[dict]) -> str:
    """What a user waits for one call through ``fused3s_attention`` on a
    prepared plan (wall: synchronised; host: until the call returns) against
    the device time of the call's kernels; overhead = wall - kernel. The
    floor: host time of ``torch.autograd.grad`` through one trivial op (what
    PyTorch's autograd costs by itself on this host)."""
    head = ("graph", "setting", "fwd kernel ms", "fwd wall ms", "fwd host ms", "fwd overhead us",
            "fwd+bwd kernel ms", "fwd+bwd wall ms", "fwd+bwd host ms", "fwd+bwd overhead us",
            "autograd.grad floor host ms")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ms = lambda k: f"{r[k]:.4f}" if isinstance(r.get(k), float) else "-"   # noqa: E731

        def over(wall, kern):
            return (f"{(r[wall] - r[kern]) * 1e3:.0f}" if isinstance(r.get(wall), float)
                    and isinstance(r.get(kern), float) else "-")
        lines.append("| " + " | ".join([
            r["graph"], r["setting"], ms("fused3s_kernel_ms"), ms("fused3s_wall_ms"), ms("fused3s_host_ms"),
            over("fused3s_wall_ms", "fused3s_kernel_ms"), ms("fused3s_fb_kernel_ms"), ms("fused3s_fb_wall_ms"),
            ms("fused3s_fb_host_ms"), over("fused3s_fb_wall_ms", "fused3s_fb_kernel_ms"),
            ms("autograd_floor_host_ms")]) + " |")
    return "\n".join(lines)


def format_training_table(rows: list[dict]) -> str:
    """Forward + backward: the fused ops against PyG's unfused autograd."""
    head = ("graph", "setting", "fwd ms", "bwd ms", "bwd/fwd", "fwd+bwd ms", "api fwd+bwd", "pyg fwd+bwd",
            "x pyg", "fused peak MB", "pyg peak MB", "grad err")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    geo, ratios = {}, {}
    for r in rows:
        ms = lambda k: f"{r[k]:.4f}" if isinstance(r.get(k), float) else "-"   # noqa: E731
        mb = lambda k: f"{r[k]:.0f}" if isinstance(r.get(k), float) else "-"   # noqa: E731
        sp, ratio = r.get("fb_speedup_vs_pyg"), r.get("bwd_over_fwd")
        if sp:
            geo.setdefault(r["setting"], []).append(sp)
        if ratio:
            ratios.setdefault(r["setting"], []).append(ratio)
        err = r.get("max_grad_err_vs_reference")
        lines.append("| " + " | ".join([
            r["graph"], r["setting"], ms("fused3s_ms"), ms("fused3s_bwd_ms"), f"{ratio:.2f}" if ratio else "-",
            ms("fused3s_fb_ms"), ms("fused3s_fb_api_ms"), ms("pyg_fb_ms"), f"{sp:.1f}" if sp else "-",
            mb("fused3s_fb_peak_mb"), mb("pyg_fb_peak_mb"), f"{err:.1e}" if err is not None else "-"]) + " |")
    for s, v in geo.items():
        lines.append(f"geomean fwd+bwd speedup over pyg, {s}: {math.exp(sum(map(math.log, v)) / len(v)):.2f}x "
                     f"over {len(v)} graphs")
    for s, v in ratios.items():
        lines.append(f"backward / forward, {s}: geomean {math.exp(sum(map(math.log, v)) / len(v)):.2f}, "
                     f"max {max(v):.2f}")
    return "\n".join(lines)


def format_builds(builds: list[dict]) -> str:
    lines = ["| graph | N | nnz | TCBs | max TCB/RW | BSB build ms (exact, wall, median) | min | "
             "static build ms (device) |", "|---|---|---|---|---|---|---|---|"]
    for b in builds:
        lines.append(f"| {b['graph']} | {b['N']} | {b['nnz']} | {b['tcbs']} | {b['tcb_per_rw_max']} | "
                     f"{b['bsb_build_ms']:.3f} | {b['bsb_build_min_ms']:.3f} | {b['bsb_build_static_ms']:.3f} |")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: str) -> None:
    if not rows:
        return
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def sanitize_case() -> None:
    """A small run of every kernel path, forward and backward (split + merge
    in both backward passes, D = 256 team exchange, empty rows, N not a
    multiple of 16, duplicate edges, fp16 and bf16, a static plan whose
    schedule has unused items) for compute-sanitizer:

        compute-sanitizer --tool memcheck python -c \\
            "from gt_fused3s.bench.kernel import sanitize_case; sanitize_case()"
    """
    from .. import GraphPlan, fused3s_attention
    from ..reference import attention_reference
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = 1003
    src = torch.randint(0, n, (3 * n,), generator=gen, device="cuda")
    dst = torch.randint(0, n - 40, (3 * n,), generator=gen, device="cuda")     # empty trailing rows
    hub = torch.arange(0, n, 2, device="cuda")
    # node 17 has ~500 in-neighbours, node 23 ~500 out-neighbours: split windows in every pass
    src = torch.cat([src, hub, hub * 0 + 23, src[:50]])                       # + duplicates
    dst = torch.cat([dst, hub * 0 + 17, hub, dst[:50]])
    ei = torch.stack([src, dst])
    worst, worst_grad = 0.0, 0.0
    cases = [(dtype, h, d, False) for dtype in (torch.float16, torch.bfloat16)
             for h, d in ((2, 16), (2, 64), (1, 128), (2, 256), (1, 40))] + [(torch.float16, 2, 64, True)]
    plans = {static: GraphPlan.from_edge_index(ei, n, static=static) for static in (False, True)}
    for dtype, h, d, static in cases:
        plan = plans[static]
        q, k, v, do = (torch.randn(n, h, d, generator=gen, device="cuda").to(dtype) for _ in range(4))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fused3s_attention(*leaves, plan)
        grads = torch.autograd.grad(out, leaves, do)
        refs = [t.float().requires_grad_() for t in (q, k, v)]
        ref = attention_reference(*refs, ei, out_dtype=torch.float32)
        ref_grads = torch.autograd.grad(ref, refs, do.float())
        worst = max(worst, (out.float() - ref).abs().max().item())
        worst_grad = max(worst_grad, *((g.float() - r).abs().max().item() for g, r in zip(grads, ref_grads)))
    torch.cuda.synchronize()
    print(f"sanitize_case: ok, max abs err {worst:.3e}, gradients {worst_grad:.3e}")


# ------------------------------------------------------------- reordering
REORDER_SETTINGS = ("d128h1fp16", "d64h8bf16")     # the settings of issue 13's bars


def loaded_graphs(graphs, device, log, load=None):
    """(name, edge_index, N) of each graph that loads (``load(name, device)``,
    default :func:`load_graph`); a missing one is logged and skipped."""
    for gname in graphs:
        try:
            ei, n = (load or load_graph)(gname, device)
        except FileNotFoundError as e:
            log(f"[skip] {gname}: {e}")
            continue
        yield gname, ei, n


def setting_inputs(n: int, setting: str, device) -> tuple[int, int, torch.dtype, list[torch.Tensor]]:
    """(D, H, dtype, [q, k, v, dO]) of a setting on ``n`` nodes: the same
    seeded random tensors for every plan or kernel compared on them."""
    D, H, dtype = SETTINGS[setting]
    gen = torch.Generator(device=device).manual_seed(0)
    return D, H, dtype, [torch.randn(n, H, D, generator=gen, device=device).to(dtype) for _ in range(4)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, reps: dict) -> float:
    """Device time of ``fn()`` (CUDA events, :func:`time_cuda`) on a GPU; on
    the CPU (dry run) the median wall time of a few calls."""
    if device.type == "cuda":
        return time_cuda(fn, **reps)["median"]
    return _host_ms(fn, device, 3)


def _host_ms(fn, device: torch.device, count: int) -> float:
    """Median wall milliseconds of ``fn()``, synchronised before and after
    (a build that itself synchronises)."""
    fn()
    ts = []
    for _ in range(count):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


def _kernel_ms(fn, device: torch.device, name: str = "") -> float | None:
    """Profiler (CUPTI) device time of the call's kernels whose name holds
    ``name`` (every kernel and memset with ``""``, L2 not flushed then); None on
    the CPU."""
    if device.type != "cuda":
        return None
    return kernel_time(fn, name=name, flush=bool(name))


def run_reorder(graphs=None, settings=None, method: str = "cuthill_mckee", *, quick: bool = False,
                out: str | None = None, flush: bool = True, backward: bool = True,
                device: str | torch.device = "cuda", log=print) -> list[dict]:
    """Kernel time with and without a locality reordering of the nodes
    (issue 13, items 3 and 5), side by side per graph and setting in one
    process: a plan in the caller's order and one built with
    ``GraphPlan.from_edge_index(..., reorder=method)``, on the same q, k, v.

    Columns (``_r``: the reordered plan; ``*_kernel_ms``: profiler device
    time of the kernels, ``*_ms``: CUDA-event time of the call, L2 flushed):

    * ``fwd_kernel_ms`` / ``_r``: the forward kernel alone
      (``fused3s_fwd_kernel``), the reordered one on q, k, v already in its
      order; ``fb_kernel_ms`` / ``_r``: every kernel of the forward op +
      backward op on the same inputs (the fused kernels, no gather);
    * ``api_fwd_kernel_ms`` / ``_r``, ``api_fb_kernel_ms`` / ``_r``: every
      kernel of ``fused3s_attention`` on the prepared plan (and
      ``torch.autograd.grad``): the reordered call includes its gathers
      (3 + 1 forward, 4 more backward), so ``api_*_speedup`` is what a user
      gains per call; ``api_fwd_wall_ms`` / ``_r``: a synchronised call
      (host included);
    * ``perm_fwd_kernel_ms`` / ``perm_fb_kernel_ms`` (and ``_ms``): the
      gathers alone (q, k, v in, out back; with the backward also dO in and
      dq, dk, dv back) at this N, H, D and dtype;
    * ``order_ms``: computing the order on the device (host synchronisations
      included: Cuthill-McKee syncs per BFS level), ``plan_build_ms`` /
      ``_r``: ``GraphPlan.from_edge_index`` without / with the reordering
      (the BSB build, plus the order and the relabelling);
      ``break_even_fb_calls``: ``order_ms`` over the API forward + backward
      kernel time saved per call (empty when nothing is saved);
    * the BSB statistics of both plans at this head dim: ``tcbs``,
      ``mma_fwd`` (m16n8k16 invocations of one forward per head, 16 x 8
      format), ``mma_fwd_kernel`` (as the kernel runs them), ``nnz_per_tcb``,
      ``kv_rows``, each with ``_r``;
    * ``max_diff`` / ``max_grad_diff``: largest difference of the API's
      output (and gradients) between the two plans.

    ``device="cpu"`` is a dry run of the plumbing (no GPU): orders, plans,
    statistics and the calls run, through the registered ops where a
    kernel is available (the CPU stand-ins of the tests) and through the
    reference path elsewhere; times are wall clock and not kernel times.
    """
    from .. import GraphPlan, fused3s_attention
    from .. import ops as ops_mod
    from .._build import load_extension
    from ..plan import padded_head_dim
    from ..reference import default_scale
    from ..reorder import reorder

    device = torch.device(device)
    dry = device.type != "cuda"
    env = env_info() if not dry else {"gpu": "none (dry run on the CPU: not kernel times)",
                                      "torch": torch.__version__, "cuda": "", "git_sha": git_sha(),
                                      "python": platform.python_version()}
    use_ops = ops_mod.kernel_available(device)
    ops = load_extension() if use_ops else None
    graphs = list(graphs or (QUICK_GRAPHS if quick else ALL_GRAPHS))
    settings = list(settings or REORDER_SETTINGS)
    reps = dict(min_reps=5, budget_ms=100.0) if quick else dict(min_reps=10, budget_ms=400.0)
    reps["flush"] = flush
    log(f"# {env['gpu']} | torch {env['torch']} | CUDA {env['cuda']} | git {env['git_sha']} | "
        f"reorder {method}" + ("" if use_ops else " | no kernel: reference path, op rows empty"))
    rows = []
    for gname, ei, n in loaded_graphs(graphs, device, log):
        _sync(device)
        order_ms = _host_ms(lambda: reorder(ei, n, method), device, 1 if quick else 3)
        plan_ms = _host_ms(lambda: GraphPlan.from_edge_index(ei, n), device, 1 if quick else 3)
        plan_r_ms = _host_ms(lambda: GraphPlan.from_edge_index(ei, n, reorder=method), device,
                             1 if quick else 3)
        order = reorder(ei, n, method)
        plans = {"": GraphPlan.from_edge_index(ei, n),
                 "_r": GraphPlan.from_edge_index(ei, n, reorder=order)}
        perm, inv = order.perm, order.inv
        log(f"[graph] {gname}: N={n} nnz={ei.size(1)} order {order_ms:.2f} ms, plan build "
            f"{plan_ms:.2f} -> {plan_r_ms:.2f} ms")
        for sname in settings:
            D, H, dtype, (q, k, v, dout) = setting_inputs(n, sname, device)
            Dp = padded_head_dim(D)
            scale = default_scale(D)
            row = {**env, "graph": gname, "N": n, "nnz": ei.size(1), "setting": sname, "D": D, "H": H,
                   "dtype": str(dtype).replace("torch.", ""), "method": method, "order_ms": order_ms,
                   "plan_build_ms": plan_ms, "plan_build_ms_r": plan_r_ms}
            outs, grads = {}, {}
            for sfx, plan in plans.items():
                plan.prepare(H, D, backward=backward)
                st = plan.bsb.stats(head_dim=Dp, variants=False)
                row[f"tcbs{sfx}"], row[f"mma_fwd{sfx}"] = st["num_tcbs"], st["mma_fwd"]
                row[f"mma_fwd_kernel{sfx}"], row[f"kv_rows{sfx}"] = st["mma_fwd_kernel"], st["kv_rows"]
                row[f"nnz_per_tcb{sfx}"] = st["nnz_per_tcb_mean"]
                # the kernels alone, on q, k, v in the plan's order
                qp, kp, vp, dp = ((t.index_select(0, perm) for t in (q, k, v, dout)) if sfx
                                  else (q, k, v, dout))
                try:
                    if ops is not None and Dp == D:
                        fwd = plan.forward_args(H, Dp)
                        fn = lambda: ops.fwd(qp, kp, vp, *fwd, scale, False)   # noqa: E731
                        row[f"fwd_ms{sfx}"] = _median_ms(fn, device, reps)
                        row[f"fwd_kernel_ms{sfx}"] = _kernel_ms(fn, device, "fused3s_fwd_kernel")
                        if backward:
                            bwd = plan.backward_args(H, Dp)
                            _, cols, bitmap, _, items, slots = fwd

                            def fb():
                                o, lse = ops.fwd(qp, kp, vp, *fwd, scale, False)
                                return ops.bwd(dp, qp, kp, vp, o, lse, cols, bitmap, items, slots, *bwd,
                                               scale, False)
                            row[f"fb_ms{sfx}"] = _median_ms(fb, device, reps)
                            row[f"fb_kernel_ms{sfx}"] = _kernel_ms(fb, device)
                    # the public call on the prepared plan (with its gathers)
                    api = lambda: fused3s_attention(q, k, v, plan, scale)   # noqa: E731
                    outs[sfx] = api().float()
                    row[f"api_fwd_ms{sfx}"] = _median_ms(api, device, reps)
                    row[f"api_fwd_kernel_ms{sfx}"] = _kernel_ms(api, device)
                    if not dry:
                        row[f"api_fwd_wall_ms{sfx}"] = time_wall(api)["wall"]
                    if backward:
                        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                        api_fb = lambda: torch.autograd.grad(   # noqa: E731
                            fused3s_attention(*leaves, plan, scale), leaves, dout)
                        grads[sfx] = [g.float() for g in api_fb()]
                        row[f"api_fb_ms{sfx}"] = _median_ms(api_fb, device, reps)
                        row[f"api_fb_kernel_ms{sfx}"] = _kernel_ms(api_fb, device)
                except torch.cuda.OutOfMemoryError:
                    row["notes"] = (row.get("notes", "") + f"; plan{sfx}: out of memory").lstrip("; ")
                except Exception as e:   # one failing graph must not stop the run
                    row["notes"] = (row.get("notes", "") + f"; plan{sfx}: {short_error(e)}").lstrip("; ")
                    if os.environ.get("GT_FUSED3S_BENCH_TRACEBACK") == "1":
                        traceback.print_exc()
                finally:
                    fn = fb = api = api_fb = None
                    free_cuda_memory(device)
            # the gathers alone: what the reordering adds to a call
            out0 = outs.get("", q)
            perm_fwd = lambda: (q.index_select(0, perm), k.index_select(0, perm),   # noqa: E731
                                v.index_select(0, perm), out0.index_select(0, inv))
            row["perm_fwd_ms"] = _median_ms(perm_fwd, device, reps)
            row["perm_fwd_kernel_ms"] = _kernel_ms(perm_fwd, device)
            if backward:
                perm_fb = lambda: (perm_fwd(), dout.index_select(0, perm),   # noqa: E731
                                   *(t.index_select(0, inv) for t in (q, k, v)))
                row["perm_fb_ms"] = _median_ms(perm_fb, device, reps)
                row["perm_fb_kernel_ms"] = _kernel_ms(perm_fb, device)
            if len(outs) == 2:
                row["max_diff"] = (outs[""] - outs["_r"]).abs().max().item() if n else 0.0
            if len(grads) == 2:
                row["max_grad_diff"] = max(((a - b).abs().max().item() for a, b in zip(grads[""], grads["_r"])),
                                           default=0.0) if n else 0.0
            for key in ("fwd_kernel_ms", "fb_kernel_ms", "api_fwd_kernel_ms", "api_fb_kernel_ms"):
                a, b = row.get(key), row.get(key + "_r")
                if a and b:
                    row[key.replace("_kernel_ms", "_speedup")] = a / b
            a, b = row.get("api_fb_kernel_ms"), row.get("api_fb_kernel_ms_r")
            if a and b and a > b:
                row["break_even_fb_calls"] = order_ms / (a - b)
            if row.get("mma_fwd"):
                row["mma_fwd_ratio"] = row["mma_fwd_r"] / row["mma_fwd"]
            rows.append(row)
            log(format_reorder_row(row))
            if out:
                write_csv(rows, out)
            q = k = v = dout = out0 = outs = grads = perm_fwd = perm_fb = None
            free_cuda_memory(device)
        plans = order = perm = inv = ei = None
        free_cuda_memory(device)
    if out:
        write_csv(rows, out)
    log("")
    log(format_reorder_table(rows))
    return rows


def _f(r: dict, k: str, fmt: str = ".4f") -> str:
    return format(r[k], fmt) if isinstance(r.get(k), (int, float)) else "-"


def format_reorder_row(r: dict) -> str:
    return (f"[{r['graph']} {r['setting']} {r['method']}] TCBs {r.get('tcbs')} -> {r.get('tcbs_r')}, "
            f"MMA x{_f(r, 'mma_fwd_ratio', '.3f')}, nnz/TCB {_f(r, 'nnz_per_tcb', '.2f')} -> "
            f"{_f(r, 'nnz_per_tcb_r', '.2f')} | fwd kernel {_f(r, 'fwd_kernel_ms')} -> "
            f"{_f(r, 'fwd_kernel_ms_r')} ms, fwd+bwd {_f(r, 'fb_kernel_ms')} -> {_f(r, 'fb_kernel_ms_r')} | "
            f"api fwd {_f(r, 'api_fwd_kernel_ms')} -> {_f(r, 'api_fwd_kernel_ms_r')}, api fwd+bwd "
            f"{_f(r, 'api_fb_kernel_ms')} -> {_f(r, 'api_fb_kernel_ms_r')} | gathers fwd "
            f"{_f(r, 'perm_fwd_kernel_ms')} fwd+bwd {_f(r, 'perm_fb_kernel_ms')} | order "
            f"{_f(r, 'order_ms', '.2f')} ms | diff {_f(r, 'max_diff', '.1e')}"
            + (f" | {r['notes']}" if r.get("notes") else ""))


def format_reorder_table(rows: list[dict]) -> str:
    """Per graph and setting: the block statistics and kernel times in the
    caller's order and reordered, the gathers' cost and the order's build
    time (kernel times from the profiler; '-' where not measured)."""
    head = ("graph", "setting", "TCBs", "TCBs r", "nnz/TCB", "nnz/TCB r", "MMA r/orig",
            "fwd kernel ms", "fwd r", "x", "fwd+bwd kernel ms", "fwd+bwd r", "x",
            "api fwd+bwd ms (all kernels)", "api r (with gathers)", "x", "gathers fwd ms", "gathers fwd+bwd ms",
            "order ms", "plan build ms", "plan r", "break-even fwd+bwd calls")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    geo = {}
    for r in rows:
        for key in ("fwd_speedup", "fb_speedup", "api_fb_speedup"):
            if r.get(key):
                geo.setdefault((r["setting"], key), []).append(r[key])
        lines.append("| " + " | ".join([
            r["graph"], r["setting"], str(r.get("tcbs", "-")), str(r.get("tcbs_r", "-")),
            _f(r, "nnz_per_tcb", ".2f"), _f(r, "nnz_per_tcb_r", ".2f"), _f(r, "mma_fwd_ratio", ".3f"),
            _f(r, "fwd_kernel_ms"), _f(r, "fwd_kernel_ms_r"), _f(r, "fwd_speedup", ".2f"),
            _f(r, "fb_kernel_ms"), _f(r, "fb_kernel_ms_r"), _f(r, "fb_speedup", ".2f"),
            _f(r, "api_fb_kernel_ms"), _f(r, "api_fb_kernel_ms_r"), _f(r, "api_fb_speedup", ".2f"),
            _f(r, "perm_fwd_kernel_ms"), _f(r, "perm_fb_kernel_ms"), _f(r, "order_ms", ".2f"),
            _f(r, "plan_build_ms", ".2f"), _f(r, "plan_build_ms_r", ".2f"),
            _f(r, "break_even_fb_calls", ".0f")]) + " |")
    for (s, key), v in sorted(geo.items()):
        lines.append(f"geomean {key} (caller's order / reordered), {s}: "
                     f"{math.exp(sum(map(math.log, v)) / len(v)):.3f}x over {len(v)} graphs")
    if rows and rows[0].get("gpu", "").startswith("none"):
        lines.append("dry run on the CPU: times are wall clock of the reference or stand-in path, not kernel times")
    return "\n".join(lines)
