def apply_runs(
    pages: int,
    n_groups: int,
    pages_per_group: int,
    page_bytes: int,
    runs: int,
    n_runs: int,
    write_back: int,
    n_write_back: int,
    prefetch: int,
    threads: int,
    /,
) -> tuple[int, int] | None: ...
