"""The workload layer: requests and traces, trace files, generators and statistics.

Public names: :class:`Request`, :class:`Trace`, :func:`load_trace`,
:func:`write_trace`, :class:`TraceFormatError`, :func:`generate`, :data:`GENERATOR_KINDS`,
:func:`resolve_workload`, :func:`shared_trace_path`. Statistics: :mod:`traces.stats`.
"""

from traces.formats import TraceFormatError
from traces.generators import GENERATOR_KINDS, generate
from traces.io import load_trace, write_trace
from traces.request import Request, Trace, synthesise_tokens
from traces.workload import SHARED_TRACES, resolve_workload, shared_trace_path

__all__ = [
    "GENERATOR_KINDS", "SHARED_TRACES", "Request", "Trace", "TraceFormatError", "generate", "load_trace",
    "resolve_workload", "shared_trace_path", "synthesise_tokens", "write_trace",
]
