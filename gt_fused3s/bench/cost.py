"""Fitting the plan's cost model on the GPU (issue 13, item 4):
``python scripts/bench_kernel.py --fit-cost-model``.

Both window formats' kernels (16 and 8 rows) are timed side by side on the
same q, k, v, dO (profiler device time, L2 flushed before each call) over
calibration graphs (the shared graphs, molecule batches of several sizes,
uniform and banded random graphs, a power-law graph) and held-out graphs the
fit never sees. :func:`gt_fused3s.cost_model.fit` fits the coefficients to
the calibration rows; the table then compares, per graph and setting, the
predicted and the measured times and whether the model picks the faster
format. The CSV holds one row per (graph, setting, format, pass) with the
builder's counts, so ``--fit-cost-model --from-csv CSV`` refits on the CPU.
"""
from __future__ import annotations

import csv
import math
import warnings

import torch

from .. import cost_model
from .common import free_cuda_memory, log_stderr as log
from .kernel import env_info, load_graph, loaded_graphs, setting_inputs, write_csv
from .timing import kernel_time

# name@batch: the first `batch` graphs of a collection; uniform:N:degree;
# banded:N:degree:width (sources within `width` ids of the destination)
CALIBRATION = ("zinc@64", "zinc@1024", "zinc@8192", "molhiv@1024", "molhiv@8192", "peptides@256",
               "peptides@1024", "cora", "citeseer", "pubmed", "github", "powerlaw200k",
               "uniform:100000:4", "uniform:100000:16", "uniform:30000:32", "banded:100000:8:64",
               "banded:100000:32:256")
HELD_OUT = ("zinc@4096", "molhiv@256", "peptides@4096", "uniform:300000:8", "banded:200000:16:128",
            "powerlaw1m")
COST_SETTINGS = ("d128h1fp16", "d64h8bf16", "d32h8bf16")
_COUNT_KEYS = ("windows", "blocks", "longest", "columns")


def generated_graph(spec: str, device) -> tuple[torch.Tensor, int]:
    """(edge_index, N) of a ``uniform:N:degree`` or ``banded:N:degree:width``
    spec, seeded (the same graph on every run)."""
    kind, *nums = spec.split(":")
    gen = torch.Generator(device="cpu").manual_seed(0)
    n, deg = int(nums[0]), int(nums[1])
    dst = torch.arange(n).repeat_interleave(deg)
    if kind == "uniform":
        src = torch.randint(0, n, (n * deg,), generator=gen)
    elif kind == "banded":
        width = int(nums[2])
        src = (dst + torch.randint(-width, width + 1, (n * deg,), generator=gen)).clamp(0, n - 1)
    else:
        raise ValueError(f"unknown graph spec {spec!r}")
    return torch.stack([src, dst]).to(device), n


def calibration_graph(spec: str, device) -> tuple[torch.Tensor, int]:
    if ":" in spec:
        return generated_graph(spec, device)
    name, _, batch = spec.partition("@")
    return load_graph(name, device, batch=int(batch) if batch else 1024)


def _flat(features: dict) -> dict:
    out = {"nodes": features["nodes"]}
    for rows in (16, 8):
        for side in ("graph", "transposed"):
            for k in _COUNT_KEYS:
                out[f"r{rows}_{side}_{k}"] = features[rows][side][k]
    return out


def _unflat(row: dict) -> dict:
    return {"nodes": int(row["nodes"]),
            **{rows: {side: {k: int(row[f"r{rows}_{side}_{k}"]) for k in _COUNT_KEYS}
                      for side in ("graph", "transposed")} for rows in (16, 8)}}


def measure(specs, settings, split: str, device, reps: int = 10) -> list[dict]:
    """One row per (graph, setting, format, pass): kernel ms and the counts."""
    from .. import GraphPlan, fused3s_attention
    from ..reference import default_scale

    rows = []
    for spec, ei, n in loaded_graphs(specs, device, log, load=calibration_graph):
        feats = cost_model.format_features(ei, n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)          # a hub's long 8-row window
            plans = {r: GraphPlan.from_edge_index(ei, n, window_rows=r) for r in (16, 8)}
        log(f"[graph] {spec}: N={n} E={ei.size(1)} blocks 16/8 {feats[16]['graph']['blocks']}/"
            f"{feats[8]['graph']['blocks']}, longest 8-row window {feats[8]['graph']['longest']}")
        for sname in settings:
            D, H, dtype, (q, k, v, dout) = setting_inputs(n, sname, device)
            scale = default_scale(D)
            for r, plan in plans.items():
                plan.prepare(H, D)
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                fwd = lambda: fused3s_attention(q, k, v, plan, scale)   # noqa: E731
                fb = lambda: torch.autograd.grad(fused3s_attention(*leaves, plan, scale), leaves, dout)  # noqa: E731
                names = {"fwd": "fused3s_fwd8" if r == 8 else "fused3s_fwd_kernel",
                         "bwd": "fused3s_bwd8" if r == 8 else "fused3s_bwd_kernel"}
                for pass_, fn in (("fwd", fwd), ("bwd", fb)):
                    ms = kernel_time(fn, name=names[pass_], reps=reps, flush=True)
                    rows.append({"split": split, "graph": spec, "setting": sname, "heads": H, "head_dim": D,
                                 "dtype": str(dtype).replace("torch.", ""), "rows": r, "pass": pass_,
                                 "ms": ms, **_flat(feats)})
                leaves = fwd = fb = None
            t = {(r_["rows"], r_["pass"]): r_["ms"] for r_ in rows[-4:]}
            log(f"  {sname}: fwd 16/8 {t[(16, 'fwd')]}/{t[(8, 'fwd')]} ms, bwd {t[(16, 'bwd')]}/{t[(8, 'bwd')]} ms")
            q = k = v = dout = None
        plans = ei = None
        free_cuda_memory(device)
    return rows


def samples_of(rows: list[dict]) -> list[dict]:
    """The rows with a time, as :func:`gt_fused3s.cost_model.fit` takes them
    (each keeps its split, graph and setting)."""
    return [{"features": _unflat(r), "heads": int(r["heads"]), "head_dim": int(r["head_dim"]),
             "rows": int(r["rows"]), "pass": r["pass"], "ms": float(r["ms"]),
             "key": (r["split"], r["graph"], r["setting"])}
            for r in rows if r.get("ms") not in (None, "", "None")]


def read_csv(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def evaluate(rows: list[dict], coef: dict) -> list[dict]:
    """Per (graph, setting): measured and predicted fwd + bwd ms of both
    formats, the faster one and the one the model picks."""
    by = {}
    for s in samples_of(rows):
        by.setdefault(s["key"], {"features": s["features"], "heads": s["heads"], "head_dim": s["head_dim"]})
        by[s["key"]][(s["rows"], s["pass"])] = s["ms"]
    out = []
    for (split, graph, setting), d in by.items():
        if not all((r, p) in d for r in (16, 8) for p in ("fwd", "bwd")):
            continue
        meas = {r: d[(r, "fwd")] + d[(r, "bwd")] for r in (16, 8)}
        pred = {r: cost_model.predict(d["features"], r, d["heads"], d["head_dim"], coefficients=coef)
                for r in (16, 8)}
        pick = cost_model.choose_window_rows(d["features"], d["heads"], d["head_dim"], coefficients=coef)
        best = 8 if meas[8] < meas[16] else 16
        out.append({"split": split, "graph": graph, "setting": setting, "ms16": meas[16], "ms8": meas[8],
                    "pred16": pred[16], "pred8": pred[8], "best": best, "pick": pick,
                    "loss": meas[pick] / min(meas.values())})
    return out


def format_evaluation(ev: list[dict]) -> str:
    lines = ["| split | graph | setting | fwd+bwd ms 16 / 8 (measured) | predicted 16 / 8 | faster | picked "
             "| picked / fastest |", "|" + "---|" * 8]
    for e in ev:
        lines.append(f"| {e['split']} | {e['graph']} | {e['setting']} | {e['ms16']:.4f} / {e['ms8']:.4f} | "
                     f"{e['pred16']:.4f} / {e['pred8']:.4f} | {e['best']} | {e['pick']} | {e['loss']:.3f} |")
    for split in sorted({e["split"] for e in ev}):
        sel = [e for e in ev if e["split"] == split]
        errs = [abs(math.log(e[f"pred{r}"] / e[f"ms{r}"])) for e in sel for r in (16, 8)]
        lines.append(f"{split}: {sum(e['best'] == e['pick'] for e in sel)}/{len(sel)} picks the faster format; "
                     f"worst pick {max(e['loss'] for e in sel):.3f}x the faster; prediction error "
                     f"(geometric) {math.exp(sum(errs) / len(errs)):.3f}x, worst {math.exp(max(errs)):.3f}x")
    return "\n".join(lines)


def format_coefficients(coef: dict, gpu: str, git: str) -> str:
    def vec(x):
        return "None" if x is None else "[" + ", ".join(f"{c:.6g}" for c in x) + "]"
    return ("COEFFICIENTS: dict = {\n"
            f"    \"gpu\": {gpu!r},\n    \"git\": {git!r},\n    \"settings\": {sorted(coef['settings'])!r},\n"
            + "".join(f"    {r}: {{\"fwd\": {vec(coef[r]['fwd'])}, \"bwd\": {vec(coef[r]['bwd'])}}},\n"
                      for r in (16, 8))
            + "}")


def run_fit(*, out: str | None = None, from_csv: str | None = None, reps: int = 10) -> dict:
    """Measure (or read ``from_csv``), fit on the calibration rows, print the
    evaluation and the coefficients (to paste into ``cost_model.py``)."""
    if from_csv:
        rows = read_csv(from_csv)
        gpu, git = rows[0].get("gpu", ""), rows[0].get("git_sha", "")
    else:
        device = torch.device("cuda")
        env = env_info()
        gpu, git = env["gpu"], env["git_sha"]
        log(f"# {gpu} | torch {env['torch']} | git {git} | cost model: 16-row vs 8-row kernels, L2 flushed")
        rows = measure(CALIBRATION, COST_SETTINGS, "calibration", device, reps)
        rows += measure(HELD_OUT, COST_SETTINGS, "held-out", device, reps)
        rows = [{"gpu": gpu, "git_sha": git, **r} for r in rows]
        if out:
            write_csv(rows, out)
    coef = cost_model.fit(samples_of([r for r in rows if r["split"] == "calibration"]))
    log(format_evaluation(evaluate(rows, coef)))
    print(format_coefficients(coef, gpu, git))
    return coef
