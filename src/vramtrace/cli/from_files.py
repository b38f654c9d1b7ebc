"""`--from FILE`: the settings of training config files (vramtrace.sources) as the command's options, under the
options typed on the command line (click's parameter source)."""

from __future__ import annotations

from types import SimpleNamespace

import typer
from rich.console import Console

from ..errors import UsageError

# RunSpec fields whose command-line parameter has another name
_PARAM_OF_FIELD = {"compile": "compile_model", "deepspeed_config": "deepspeed"}
# the CLI's text form of a RunSpec value: tuples comma-joined (--lora-targets), bools as true/false for the options
# that take text (--reshard-after-forward, --use-cache)
_TEXT_FIELDS = ("reshard_after_forward", "use_cache")


def _typed(ctx: typer.Context, name: str) -> bool:
    """Whether the option `name` was given on the command line (click's ParameterSource, by member name)."""
    return getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"


def apply_sources(ctx: typer.Context, opts: SimpleNamespace) -> None:
    """Read `opts.from_files` and set the options they give that the command line did not: `opts`' attributes,
    and `opts.source_fields` for RunSpec fields without an option here; `opts.sources` and
    `opts.source_warnings` for the report. Prints each warning once on stderr. The model comes from the files
    when MODEL is not given. Raises UsageError without MODEL and no file naming one (or without --seq and no
    file giving it: TrainingArguments and accelerate files hold neither), and for a file `read_source` refuses."""
    opts.source_fields, opts.sources, opts.source_warnings = {}, (), ()
    if not opts.from_files:
        if not opts.model:
            raise UsageError("Missing argument 'model'. (see vramtrace --help)")
        return
    from ..sources import merge_sources, read_source, target_of
    from ..spec import RUN_SPEC_FIELDS

    sources = [read_source(path, target_of(opts.device, opts.gpu)) for path in opts.from_files]
    params = {p.name for p in ctx.command.params}
    given = {field: True for field in RUN_SPEC_FIELDS if _PARAM_OF_FIELD.get(field, field) in params
             and _typed(ctx, _PARAM_OF_FIELD.get(field, field))}
    if opts.model:
        given["model"] = True
    kwargs, entries, warnings = merge_sources(sources, given)
    missing = [name for name, absent in (("MODEL", not opts.model and "model" not in kwargs),
                                         ("--seq", opts.seq is None and "seq" not in kwargs)) if absent]
    if missing:
        raise UsageError(f"the --from files give no {' and no '.join(missing)} (TrainingArguments and accelerate "
                         f"files hold neither): add {' and '.join(missing)} on the command line")
    for field, value in kwargs.items():
        if field in given:  # typed on the command line: opts holds it already
            continue
        if field == "model":
            opts.model = [value]
            continue
        param = _PARAM_OF_FIELD.get(field, field)
        if param not in params:
            opts.source_fields[field] = value
        elif isinstance(value, tuple):
            setattr(opts, param, ",".join(value))
        elif field in _TEXT_FIELDS:
            setattr(opts, param, "true" if value else "false")
        else:
            setattr(opts, param, value)
    opts.sources = entries
    opts.source_warnings = warnings
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    for line in opts.source_warnings:
        err.print(f"warning: {line}", markup=False)



# a ds_config's values -> the option they set when the command line does not (`apply_deepspeed_config`)
_DS_OPTIONS = (("stage", "zero"), ("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_param"),
               ("micro_batch", "batch"), ("grad_accum", "grad_accum"))
_DS_PRECISIONS = {"bf16": "bf16-mixed", "fp16": "fp16-mixed", "fp32": "fp32"}  # DeepSpeed's: fp32 masters


def apply_deepspeed_config(ctx: typer.Context, opts: SimpleNamespace) -> None:
    """`--deepspeed FILE`: the ZeRO stage, offload devices, micro-batch, accumulation and precision the file fixes
    (sources/deepspeed.py `read_ds_config`; "auto" fixes nothing) set the options the command line did not give.
    A precision the command line gives that differs from the file's wins, with a warning in the report; a stage,
    batch or accumulation that differs is refused by the spec (spec.py `_match_ds_config`). Raises UsageError for a
    file `read_ds_config` refuses."""
    if not getattr(opts, "deepspeed", None):
        return
    from ..sources.deepspeed import read_ds_config

    ds = read_ds_config(opts.deepspeed)
    pairs = [*((getattr(ds, field), option) for field, option in _DS_OPTIONS),
             (_DS_PRECISIONS.get(ds.precision), "precision")]
    warnings = []
    for value, option in pairs:
        if value is None:
            continue
        if not _typed(ctx, option):
            setattr(opts, option, value)
        elif str(getattr(opts, option)) != str(value):
            warnings.append(f"--deepspeed {ds.path} sets {option.replace('_', '-')} {value}; "
                            f"--{option.replace('_', '-')} {getattr(opts, option)} used")
    opts.source_warnings = tuple(opts.source_warnings) + tuple(warnings)
