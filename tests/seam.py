"""The one internal seam tests use when a MemoryReport is not enough (issue 40): `vramtrace.pipeline.trace_session`,
the context every `analyze` opens (the config and the run's precision resolved, the heap frozen). Tests that need
the recording itself (its ops and storages, the storage table, timelines) or the model built on meta go through
these helpers, never through the tracer's resolve/load steps or a private name."""

from __future__ import annotations

from vramtrace import RunSpec
from vramtrace.pipeline import trace_session


def loaded_model(spec: RunSpec):
    """The `tracer.building.LoadedModel` of `spec`, built on meta as `analyze` builds it."""
    with trace_session(spec) as session:
        return session.load(session.spec)


def step_tables(spec: RunSpec):
    """The `tables.StepTables` of `spec`'s step as `analyze` traces it (the recording `.traced`, the storage
    table `.table`, `.timeline()`, `.peaks()`)."""
    with trace_session(spec) as session:
        return session.trace(session.spec).tables


def recording(spec: RunSpec, **options):
    """The `tracer.trace.TracedGraph` of `spec`'s step, traced with `trace_step`'s `options` (`replay_steady`,
    `rebuild_decode`, `keep_args`) on a model built as `analyze` builds it."""
    from vramtrace.tracer.trace import trace_step

    with trace_session(spec) as session:
        return trace_step(session.spec, session.load(session.spec), **options)
