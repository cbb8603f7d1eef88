"""`retrofit bench attention`: time and peak memory of SDPA, naive p-softmax and retrofit's attention kernels.

    retrofit bench attention --seq 1024,4096,16384 --heads 8 --dim 64 --out bench-attention.json
    retrofit bench attention --seq 65536 --forward-only --impl sdpa,psoftmax      # the long forward check
    retrofit bench attention --device cuda --dtype bfloat16                       # adds the Triton kernel

Causal self-attention, q/k/v (batch, heads, T, dim) from a fixed seed. Implementations: `sdpa`
(F.scaled_dot_product_attention, the baseline), `naive` (p-softmax materializing the T x T weights),
`psoftmax` (retrofit's PyTorch path: blockwise on CPU for p != 1), `triton` (retrofit's fused CUDA
kernel, when Triton is importable), `ssmax` and `softmax1` (retrofit, default dispatch), `rowwise` (the kernel of
the norms that define only their weights, weights_attention, with sigmoid attention's sigmoid(s - log n)).

Every (implementation, T) runs in a fresh child process: first a small warm-up (pages in code, compiles
Triton), then peak memory of one forward and one forward+backward, then the timings of --repeats runs,
each alternating with an SDPA run on the same inputs: on CPU the best run (on a shared machine the best
run is the least disturbed; host clock), on CUDA the median (CUDA events around each run, the device to
itself). The "/ sdpa" time columns divide by that paired SDPA time, taken under the same conditions (the
sdpa rows are SDPA's own children; the memory ratio uses them). Peak memory on
CPU is the resident-set high-water mark above the level just before the call (retrofit.memory: Linux
resets the mark through /proc/self/clear_refs; elsewhere the resident set is sampled); on CUDA it is
the allocator's peak above what was allocated before. `naive` is skipped where its T x T tensors
would not fit in half the available memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..errors import RetrofitError
from ..io.atomic import atomic_write_text

IMPLS = {  # name -> table label
    "sdpa": "sdpa",
    "naive": "naive p-softmax",
    "psoftmax": "retrofit p-softmax",
    "triton": "triton p-softmax",
    "ssmax": "ssmax",
    "softmax1": "softmax+1",
    "rowwise": "row-wise weights",  # weights_attention, the weights-only norms' kernel, with sigmoid(s - log n)
}
DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq", default="1024,4096,16384", help="comma list of sequence lengths T")
    parser.add_argument("--heads", type=int, default=8, help="attention heads H")
    parser.add_argument("--dim", type=int, default=64, help="head dimension D")
    parser.add_argument("--batch", type=int, default=1, help="batch size B")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--p", type=float, default=2.0, help="p of p-softmax (naive, psoftmax, triton)")
    parser.add_argument("--impl", default=",".join(IMPLS), help="comma list of: " + ", ".join(IMPLS)
                        + " (triton only with CUDA and Triton)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the best is reported")
    parser.add_argument("--forward-only", action="store_true", help="skip forward+backward")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per configuration")
    parser.add_argument("--out", default="bench-attention.json", help="where to write the JSON results")


# ---------------------------------------------------------------- the child: one configuration


def label(impl: str) -> str:
    """The table's name for an implementation: IMPLS's, or `norm@backend` (a norm on one forced backend)."""
    norm, _, backend = impl.partition("@")
    return f"{IMPLS[norm]} [{backend}]" if backend else IMPLS[impl]


def _function(impl: str, p: float, heads: int, device: str):
    """(q, k, v) -> out for one implementation; the kernels' extra parameters take grads like a model's would.
    `norm@backend` (psoftmax@cuda_flash, ssmax@flex, ...) runs that norm on that backend, forced."""
    import torch
    import torch.nn.functional as F

    import retrofit.kernels as K

    impl, _, backend = impl.partition("@")
    forced = backend or {"triton": "triton", "psoftmax": None if device == "cpu" else "blockwise"}.get(impl)
    extra = torch.full((heads,), 0.5, device=device, requires_grad=True)  # SSMax s / softmax+1 sink
    fn = {
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "naive": lambda q, k, v: naive_psoftmax(q, k, v, p),
        "psoftmax": lambda q, k, v: K.psoftmax_attention(q, k, v, p),
        "triton": lambda q, k, v: K.psoftmax_attention(q, k, v, p),
        "ssmax": lambda q, k, v: K.ssmax_attention(q, k, v, extra),
        "softmax1": lambda q, k, v: K.softmax1_attention(q, k, v, extra),
        "rowwise": lambda q, k, v: K.weights_attention(q, k, v, _sigmoid_rows),
    }[impl]

    def call(q, k, v):  # the backward runs on the backend the forward chose, wherever it is called
        with K.force_backend(forced):
            return fn(q, k, v)
    return call


def _sigmoid_rows(scores, visible, n):
    """Sigmoid attention's weights, sigmoid(s - log n): what `rowwise` times (a formula of one elementwise op)."""
    import torch

    return torch.sigmoid(scores - torch.log(n))


def naive_psoftmax(q, k, v, p: float):
    """The textbook formula, T x T: weights exp(s - m) / ||exp(s - m)||_p, causal."""
    import torch

    s = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, H, T, T)
    T = q.shape[2]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return ((e / e.pow(p).sum(-1, keepdim=True).pow(1.0 / p)) @ v.float()).to(q.dtype)


def _added_mb(device: str, fn) -> float:
    """Peak memory (MB) that a call adds above what was in use before it."""
    from ..memory import PeakMemory

    with PeakMemory(device) as memory:
        fn()
    return memory.added_mb


def _runner(device: str):
    """run(fn) -> seconds of one call: CUDA events around it on CUDA, the host clock (after a sync) elsewhere."""
    import torch

    if device != "cuda":
        def host(fn):
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        return host

    def events(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    return events


def _timings(config: dict, impls: dict, qkv, grad, row: dict) -> None:
    """row[fwd_ms], row[fwd_bwd_ms] (and their paired SDPA times): --repeats runs alternating SDPA and the
    implementation on the same inputs; the best (CPU) or the median (CUDA) of them."""
    import statistics

    clock = _runner(config["device"])
    pick = statistics.median if config["device"] == "cuda" else min
    for name, run in [("fwd", _forward)] + ([] if config["forward_only"] else [("fwd_bwd", _forward_backward)]):
        times = {key: [] for key in impls}
        for _ in range(config["repeats"]):
            for key, f in reversed(impls.items()):  # sdpa first, then the implementation
                times[key].append(clock(lambda run=run, f=f: run(f, qkv, grad, config["device"])))
            if sum(times["impl"]) > 60:  # slow configurations: fewer repeats
                break
        row[f"{name}_ms"] = round(pick(times["impl"]) * 1000, 3)
        row[f"{name}_all_ms"] = [round(t * 1000, 3) for t in times["impl"]]
        if "sdpa" in times:
            row[f"{name}_sdpa_ms"] = round(pick(times["sdpa"]) * 1000, 3)  # the paired baseline


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _forward(fn, qkv, grad, device):
    import torch

    with torch.no_grad():
        fn(*qkv)
    _sync(device)


def _forward_backward(fn, qkv, grad, device):
    for x in qkv:
        x.grad = None
    fn(*qkv).backward(grad)
    _sync(device)


def _tensors(config: dict, length: int, batch: int | None = None, seed: int = 0):
    """q, k, v (requiring grad) and a grad_out of (batch, heads, length, dim), from a fixed seed."""
    import torch

    device, dtype = config["device"], getattr(torch, config["dtype"])
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (batch or config["batch"], config["heads"], length, config["dim"])
    qkv = [torch.randn(shape, generator=g, device=device, dtype=dtype).requires_grad_() for _ in range(3)]
    return qkv, torch.randn(shape, generator=g, device=device, dtype=dtype)


def measure(config: dict) -> dict:
    """Run one configuration in this process: warm up, peak memory, then timings. Returns the result row.

    The timed runs alternate with SDPA on the same inputs (sdpa, impl, sdpa, impl, ...), so the ratio
    to SDPA compares runs made under the same load: on a shared machine, separate processes minutes
    apart can differ by 2x for the same kernel.
    """
    from ..memory import PeakMemory

    device, T = config["device"], config["seq"]
    impls = {"impl": _function(config["impl"], config["p"], config["heads"], device)}
    if config["impl"] != "sdpa":
        impls["sdpa"] = _function("sdpa", config["p"], config["heads"], device)
    small, small_grad = _tensors(config, min(T, 256), batch=1)  # one shape at every T: FlexAttention compiles once
    for fn in impls.values():
        _forward_backward(fn, small, small_grad, device)  # warm-up: code paged in, kernels compiled
    qkv, grad = _tensors(config, T)
    if device == "cuda":  # compiled kernels specialize on the shape (FlexAttention): compile before measuring
        for fn in impls.values():
            _forward_backward(fn, qkv, grad, device)
    fn = impls["impl"]
    row = dict(config, memory_kind=PeakMemory(device).method, timing="median, CUDA events" if device == "cuda"
               else "best, host clock", fwd_peak_mb=round(_added_mb(device, lambda: _forward(fn, qkv, grad, device)),
                                                           1))
    if not config["forward_only"]:
        row["fwd_bwd_peak_mb"] = round(_added_mb(device, lambda: _forward_backward(fn, qkv, grad, device)), 1)
    _timings(config, impls, qkv, grad, row)
    return row


# ---------------------------------------------------------------- the parent: plan, children, table


def _available_mb(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0] / 2**20
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 1024
    except (OSError, StopIteration):
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**20


def _plan(args) -> tuple[list[int], list[str]]:
    try:
        seqs = [int(s) for s in args.seq.split(",") if s.strip()]
    except ValueError:
        raise RetrofitError(f"--seq must be a comma list of integers, like 1024,4096; got {args.seq!r}") from None
    impls = [s.strip() for s in args.impl.split(",") if s.strip()]
    unknown = [s for s in impls if s.partition("@")[0] not in IMPLS]
    if unknown or not impls:
        raise RetrofitError(f"unknown --impl {unknown or args.impl!r}: choose from {', '.join(IMPLS)}")
    if not seqs or min(seqs) < 1 or args.heads < 1 or args.dim < 1 or args.batch < 1 or args.repeats < 1:
        raise RetrofitError("--seq, --heads, --dim, --batch and --repeats must be positive")
    if not args.p > 0:
        raise RetrofitError(f"--p must be > 0; got {args.p}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RetrofitError("--device cuda but CUDA is not available here: use --device cpu")
        import retrofit.kernels as K

        if K.triton_backend() is None:
            impls = [s for s in impls if s != "triton"]
    else:
        impls = [s for s in impls if s != "triton"]  # the Triton kernel is CUDA-only
    return seqs, impls


def _child(config: dict, timeout: int) -> dict:
    """measure(config) in a fresh interpreter that imports only torch, retrofit.kernels and this module."""
    root = str(Path(__file__).resolve().parents[2])
    # retrofit/__init__ imports the model stack (transformers: seconds per child); the kernels require none of it.
    code = ("import json, sys, types; pkg = types.ModuleType('retrofit'); pkg.__path__ = [sys.argv[1] + '/retrofit'];"
            " sys.modules['retrofit'] = pkg; from retrofit.bench.attention import measure;"
            " print(json.dumps(measure(json.loads(sys.argv[2]))))")
    try:
        done = subprocess.run([sys.executable, "-c", code, root, json.dumps(config)], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(config, error=f"over --timeout {timeout} s")
    if done.returncode != 0:  # e.g. killed for memory: a result, not a crash of the benchmark
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return dict(config, error=last[-200:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ratio(row, base, key):
    """row[key] over SDPA's: the paired SDPA time from the same child when there is one, else the sdpa row's."""
    paired = key.replace("_ms", "_sdpa_ms")
    denominator = row.get(paired) if key.endswith("_ms") and row.get(paired) else (base or {}).get(key)
    if row.get(key) is None or not denominator:
        return None
    return f"{row[key] / denominator:.2f}x"


def _table(rows: list[dict]) -> str:
    from ..evaluate.report import markdown_table

    header = ["implementation", "T", "fwd ms", "fwd / sdpa", "fwd+bwd ms", "fwd+bwd / sdpa", "peak MB fwd",
              "peak MB fwd+bwd", "peak / sdpa"]
    lines = []
    for row in rows:
        base = next((r for r in rows if r["impl"] == "sdpa" and r["seq"] == row["seq"] and "error" not in r), None)
        mem_key = "fwd_peak_mb" if row.get("forward_only") else "fwd_bwd_peak_mb"
        note = row.get("skipped") or row.get("error")
        lines.append([label(row["impl"]), row["seq"], row.get("fwd_ms", note), _ratio(row, base, "fwd_ms"),
                      row.get("fwd_bwd_ms"), _ratio(row, base, "fwd_bwd_ms"), row.get("fwd_peak_mb"),
                      row.get("fwd_bwd_peak_mb"), _ratio(row, base, mem_key)])
    return markdown_table(header, lines)


def run(args: argparse.Namespace) -> int:
    seqs, impls = _plan(args)
    import torch

    available = _available_mb(args.device)
    load_at_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # a shared machine's other work
    base = dict(heads=args.heads, dim=args.dim, batch=args.batch, dtype=args.dtype, device=args.device, p=args.p,
                repeats=args.repeats, forward_only=args.forward_only)
    rows = []
    for T in seqs:
        for impl in impls:
            config = dict(base, impl=impl, seq=T)
            if impl == "naive":
                weights_mb = args.batch * args.heads * T * T * 4 / 2**20  # one fp32 (B, H, T, T) tensor
                need = weights_mb * (3 if args.forward_only else 6)  # logits, exp, weights (+ their grads)
                if need > available / 2:
                    rows.append(dict(config, skipped=f"skipped: needs ~{need / 1024:.0f} GB"))
                    continue
            print(f"bench attention: {label(impl)}, T={T} (fresh process) ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            rows.append(_child(config, args.timeout))
            print(f"  done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    load = (load_at_start, os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
    env = dict(torch=torch.__version__, threads=torch.get_num_threads(), cpus=os.cpu_count(), load_average=load,
               memory_kind=next((r["memory_kind"] for r in rows if "memory_kind" in r), None))
    print(f"causal attention, B={args.batch} H={args.heads} D={args.dim} {args.dtype} on {args.device}, p={args.p}; "
          f"torch {env['torch']}, {env['threads']} threads, load average {load[0]} -> {load[1]} (start -> end); "
          f"memory: {env['memory_kind']}")
    print(_table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps({"benchmark": "attention", "environment": env, "results": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0
