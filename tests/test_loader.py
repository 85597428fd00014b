"""Epoch exactness of the DALI loader and the DataModule: len() batches, each sample once."""
from __future__ import annotations

from collections import Counter

import pytest
from helpers import cpu_options

from dali_pipe.loader import DaliLoader
from dali_pipe.pipeline import build_pipeline
from dali_pipe.samples import Files
from dali_pipe.spec import ImageSpec

SPEC = ImageSpec(16, 16, (0.5,) * 3, (0.5,) * 3)


def _indexed(photo_root):
    """All files with label = their own index, so a batch says exactly which samples it holds."""
    from dali_pipe.manifest import read_manifest

    m = read_manifest(photo_root, val_fraction=0, seed=0, skip_missing=False)
    files = [s.path for s in m.train]
    return files, list(range(len(files)))


def _loader(files, labels, batch, training, shard=0, shards=1, augment=None, roi=None):
    opts = cpu_options(batch, threads=2, training=training, shard_id=shard, num_shards=shards, seed=3, augment=augment,
                       roi_decode=roi)
    return DaliLoader(lambda ck: build_pipeline(Files(files, labels), SPEC, opts, training=training, checkpoint=ck),
                      training=training)


@pytest.mark.parametrize("batch", [5, 7, 48, 64])
def test_validation_sees_every_sample_once_per_epoch(photo_root, batch):
    files, labels = _indexed(photo_root)  # 48 files
    loader = _loader(files, labels, batch, training=False)
    for _ in range(3):
        seen = [int(x) for _, y in loader for x in y]
        assert sorted(seen) == labels
    assert len(loader) == -(-48 // batch)


def test_training_epochs_are_exact_and_drop_only_the_partial_batch(photo_root):
    """3 epochs: len() batches each, no sample twice, fewer than one batch dropped, order reshuffled."""
    files, labels = _indexed(photo_root)
    loader = _loader(files, labels, 7, training=True)
    assert len(loader) == 48 // 7
    orders = []
    for _ in range(3):
        batches = [y.tolist() for x, y in loader]
        assert len(batches) == len(loader)
        seen = [i for b in batches for i in b]
        assert max(Counter(seen).values()) == 1 and 48 - len(seen) < 7
        orders.append(seen)
    assert orders[0] != orders[1]


def test_abandoned_epoch_does_not_leak_into_the_next(photo_root):
    """Lightning may stop mid-epoch (sanity check, max_steps): the next iter() is still a full epoch."""
    files, labels = _indexed(photo_root)
    loader = _loader(files, labels, 5, training=False)
    it = iter(loader)
    next(it), next(it)
    del it
    seen = [int(x) for _, y in loader for x in y]
    assert sorted(seen) == labels


def test_shards_partition_the_data(photo_root):
    """2 shards: disjoint, same batch count, together everything but < 1 batch per shard."""
    files, labels = _indexed(photo_root)
    loaders = [_loader(files, labels, 5, training=True, shard=r, shards=2) for r in range(2)]
    for _ in range(2):
        per_rank = [[int(x) for _, y in ld for x in y] for ld in loaders]
        assert len(per_rank[0]) == len(per_rank[1]) == len(loaders[0]) * 5
        both = per_rank[0] + per_rank[1]
        assert max(Counter(both).values()) == 1
        assert 48 - len(both) < 2 * 5


@pytest.mark.parametrize("n,batch", [(41, 5), (43, 10), (21, 10), (40, 4)])
def test_uneven_shards_same_batch_count_no_duplicates(photo_root, n, batch):
    """Shards of unequal size: every rank runs the same number of full batches for 4 epochs, no
    sample twice in an epoch, and each rank drops at most its one partial batch."""
    files, labels = _indexed(photo_root)
    files, labels = files[:n], labels[:n]
    loaders = [_loader(files, labels, batch, training=True, shard=r, shards=2) for r in range(2)]
    assert len(loaders[0]) == len(loaders[1]) == (n // 2) // batch
    for _ in range(4):
        per_rank = [[int(x) for _, y in ld for x in y] for ld in loaders]
        both = per_rank[0] + per_rank[1]
        assert max(Counter(both).values()) == 1
        for r, seen in enumerate(per_rank):
            shard = (n * (r + 1)) // 2 - (n * r) // 2
            assert len(seen) == len(loaders[0]) * batch and shard - len(seen) <= batch


def _sequence(loader, epochs):
    return [[(y.tolist(), round(float(x.sum()), 2)) for x, y in loader] for _ in range(epochs)]


HEAVY = {"auto_augment": "trivial", "random_erase": 0.5, "crop_scale": (0.35, 1.0)}


@pytest.mark.parametrize("epoch,batches,augment,roi", [(0, 2, None, None), (1, 0, None, None), (0, 48 // 7, None, None),
                                                      (0, 3, HEAVY, None), (0, 3, HEAVY, False)])
def test_restored_loader_continues_the_uninterrupted_sequence(photo_root, epoch, batches, augment, roi):
    """State taken after `epoch` full epochs plus `batches` batches: a loader rebuilt from it yields
    exactly what the uninterrupted loader yields from there on (samples and augmented pixels); also with the
    whole decode + random_resized_crop that nvJPEG 12 trains with on the GPU (roi False)."""
    files, labels = _indexed(photo_root)
    epochs = 2 if augment else 3  # the augmented case decodes and augments on the CPU: keep it short
    reference = _sequence(_loader(files, labels, 7, training=True, augment=augment, roi=roi), epochs)
    first = _loader(files, labels, 7, training=True, augment=augment, roi=roi)
    for _ in range(epoch):
        list(first)
    it = iter(first)
    head = [(y.tolist(), round(float(x.sum()), 2)) for _, (x, y) in zip(range(batches), it)]
    state = first.state()
    second = _loader(files, labels, 7, training=True, augment=augment, roi=roi)
    second.restore(state)
    # the rest of the interrupted epoch (none when it was fully yielded: Lightning then starts the next)
    rest = [(y.tolist(), round(float(x.sum()), 2)) for x, y in second] if batches < len(second) else []
    assert head + rest == reference[epoch]
    assert _sequence(second, epochs - epoch - 1) == reference[epoch + 1:]


def test_seed_sets_the_order_and_epochs_differ(photo_root):
    files, labels = _indexed(photo_root)

    def order(seed):
        opts = cpu_options(8, seed=seed)
        loader = DaliLoader(lambda ck: build_pipeline(Files(files, labels), SPEC, opts, training=True, checkpoint=ck),
                            training=True)
        return [[i for _, y in loader for i in y.tolist()] for _ in range(2)]

    a, b, c = order(0), order(0), order(1)
    assert a == b and a != c and a[0] != a[1]


def test_a_run_resumes_with_the_training_decode_its_checkpoint_was_taken_with(photo_root, capfd):
    """A loader position saved by the other training decode (an earlier version's ROI decode on a GPU, or a
    machine whose nvImageCodec rule differs; here the whole decode, restored where the CPU would build the ROI
    decode) resumes with the graph that wrote it, exactly, and says so once; DALI would refuse it otherwise
    ("The checkpoint might come from another pipeline")."""
    from dali_pipe import pipeline

    pipeline._NOTED.clear()
    files, labels = _indexed(photo_root)
    reference = _sequence(_loader(files, labels, 7, training=True, augment=HEAVY, roi=False), 1)
    first = _loader(files, labels, 7, training=True, augment=HEAVY, roi=False)
    it = iter(first)
    head = [(y.tolist(), round(float(x.sum()), 2)) for _, (x, y) in zip(range(3), it)]
    second = _loader(files, labels, 7, training=True, augment=HEAVY)  # the rule's decode on the CPU: the ROI one
    second.restore(first.state())
    assert head + [(y.tolist(), round(float(x.sum()), 2)) for x, y in second] == reference[0]
    assert capfd.readouterr().err.count("resume: this run's data position was saved with the whole-image") == 1


def test_a_resumed_loader_builds_its_pipeline_once(photo_root):
    """The pipeline is built at the loader's first use, not when it is made: a resume (made, then restored)
    builds it once, from the checkpoint (it was built twice, the first one thrown away: at 1 M files about
    11 s and 0.3 GB more of a spot restart); a fresh loader builds it once too."""
    files, labels = _indexed(photo_root)
    opts = cpu_options(7, threads=2, training=True, seed=3)
    builds = []

    def build(checkpoint):
        builds.append(checkpoint is not None)
        return build_pipeline(Files(files, labels), SPEC, opts, training=True, checkpoint=checkpoint)

    first = DaliLoader(build, training=True)
    assert builds == []
    it = iter(first)
    next(it)
    state = first.state()
    assert builds == [False]
    second = DaliLoader(build, training=True)
    second.restore(state)
    assert len(second) == len(first) and builds == [False, True]
    assert next(iter(second))[1].tolist() == next(it)[1].tolist()  # the same next batch
    assert builds == [False, True]


def test_a_position_of_another_reader_is_refused_and_the_loader_starts_over(photo_root):
    """A saved position of another reader (here the shard reader's, restored into a file reader) raises
    ReaderChanged, which the DataModule reports as "the data order of the resumed epoch restarts"; the loader
    then yields its epoch from the start, each sample once."""
    from dali_pipe.loader import ReaderChanged

    files, labels = _indexed(photo_root)
    first = _loader(files, labels, 8, training=False)
    state = {**first.state(), "reader": "shard-plan/1"}
    second = _loader(files, labels, 8, training=False)
    with pytest.raises(ReaderChanged, match="shard-plan/1"):
        second.restore(state)
    assert sorted(int(v) for _, y in second for v in y) == labels


@pytest.mark.parametrize("training", [True, False])
def test_a_shard_sample_that_fails_to_decode_is_named(photo_root, tmp_path, training):
    """DALI names no file for bytes fed from a shard ("Failed to decode sample #1 :"); the loader finds the sample
    at that place of the failed batch in the epoch plan and names it, its shard and its (shard, entry); before:
    "failed on a file of the current batch". Shuffled (training) and in order."""
    import io
    import tarfile

    from dali_pipe.config import DataSettings
    from dali_pipe.inputs import read
    from dali_pipe.loader import PipelineDecodeError

    tar = tmp_path / "train-000000.tar"
    with tarfile.open(tar, "w") as t:
        for i, p in enumerate(sorted(photo_root.glob("*/*.jpg"))[:14]):
            data = p.read_bytes()
            if i == 9:
                j = data.index(b"\xff\xc4")  # headers parse (the fast checks pass), the Huffman table is bogus
                data = data[:j + 4] + b"\x00" + b"\xff" * 16 + data[j + 21:]
            for name, blob in ((f"s{i:02d}.jpg", data), (f"s{i:02d}.cls", str(i % 2).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                t.addfile(info, io.BytesIO(blob))
    shards = read(DataSettings(data=str(tar), cache_dir=str(tmp_path / "cache"), val_fraction=0))
    opts = cpu_options(4, threads=2, training=training, seed=3)
    loader = DaliLoader(lambda ck: build_pipeline(shards.train, SPEC, opts, training=training, checkpoint=ck),
                        training=training)
    with pytest.raises(PipelineDecodeError, match=rf"DALI could not decode sample 's09' of {tar}\. Rerun with "
                                                  "--scan full") as e:
        for _ in range(2):
            list(loader)
    assert e.value.member == (0, 9)
