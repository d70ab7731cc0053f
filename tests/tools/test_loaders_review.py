"""Files the command line reads, review round 4: deeply nested JSON in a folder's config.json or shard
index, and a bench CSV csv cannot split (a stray quote), are one error line naming the file and exit 2
(bad input files, as the CLI's docs say), no traceback; read_rows raises the ValueError it promises.
Run in process as the other CLI tests (main(argv) is what python -m sparse24 exits with; test_cli.py's
test_python_m_entry_point covers the process itself)."""
import re
from pathlib import Path

import pytest

import sparse24
from hf_models import tiny_llama
from test_cli import assert_one_line_error, run

DEEP = "[" * 5000 + "]" * 5000  # 10 KB: past Python's recursion limit in json's decoder


def _folder(tmp_path) -> Path:
    model = tiny_llama()
    sparse24.sparsify_(model)
    model.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_inspect_and_prune_of_nested_json_are_one_line(capsys, tmp_path, name):
    folder = _folder(tmp_path)
    if name != "config.json":  # a sharded folder: its index names the shards
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / name).write_text(DEEP)
    capsys.readouterr()
    for argv in (["inspect", str(folder)], ["prune", str(folder), "--out", str(tmp_path / "out")]):
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and out == "", (argv, rc, out)
        assert_one_line_error(err, f"sparse24 {argv[0]}: error: ", name, "maximum recursion depth")
    assert not (tmp_path / "out").exists()


def stray_quote_csv(path: Path, rows: int = 1500) -> Path:
    """A bench CSV of the repository whose first row's device cell opens a quote it never closes, then
    ``rows`` rows: over 128 KiB, csv's field limit, which csv reaches looking for the quote's end."""
    lines = (Path(__file__).resolve().parents[2] / "results/cpu-amd-epyc/bench.csv").read_text().splitlines()
    header, good = lines[0], lines[1]
    assert ",AMD EPYC," in good
    path.write_text(header + "\n" + good.replace(",AMD EPYC,", ',"AMD EPYC,') + "\n" + (good + "\n") * rows)
    assert path.stat().st_size > 131072
    return path


def test_read_rows_names_the_file_and_line_csv_cannot_split(tmp_path):
    from sparse24.tools.plot import read_rows
    path = stray_quote_csv(tmp_path / "bench.csv")
    with pytest.raises(ValueError, match=re.escape(f"{path} line 2: not a valid CSV row (field larger than")):
        read_rows([path])  # line 2: the row with the stray quote


def test_plot_of_a_csv_csv_cannot_split_is_one_line(capsys, tmp_path):
    path = stray_quote_csv(tmp_path / "bench.csv")
    capsys.readouterr()
    rc, out, err = run(capsys, "plot", str(path), "--out", str(tmp_path / "p.png"))
    assert rc == 2 and out == "", (rc, out)
    assert_one_line_error(err, f"sparse24 plot: error: {path} line 2: not a valid CSV row")
    assert not (tmp_path / "p.png").exists()
