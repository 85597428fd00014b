"""The data before its loaders: the scan's refusal, the dropped partial batches, the fingerprint's data side."""
from __future__ import annotations

import pytest


def test_the_bad_fraction_refusal_names_a_value_that_lets_the_run_go_on(tmp_path):
    """5 of 24 bad (20.8%): the refusal asks for a --max-bad-fraction that passes (0.21, not the 20.8% it shows)."""
    from dali_pipe.config import DataSettings
    from dali_pipe.dataset import ScanError, check_bad_fraction
    from dali_pipe.scan import ScanResult

    result = ScanResult(bad={f"/d/{i}.jpg": "truncated JPEG" for i in range(5)}, total=24)
    with pytest.raises(ScanError, match=r"raise --max-bad-fraction to 0\.21 to train") as e:
        check_bad_fraction(result, DataSettings(max_bad_fraction=0.05), tmp_path)
    advised = float(str(e.value).split("--max-bad-fraction to ")[1].split()[0])
    check_bad_fraction(result, DataSettings(max_bad_fraction=advised), tmp_path)
    for bad, total in ((1, 3), (2, 3), (29, 100), (57, 100), (1, 7), (3, 3)):
        from dali_pipe.dataset import enough_fraction

        assert bad / total <= float(enough_fraction(bad, total)) < bad / total + 0.01


def test_drop_note_says_what_each_epoch_leaves_out_and_a_better_batch():
    """55 images at batch 32 keep one batch and drop 23 (42%) every epoch; 27 drops one. Under 10%: silent."""
    from dali_pipe.dataset import drop_note, dropped_per_epoch

    assert dropped_per_epoch(55, 32, 1) == 23 and dropped_per_epoch(55, 8, 2) == 7  # 2 ranks: 27 each, 3 full batches
    note = drop_note(55, 32, 1)
    assert note.startswith("note: 23 of the 55 training images (42%) are left out of every epoch: each of the 1 "
                           "process(es) trains 1 full batch(es) of 32 and drops its partial batch")
    assert "--batch-size 27 would drop 1." in note and note.endswith("Validation still sees every image.")
    assert drop_note(55, 5, 1) is None and drop_note(1000, 32, 1) is None  # 0 and 8 dropped
    assert drop_note(55, 27, 1) is None and drop_note(55, int(drop_note(55, 8, 2).split("--batch-size ")[1].split()[0]),
                                                        2) is None  # the batch size it names drops no more than 10%
