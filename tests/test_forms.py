"""Telling the input forms apart from names alone: the split words Hugging Face datasets itself reads in file
names, one message listing every form for a folder that holds none, and no heavy import on the way."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dali_pipe.config import UsageError
from dali_pipe.forms import split_of
from dali_pipe.inputs import FORMS, detect

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["train-00000-of-00004.parquet", "validation-00000-of-00001.parquet", "test-00000-of-00001.parquet",
         "val.parquet", "dev_2.parquet", "my-training-set.parquet", "eval.parquet", "data-00000-of-00001.parquet",
         "trainer.parquet", "retrain.parquet", "pretest-1.parquet", "x.test.parquet"]


def test_split_words_are_those_of_hugging_face_datasets(tmp_path):
    """Each file name's split, as `datasets.data_files` resolves a folder holding it (a name without a split word is
    its default, train)."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    for name in NAMES:
        folder = tmp_path / name
        folder.mkdir()
        (folder / name).write_bytes(b"")
        files = DataFilesDict.from_patterns(get_data_patterns(str(folder)), base_path=str(folder))
        theirs = next(str(s) for s, fs in files.items() if any(Path(f).name == name for f in fs))
        ours = split_of(name) or "train"
        assert {"validation": "val"}.get(theirs, theirs) == ours, name


def test_a_folder_of_no_form_gets_one_message_listing_every_form(tmp_path):
    from dali_pipe.cli import parse_train

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    assert detect(str(tmp_path)) is None
    with pytest.raises(UsageError) as e:
        parse_train(["--data", str(tmp_path)])
    assert "holds none of the input forms" in str(e.value) and all(f.title in str(e.value) for f in FORMS)


def test_telling_the_form_imports_nothing_heavy(tmp_path):
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "a.JPG").write_bytes(b"")
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from dali_pipe.inputs import detect; "
            f"print(detect({str(tmp_path)!r}).name); "
            "print(sorted(m for m in ('torch', 'pyarrow', 'pandas', 'nvidia.dali', 'pytorch_lightning', 'PIL') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["imagefolder", "[]"]
