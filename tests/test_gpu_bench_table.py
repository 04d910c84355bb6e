"""bench/gpu_bench.py's table (CPU only: the printing, not the timing)."""

from __future__ import annotations

import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import gpu_bench  # noqa: E402


def _row(**kw):
    return {"k": 4096, "n": 14336, "K": 3, "cb": "mul1", "rows": 1, "floor_us": 5.2, **kw}


def test_err_column_is_the_worst_of_ours(capsys):
    """A defs A/B of --impls cuda_pro alone printed "nan" for the error, so a wrong build would
    have gone unseen: the column now shows the largest error of our implementations measured."""
    gpu_bench.print_table([_row(cuda_pro_us=29.6, cuda_pro_err=3.6e-4),
                           _row(cuda_us=29.7, cuda_err=3.6e-4, cuda_pro_us=29.5, cuda_pro_err=0.71),
                           _row(fp16_us=40.0)])
    lines = capsys.readouterr().out.splitlines()[2:]
    assert lines[0].endswith("3.6e-04 / nan"), lines[0]
    assert lines[1].endswith("7.1e-01 / nan"), lines[1]      # pro wrong beside a right cuda
    assert lines[2].endswith("nan / nan"), lines[2]          # none of ours measured


def test_large_rows_table_has_the_fold2_path(capsys):
    """The rows > 64 table prints the doubly folded path (decode_fold2, x itself into cuBLAS)
    beside the other two, its ratio to fp16 cuBLAS and its error."""
    parts = {f"cuda_{c}_us": 10.0 for c in ("had_in", "decode", "decode_fold", "decode_fold2", "mm",
                                            "had_out")}
    gpu_bench.print_large([_row(rows=2048, write_us=40.0, cuda_nofold_us=474.3, cuda_fold_us=437.8,
                                cuda_fold2_us=400.0, cuda_fold2_err=2.5e-4, fp16_us=372.1, fp16_nk_us=362.0,
                                **parts)])
    row = capsys.readouterr().out.splitlines()[5]     # the title, its caution, the header, the rule
    assert "400.0" in row and row.split("|")[-1].split() == ["1.27", "1.18", "1.07", "2.5e-04"], row
