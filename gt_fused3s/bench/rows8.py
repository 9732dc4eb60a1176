"""8-row windows against the 16-row format, side by side (issue 13):
``python scripts/bench_kernel.py --window-rows 8``.

For each graph and setting, the plans ``GraphPlan.from_edge_index(ei, n)``
and ``GraphPlan.from_edge_index(ei, n, window_rows=8)`` on the same q, k,
v, dO. Columns (``_8``: the 8-row plan; ``*_kernel_ms``: profiler device
time, L2 flushed before each call unless ``flush=False`` (``--no-flush``:
a layer's q, k, v and the plan's arrays are often still in L2);
``*_wall_ms``: what a user waits, synchronised, :func:`time_wall`):

* ``fwd_kernel_ms``: the forward kernel (``fused3s_fwd`` / ``fused3s_fwd8``);
  ``bwd_kernel_ms``: the backward's two passes (``fused3s_bwd`` /
  ``fused3s_bwd8``, memsets not included), from one forward + backward;
* ``api_fwd_wall_ms``, ``api_fb_wall_ms``: the public call on the prepared
  plan, forward alone and forward + backward (``torch.autograd.grad``);
* ``blocks``, ``mma_fwd``, ``nnz_per_block``, ``kv_rows``: the format's
  blocks (16 x 8 TCBs / 8 x 16 blocks), m16n8k16 invocations of one
  forward per head as the kernel runs them, non-zeros per block, K / V
  rows gathered; ``max_window_blocks_8``; ``plan_build_ms`` (eager, on the
  device, with the transpose);
* ``fwd_speedup``, ``bwd_speedup``, ``api_fb_speedup``: 16-row over 8-row;
  ``max_diff`` / ``max_grad_diff`` between the two plans' results;
* ``model_rows``: the format the cost model picks for the row's heads and
  head dim, ``auto_rows``: the one ``window_rows="auto"`` builds
  (:mod:`gt_fused3s.cost_model`).

:func:`run_rows8_model` (``--window-rows 8 --model-step``): the same two
plans under a Graph Transformer's captured training step.
"""
from __future__ import annotations

import warnings

import torch

from .. import cost_model
from .common import free_cuda_memory, log_stderr as log, short_error
from .kernel import (ALL_GRAPHS, QUICK_GRAPHS, REORDER_SETTINGS, _f, _host_ms, env_info, loaded_graphs,
                     setting_inputs, write_csv)
from .timing import kernel_time, time_wall


def _format_stats(plan, head_dim: int) -> dict:
    b = plan.bsb
    if plan.window_rows == 8:
        st = b.stats(head_dim)
        return {"blocks": st["num_tcbs"], "mma_fwd": st["mma_fwd"], "nnz_per_block": st["nnz_per_tcb_mean"],
                "kv_rows": st["kv_rows"]}
    st = b.stats(head_dim=head_dim, variants=False)
    return {"blocks": st["num_tcbs"], "mma_fwd": st["mma_fwd_kernel"], "nnz_per_block": st["nnz_per_tcb_mean"],
            "kv_rows": st["kv_rows"]}


def run_rows8(graphs=None, settings=None, *, quick: bool = False, out: str | None = None,
              flush: bool = True) -> list[dict]:
    """The side-by-side table of this module's docstring (a CUDA GPU)."""
    from .. import GraphPlan, fused3s_attention
    from ..plan import padded_head_dim
    from ..reference import default_scale

    device = torch.device("cuda")
    env = env_info()
    graphs = list(graphs or (QUICK_GRAPHS if quick else ALL_GRAPHS))
    settings = list(settings or REORDER_SETTINGS)
    log(f"# {env['gpu']} | torch {env['torch']} | CUDA {env['cuda']} | git {env['git_sha']} | window rows 16 vs 8"
        f" | L2 {'flushed' if flush else 'not flushed'} before each timed kernel")
    rows = []
    for gname, ei, n in loaded_graphs(graphs, device, log):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            builds = {sfx: _host_ms(lambda: GraphPlan.from_edge_index(ei, n, window_rows=r).prepare(1, 16),
                                    device, 1 if quick else 3) for sfx, r in (("", 16), ("_8", 8))}
            plans = {"": GraphPlan.from_edge_index(ei, n), "_8": GraphPlan.from_edge_index(ei, n, window_rows=8)}
        longest = plans["_8"].bsb.max_window_blocks()
        features = cost_model.format_features(ei, n)
        auto_rows = cost_model.choose_window_rows(features)
        note = "; ".join(sorted({str(w.message).split(":")[1].strip() for w in caught if "8-row" in str(w.message)}))
        log(f"[graph] {gname}: N={n} nnz={ei.size(1)} longest 8-row window {longest} blocks, plan build "
            f"{builds['']:.2f} -> {builds['_8']:.2f} ms")
        for sname in settings:
            D, H, dtype, (q, k, v, dout) = setting_inputs(n, sname, device)
            scale = default_scale(D)
            row = {**env, "graph": gname, "N": n, "nnz": ei.size(1), "setting": sname, "D": D, "H": H, "l2_flushed": flush,
                   "dtype": str(dtype).replace("torch.", ""), "max_window_blocks_8": longest,
                   "plan_build_ms": builds[""], "plan_build_ms_8": builds["_8"], "notes": note,
                   "model_rows": cost_model.choose_window_rows(features, H, D), "auto_rows": auto_rows}
            outs, grads = {}, {}
            for sfx, plan in plans.items():
                try:
                    plan.prepare(H, D)
                    row.update({k_ + sfx: v_ for k_, v_ in _format_stats(plan, padded_head_dim(D)).items()})
                    fwd_name = "fused3s_fwd8" if sfx else "fused3s_fwd_kernel"
                    bwd_name = "fused3s_bwd8" if sfx else "fused3s_bwd_kernel"
                    api = lambda: fused3s_attention(q, k, v, plan, scale)   # noqa: E731
                    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                    api_fb = lambda: torch.autograd.grad(   # noqa: E731
                        fused3s_attention(*leaves, plan, scale), leaves, dout)
                    outs[sfx] = api().float()
                    grads[sfx] = [g.float() for g in api_fb()]
                    row["fwd_kernel_ms" + sfx] = kernel_time(api, name=fwd_name, flush=flush)
                    row["bwd_kernel_ms" + sfx] = kernel_time(api_fb, name=bwd_name, flush=flush)
                    row["api_fwd_wall_ms" + sfx] = time_wall(api)["wall"]
                    row["api_fb_wall_ms" + sfx] = time_wall(api_fb)["wall"]
                except torch.cuda.OutOfMemoryError:
                    row["notes"] = (row["notes"] + f"; plan{sfx}: out of memory").lstrip("; ")
                except Exception as e:   # one failing graph must not stop the run
                    row["notes"] = (row["notes"] + f"; plan{sfx}: {short_error(e)}").lstrip("; ")
                finally:
                    api = api_fb = leaves = None
                    free_cuda_memory(device)
            if len(outs) == 2:
                row["max_diff"] = (outs[""] - outs["_8"]).abs().max().item() if n else 0.0
                row["max_grad_diff"] = max((a - b).abs().max().item() for a, b in zip(grads[""], grads["_8"]))
            for key in ("fwd_kernel_ms", "bwd_kernel_ms", "api_fb_wall_ms"):
                a, b = row.get(key), row.get(key + "_8")
                if a and b:
                    row[key.replace("_kernel_ms", "_speedup").replace("_wall_ms", "_speedup")] = a / b
            rows.append(row)
            log(format_rows8_row(row))
            if out:
                write_csv(rows, out)
            q = k = v = dout = outs = grads = None
            free_cuda_memory(device)
        plans = ei = None
        free_cuda_memory(device)
    log("")
    log(format_rows8_table(rows))
    return rows


def run_rows8_model(graphs=None, hiddens=(64, 128), *, out: str | None = None, layers: int = 10) -> list[dict]:
    """What the 8-row plan changes in a model: a ``layers``-block Graph
    Transformer training step (plain attention, 1 head, bf16 autocast:
    forward, MSE loss, every parameter's gradient) captured in a CUDA graph
    (:class:`~gt_fused3s.capture.CudaGraphRunner`), on a 16-row and an 8-row
    plan of each graph. Columns: ``step_ms`` (CUDA events over 50 replays),
    ``step_wall_ms`` (what a user waits for one replay, synchronised:
    :func:`time_wall`),
    ``attention_kernel_ms`` and ``kernel_ms`` (profiler: the fused3s
    kernels, all kernels of a step), ``loss``; ``_8`` the 8-row plan's;
    ``step_speedup``."""
    from .. import GraphPlan
    from ..capture import CudaGraphRunner
    from ..models import GraphTransformer

    device = torch.device("cuda")
    env = env_info()
    log(f"# {env['gpu']} | torch {env['torch']} | git {env['git_sha']} | {layers}-block GT training step, "
        f"captured, 16-row vs 8-row plan")
    rows = []
    for gname, ei, n in loaded_graphs(list(graphs or ("zinc", "molhiv", "peptides")), device, log):
        for hidden in hiddens:
            row = {**env, "graph": gname, "N": n, "nnz": ei.size(1), "hidden": hidden, "layers": layers}
            for sfx, window_rows in (("", 16), ("_8", 8)):
                torch.manual_seed(0)
                model = GraphTransformer(16, hidden, 1, num_layers=layers, heads=1).to(device).train()
                params = [p for p in model.parameters() if p.requires_grad]
                gen = torch.Generator(device=device).manual_seed(0)
                x = torch.randn(n, 16, generator=gen, device=device)
                y = torch.randn(n, 1, generator=gen, device=device)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)      # a hub's long 8-row window
                    plan = GraphPlan.from_edge_index(ei, n, window_rows=window_rows).prepare(1, hidden)

                def step():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        pred = model(x, None, graph=plan)
                    loss = (pred.float() - y).square().mean()
                    return (loss, *torch.autograd.grad(loss, params))
                runner = CudaGraphRunner(step)
                for _ in range(3):
                    got = runner()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(50):
                    runner()
                end.record()
                torch.cuda.synchronize()
                row["step_ms" + sfx] = start.elapsed_time(end) / 50
                row["step_wall_ms" + sfx] = time_wall(runner)["wall"]
                row["attention_kernel_ms" + sfx] = kernel_time(runner, name="fused3s", flush=False)
                row["kernel_ms" + sfx] = kernel_time(runner, name="", flush=False)
                row["loss" + sfx] = float(got[0].detach())
                model = plan = runner = got = None
                free_cuda_memory(device)
            row["step_speedup"] = row["step_ms"] / row["step_ms_8"]
            rows.append(row)
            log(f"[{gname} hidden {hidden}] step {row['step_ms']:.3f} -> {row['step_ms_8']:.3f} ms "
                f"(x{row['step_speedup']:.3f}; wall {row['step_wall_ms']:.3f} -> {row['step_wall_ms_8']:.3f}), attention kernels {row['attention_kernel_ms']:.3f} -> "
                f"{row['attention_kernel_ms_8']:.3f} of {row['kernel_ms']:.3f} -> {row['kernel_ms_8']:.3f} ms, "
                f"loss {row['loss']:.6f} / {row['loss_8']:.6f}")
            if out:
                write_csv(rows, out)
    return rows


def format_rows8_row(r: dict) -> str:
    return (f"[{r['graph']} {r['setting']}] blocks {r.get('blocks')} -> {r.get('blocks_8')}, MMA "
            f"{r.get('mma_fwd')} -> {r.get('mma_fwd_8')} | fwd kernel {_f(r, 'fwd_kernel_ms')} -> "
            f"{_f(r, 'fwd_kernel_ms_8')} ms, bwd {_f(r, 'bwd_kernel_ms')} -> {_f(r, 'bwd_kernel_ms_8')} | "
            f"call fwd+bwd {_f(r, 'api_fb_wall_ms')} -> {_f(r, 'api_fb_wall_ms_8')} ms | picked "
            f"{r.get('model_rows', '-')} (auto {r.get('auto_rows', '-')})"
            + (f" | {r['notes']}" if r.get("notes") else ""))


def format_rows8_table(rows: list[dict]) -> str:
    head = ("| graph | setting | blocks 16 / 8 | MMA 8 / 16 | fwd kernel us 16 / 8 | x | bwd kernel us 16 / 8 | x "
            "| call fwd+bwd wall ms 16 / 8 | x | picked: setting / auto |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        def us(k):
            return format(r[k] * 1e3, ".1f") if isinstance(r.get(k), (int, float)) else "-"
        mma = format(r["mma_fwd_8"] / r["mma_fwd"], ".2f") if r.get("mma_fwd") and r.get("mma_fwd_8") else "-"
        lines.append(f"| {r['graph']} | {r['setting']} | {r.get('blocks', '-')} / {r.get('blocks_8', '-')} | {mma} | "
                     f"{us('fwd_kernel_ms')} / {us('fwd_kernel_ms_8')} | {_f(r, 'fwd_speedup', '.2f')} | "
                     f"{us('bwd_kernel_ms')} / {us('bwd_kernel_ms_8')} | {_f(r, 'bwd_speedup', '.2f')} | "
                     f"{_f(r, 'api_fb_wall_ms', '.3f')} / {_f(r, 'api_fb_wall_ms_8', '.3f')} | "
                     f"{_f(r, 'api_fb_speedup', '.2f')} | {r.get('model_rows', '-')} / {r.get('auto_rows', '-')} |")
    return "\n".join(lines)


