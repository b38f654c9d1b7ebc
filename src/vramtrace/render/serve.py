"""Terminal rendering of `vramtrace serve`'s answer (the dict of `vramtrace.serve.plan`), term by term."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..units import format_bytes


def render_serve(r: dict, console: Console, model: str) -> None:
    """The verdict (blocks, concurrency, the longest max_model_len), then the budget and the KV page, each term
    with the vLLM rule it follows."""
    L = r["max_model_len"]
    console.print(f"[bold]{escape(model)}[/] served by a paged-attention server on {escape(r['gpu'])} "
                  f"({format_bytes(r['total_bytes'])}), max_model_len {L:,}, following {escape(r['vllm'])}")
    if r["fits_one_request"]:
        console.print(f"KV cache: [bold magenta]{r['num_blocks']:,} blocks[/] of {r['block_size']} tokens "
                      f"({r['kv_cache_tokens']:,} tokens); maximum concurrency for {L:,} tokens per request: "
                      f"[bold magenta]{r['max_concurrency']:.2f}x[/]")
    else:
        console.print(f"[bold red]Does not serve one request of {L:,} tokens[/]: "
                      f"{format_bytes(max(r['available_kv_bytes'], 0))} for the KV cache, "
                      f"{format_bytes(r['blocks_per_request'] * r['bytes_per_block'])} needed")
    console.print(f"Longest max_model_len one request fits: {r['longest_max_model_len']:,} tokens"
                  + (f" (the KV budget allows {r['longest_by_kv_bytes']:,}; the model's max_position_embeddings "
                     f"is {r['model_max_position_embeddings']:,})"
                     if r["longest_by_kv_bytes"] != r["longest_max_model_len"] else ""))
    budget = Table(title="The KV budget (vllm/v1/worker/gpu_worker.py::Worker.determine_available_memory)",
                   title_justify="left")
    budget.add_column("term")
    budget.add_column("bytes", justify="right")
    budget.add_column("rule")
    rows = [
        ("total (cudaMemGetInfo)", r["total_bytes"], f"the {r['gpu']} preset"),
        (f"requested = total × {r['gpu_memory_utilization']}", r["requested_bytes"],
         "ceil(total × gpu_memory_utilization): v1/worker/utils.py::request_memory"),
        ("− weights", r["weights_bytes"], "traced (parameters on the CUDA target, 512-byte blocks)"),
        ("− the profile run's peak beyond the weights", r["activation_peak_bytes"],
         f"traced: {r['max_num_batched_tokens']:,} tokens as {r['max_num_seqs']:,} requests, logits at each "
         f"request's last token, the dummy sampler, the runner's buffers; peak at {r['profile_peak_at']}"),
        ("− non-PyTorch memory", r["non_torch_bytes"], "assumed (vLLM logs: 0.16-0.20 GiB); --non-torch-memory"),
        ("− CUDA graph estimate", r["cudagraph_bytes"],
         "0: --enforce-eager" if r["enforce_eager"] else
         "assumed (vLLM logs: 0.17-0.36 GiB); --cudagraph-memory, or --enforce-eager"),
        ("= available for the KV cache", r["available_kv_bytes"], "requested − non_kv − CUDA graphs"),
    ]
    for term, n, rule in rows:
        budget.add_row(term, f"{format_bytes(n, signed=n < 0)}", escape(rule))
    console.print(budget)
    kv = Table(title="The KV cache (v1/kv_cache_interface.py::AttentionSpec.page_size_bytes, "
                     "v1/core/kv_cache_planning.py)", title_justify="left")
    kv.add_column("term")
    kv.add_column("value", justify="right")
    kv.add_column("rule")
    kv_rows = [
        ("page (one layer, one block)", format_bytes(r["page_bytes"]),
         f"2 × {r['block_size']} tokens × {r['kv_heads_per_rank']} KV heads × {r['head_size']} × "
         f"{r['kv_dtype_bytes']} B ({r['kv_cache_dtype']})"),
        ("bytes per block", format_bytes(r["bytes_per_block"]), f"{r['kv_layers']} layers × page"),
        ("KV bytes per token", format_bytes(r["kv_bytes_per_token"]), "bytes per block / block size"),
        ("blocks", f"{r['num_blocks']:,}", "available // bytes per block (block 0 is the null block)"),
        ("blocks per request", f"{r['blocks_per_request']:,}", f"cdiv({L:,}, {r['block_size']})"),
        ("maximum concurrency", f"{r['max_concurrency']:.2f}x", "blocks / blocks per request"),
        ("KV cache tokens", f"{r['kv_cache_tokens']:,}", "int(concurrency × max_model_len)"),
    ]
    for row in kv_rows:
        kv.add_row(*(escape(x) for x in row))
    console.print(kv)
