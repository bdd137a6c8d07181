from collections.abc import Sequence

from _typeshed import ReadableBuffer

SOURCE_HASH: str
"""SHA-256 of the C source this module was compiled from (setup.py's ``source_hash``)."""

# One job: (start, end, payload address, payload nbytes) of a chunk of the plan.
_RowJob = tuple[int, int, int, int]

def gather_rows(
    table: ReadableBuffer,
    index: Sequence[ReadableBuffer],
    jobs: Sequence[_RowJob],
    layer: int,
    skip: ReadableBuffer | None,
    threads: int,
    thread_bytes: int,
    stream_bytes: int,
    /,
) -> None: ...
def scatter_rows(
    table: ReadableBuffer,
    index: Sequence[ReadableBuffer],
    jobs: Sequence[_RowJob],
    layer: int,
    skip: ReadableBuffer | None,
    threads: int,
    thread_bytes: int,
    stream_bytes: int,
    /,
) -> None: ...
