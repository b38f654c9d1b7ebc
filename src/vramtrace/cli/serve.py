"""`vramtrace serve MODEL ...`: the KV blocks and concurrency of a paged-attention server (vramtrace.serve)."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console

from ..gpus import GPU_PRESETS


def serve_command(
    model: str = typer.Argument(..., help="Hub id, bundled id, local directory or config.json of a causal LM"),
    gpu: str = typer.Option("H100-80GB", "--gpu", help=f"target GPU: {'|'.join(p.name for p in GPU_PRESETS.values())}"),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="any device's total instead, e.g. 48GiB"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="tokens per request (default: the "
                                                "config's max_position_embeddings, as vLLM derives it)"),
    utilization: float = typer.Option(0.92, "--gpu-memory-utilization", help="vLLM's share of the GPU (0.92 in "
                                      "vLLM 0.33; 0.9 before 0.28)"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel size: the figures are per rank (the profile run traced "
                           "under the model's own TP plan)"),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="auto (the weights' dtype) | fp8"),
    block_size: int = typer.Option(16, "--block-size", help="tokens per KV block"),
    max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens",
                                                         help="default: vLLM's for the GPU's memory"),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", help="default: vLLM's for the GPU's memory"),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="no CUDA graphs (no graph memory estimate)"),
    non_torch: str = typer.Option("256MiB", "--non-torch-memory", help="non-PyTorch memory growth vLLM measures "
                                  "(NCCL, attention workspaces)"),
    cudagraph: str = typer.Option("512MiB", "--cudagraph-memory", help="vLLM's CUDA graph memory estimate"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="allow the model's own code"),
    json_path: Optional[str] = typer.Option(None, "--json", help="write the JSON answer here ('-': stdout)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no terminal report"),
    debug: bool = typer.Option(False, "--debug", help="show the traceback of an error"),
) -> None:
    """`vramtrace serve MODEL --gpu G --max-model-len L`: the KV blocks and the maximum concurrency a
    paged-attention server (vLLM 0.33) finds on that GPU, each term of its computation shown."""
    from ..render.json_report import write_json
    from ..render.serve import render_serve
    from ..serve import ServeSpec, analyze_serve
    from ..units import parse_bytes

    spec = ServeSpec(model, gpu=gpu, max_model_len=max_model_len, gpu_memory_utilization=utilization, tp=tp,
                     kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                     max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                     enforce_eager=enforce_eager, non_torch_bytes=parse_bytes(non_torch, "--non-torch-memory"),
                     cudagraph_bytes=parse_bytes(cudagraph, "--cudagraph-memory"),
                     gpu_memory_bytes=parse_bytes(gpu_memory, "--gpu-memory") if gpu_memory else None,
                     trust_remote_code=trust_remote_code)
    err = Console(stderr=True)
    with err.status("serve", spinner="dots") as status:
        result = analyze_serve(spec, progress=lambda msg: status.update(f"serve: {msg}"))
    if not quiet and json_path != "-":
        render_serve(result, Console(), model)
    if json_path is not None:
        write_json({"model": model, **result}, json_path)


