def permute_blocks(
    bases: int,
    n_bases: int,
    block_ids: int,
    n_ids: int,
    runs: int,
    n_runs: int,
    block_stride: int,
    row_bytes: int,
    rows_per_block: int,
    threads: int,
    /,
) -> None: ...
