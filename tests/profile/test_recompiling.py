"""Batch lengths that change every step: seen where the loader yields them, diagnosed, and padded to buckets."""

from __future__ import annotations

import itertools
from collections import namedtuple

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

from tpu_agent.plan.actions import PadBatch, Plan
from tpu_agent.plan.batches import pad_batch
from tpu_agent.profilers import shapes
from tpu_agent.profilers.batches import BatchWatch, describe_collate
from tpu_agent.profilers.schema import Profile, Step
from tpu_agent.propose.buckets import best_buckets, bucket_choices


def collate(batch):
    ids = pad_sequence(batch, batch_first=True, padding_value=3)
    labels = pad_sequence(batch, batch_first=True, padding_value=-100)
    mask = pad_sequence([torch.ones_like(x) for x in batch], batch_first=True, padding_value=0)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def sentences(count=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 50, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g) for _ in range(count)]


def watched(loader) -> BatchWatch:
    watch = BatchWatch(lambda: 1)
    watch.install()
    try:
        for _ in loader:
            pass
    finally:
        watch.uninstall()
    return watch


def test_the_watch_sees_each_batch_length_its_pad_values_and_the_collate_that_made_them():
    watch = watched(DataLoader(sentences(), batch_size=4, collate_fn=collate))
    assert watch.batches == 10
    assert watch.collates == [f"collate at test_recompiling.py:{collate.__code__.co_firstlineno}"]
    dims = {(d.tensor, d.dim): d for d in shapes.batch_dims(watch)}
    assert set(dims) == {("['input_ids']", 1), ("['attention_mask']", 1), ("['labels']", 1)}
    ids = dims[("['input_ids']", 1)]
    assert len(ids.by_batch) == 10 and len(ids.sizes) > 3 and ids.rows == [4]
    # read from the rows the mask marks as padded, not assumed from the names
    assert (ids.pad_value, ids.pad_value_seen) == (3.0, True)
    assert (dims[("['labels']", 1)].pad_value, dims[("['labels']", 1)].pad_value_seen) == (-100.0, True)
    assert dims[("['attention_mask']", 1)].pad_value == 0.0


def test_fixed_length_batches_vary_nothing_and_the_watch_leaves_the_loader_as_it_was():
    from torch.utils.data import dataloader

    before = dataloader._BaseDataLoaderIter.__next__
    watch = watched(DataLoader(torch.randn(32, 6, 5), batch_size=8))
    assert dataloader._BaseDataLoaderIter.__next__ is before
    assert shapes.batch_dims(watch) == []
    assert "default_collate" in watch.collates[0]


def test_a_collator_is_described_by_its_padding_settings():
    class DataCollatorWithPadding:  # the attributes transformers' collator has
        padding, pad_to_multiple_of, max_length = True, None, None

        def __call__(self, features):
            return features

    assert describe_collate(DataCollatorWithPadding()) == \
        "DataCollatorWithPadding(padding=True, pad_to_multiple_of=None, max_length=None)"


def _steps(compiled: list[bool], compile_s=1.0, wall_s=2.0, warmup=1):
    return [Step(index=i + 1, wall_s=wall_s, compile_s=compile_s if c else 0.0, compiled=c, warmup=i < warmup)
            for i, c in enumerate(compiled)]


def test_the_verdict_names_the_dim_its_shapes_and_the_share_of_the_run_spent_compiling(tmp_path):
    watch = watched(DataLoader(sentences(), batch_size=4, collate_fn=collate))
    dims = shapes.batch_dims(watch)
    script = tmp_path / "train.py"
    script.write_text("x = 1\nids = pad_sequence(batch, batch_first=True)\n# padding=True in a comment\n\"\"\"pad_sequence( in a docstring\"\"\"\n")
    found = shapes.sources(str(script), watch, None)
    assert found[1] == "train.py:2: ids = pad_sequence(batch, batch_first=True)" and len(found) == 2
    rec = shapes.diagnose(_steps([True] * 10), 1, dims, [], found)
    main = max(dims, key=lambda d: len(d.sizes))
    assert rec.verdict == (f"recompiling: {len(main.sizes)} shapes of dim 1 of the batch's {main.tensor} in 10 steps "
                           "(9 of 9 measured steps compiled), 50 % of the run compiling")
    assert rec.compile_s == 10.0 and rec.run_s == 20.0
    # shapes that settle after warm-up are no diagnosis
    assert shapes.diagnose(_steps([True, True, False, False, False, True], warmup=2), 2, dims, [], found) is None
    late = _steps([True, True] + [False] * 8 + [True, False] * 2 + [False] * 6, warmup=2)  # 2 of 18 measured steps
    assert shapes.diagnose(late, 2, dims, [], found) is None


def test_sizes_that_vary_and_their_relatives_are_known_so_the_padding_report_leaves_them_out():
    watch = watched(DataLoader(sentences(), batch_size=4, collate_fn=collate))
    rec = shapes.diagnose(_steps([True] * 10), 1, shapes.batch_dims(watch), [], [])
    vary = shapes.varying_sizes(rec)
    n = rec.batch_dims[0].sizes[0]
    assert {n, n - 1, 4 * n, 4 * (n - 1)} <= vary


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_buckets_are_the_least_padding_of_any_choice_of_aligned_lengths(count):
    lengths = [9, 13, 17, 17, 30, 31, 33, 60, 61, 62, 90]
    points = sorted({-(-n // 8) * 8 for n in lengths})

    def waste(buckets):
        return sum(min(b for b in buckets if b >= n) - n for n in lengths)

    best = min((c for k in range(1, count + 1) for c in itertools.combinations(points, k) if c[-1] == points[-1]),
               key=waste)
    found = best_buckets(lengths, count, 8)
    assert len(found) <= count and found[-1] == 96 and all(b % 8 == 0 for b in found)
    assert waste(found) == waste(best)



MARKED = """\
import torch
torch._dynamo.mark_dynamic(ids, 1, min=8, max=200)
mark_dynamic(x, 1, 4, 160)  # TorchTPU's positional form
torch._dynamo.mark_dynamic(ids, 0)
torch._dynamo.mark_dynamic(ids, dim)
"""


def test_mark_dynamic_bounds_are_read_and_the_last_bucket_covers_the_declared_max(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(MARKED)
    declared = shapes.bounds(str(script))
    assert [(b.dim, b.min, b.max, b.source) for b in declared] == [
        (1, 8, 200, "train.py:2"), (1, 4, 160, "train.py:3"), (0, None, None, "train.py:4")]
    watch = watched(DataLoader(sentences(), batch_size=4, collate_fn=collate))
    dims = shapes.batch_dims(watch)
    seen = max(max(d.sizes) for d in dims)
    assert seen < 200  # the batches never reached the declared max
    unbounded = shapes.diagnose(_steps([True] * 10), 1, dims, [], [])
    bounded = shapes.diagnose(_steps([True] * 10), 1, dims, [], [], declared)
    free = bucket_choices(Profile.model_construct(recompiling=unbounded))
    covered = bucket_choices(Profile.model_construct(recompiling=bounded))
    assert free[0] == (-(-seen // 8) * 8,)  # one fixed length: the longest seen, aligned
    assert covered[0] == (200,) and all(c[-1] == 200 for c in covered)  # every choice covers the declared max
    assert len(covered[-1]) > 1 and covered[-1][0] < 200  # more buckets still fit the lengths seen

Pair = namedtuple("Pair", "ids labels")


def test_pad_batch_pads_every_listed_tensor_by_the_same_amount_and_keeps_the_containers():
    action = PadBatch(buckets=(16, 32), values={"['input_ids']": 0, "['labels']": -100})
    batch = {"input_ids": torch.ones(2, 10, dtype=torch.long), "labels": torch.ones(2, 9, dtype=torch.long),
             "pixels": torch.ones(2, 10)}
    out = pad_batch(batch, action)
    assert out["input_ids"].shape == (2, 16) and out["labels"].shape == (2, 15)  # labels keep their offset
    assert out["pixels"] is batch["pixels"]
    assert out["input_ids"][:, 10:].eq(0).all() and out["labels"][:, 9:].eq(-100).all()
    assert torch.equal(out["input_ids"][:, :10], batch["input_ids"])
    tupled = pad_batch(Pair(torch.ones(2, 20), torch.ones(2, 20)), PadBatch(buckets=(16, 32), values={"[0]": 0.5}))
    assert isinstance(tupled, Pair) and tupled.ids.shape == (2, 32) and tupled.labels.shape == (2, 20)
    assert pad_batch(batch, PadBatch(buckets=(8,), values={"['input_ids']": 0}))["input_ids"].shape == (2, 16)


def test_pad_batch_says_its_class_from_whether_its_pad_values_are_the_scripts_own():
    own = PadBatch(buckets=(64,), values={"['input_ids']": 0})
    assumed = PadBatch(buckets=(64,), values={"['input_ids']": 0}, masked=False)
    assert own.effect == "exact" and Plan(actions=[own]).preserves_numerics
    assert assumed.effect == "training" and not Plan(actions=[assumed]).preserves_numerics
    with pytest.raises(ValueError):
        PadBatch(buckets=(64, 32), values={"['input_ids']": 0})
