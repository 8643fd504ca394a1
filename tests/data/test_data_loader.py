import numpy as np
import pytest
import torch
from data_rows import user_row, write_parquet

from megatron_rl.data import RLDataset, make_dataloader
from megatron_rl.protocol import DataProto

N = 10


@pytest.fixture(scope="module")
def dataset(tokenizer, tmp_path_factory):
    rows = [user_row(f"copy: {i}", ground_truth=str(i)) for i in range(N)]
    return RLDataset(
        write_parquet(tmp_path_factory.mktemp("d") / "d.parquet", rows), tokenizer, max_prompt_length=24
    )


def indices(batches) -> list[list[int]]:
    return [list(b.non_tensor_batch["index"]) for b in batches]


def test_batches_are_dataprotos_with_the_contract_fields(dataset, tokenizer):
    batch = next(iter(make_dataloader(dataset, batch_size=4, shuffle=False, seed=0)))
    assert isinstance(batch, DataProto) and len(batch) == 4
    assert set(batch.batch.keys()) == {"input_ids", "attention_mask", "position_ids"}
    assert set(batch.non_tensor_batch) == {"raw_prompt", "data_source", "reward_model", "extra_info", "index"}
    for key in batch.batch.keys():
        assert batch.batch[key].shape == (4, 24) and batch.batch[key].dtype == torch.long
    assert batch.batch["input_ids"][:, 0].eq(tokenizer.pad_token_id).all()  # left-padded
    assert batch.non_tensor_batch["reward_model"][3] == {"style": "rule", "ground_truth": "3"}
    assert batch.non_tensor_batch["raw_prompt"][1] == [{"role": "user", "content": "copy: 1"}]


def test_each_epoch_is_a_seeded_permutation(dataset):
    loader = make_dataloader(dataset, batch_size=3, shuffle=True, seed=7)
    assert len(loader) == 3  # drop_last: 10 // 3
    epoch0, epoch1 = indices(loader), indices(loader)
    assert loader.epoch == 2
    for epoch in (epoch0, epoch1):
        flat = [i for b in epoch for i in b]
        assert len(set(flat)) == 9 and set(flat) <= set(range(N))
    assert epoch0 != epoch1
    assert indices(make_dataloader(dataset, batch_size=3, shuffle=True, seed=7)) == epoch0
    assert indices(make_dataloader(dataset, batch_size=3, shuffle=True, seed=8)) != epoch0


def test_without_drop_last_the_tail_batch_is_kept(dataset):
    loader = make_dataloader(dataset, batch_size=4, shuffle=False, seed=0, drop_last=False)
    assert indices(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and len(loader) == 3


@pytest.mark.parametrize("stop_after", [1, 3, 4])  # inside epoch 0, at its end, inside epoch 1
def test_resume_continues_exactly_where_the_run_stopped(dataset, stop_after):
    reference = make_dataloader(dataset, batch_size=3, shuffle=True, seed=3)
    uninterrupted = indices(reference) + indices(reference)

    first = make_dataloader(dataset, batch_size=3, shuffle=True, seed=3)
    seen = []
    for _ in range(2):  # trainer loop: epochs, stopping early to "checkpoint"
        for batch in first:
            seen.append(list(batch.non_tensor_batch["index"]))
            if len(seen) == stop_after:
                break
        if len(seen) == stop_after:
            break
    state = first.state_dict()

    resumed = make_dataloader(dataset, batch_size=3, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    while resumed.epoch < 2:
        seen += indices(resumed)
    assert seen == uninterrupted


def test_resume_refuses_a_different_order(dataset):
    state = make_dataloader(dataset, batch_size=3, shuffle=True, seed=3).state_dict()
    with pytest.raises(ValueError, match="batch_size: saved 3, now 2"):
        make_dataloader(dataset, batch_size=2, shuffle=True, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="seed: saved 3, now 4"):
        make_dataloader(dataset, batch_size=3, shuffle=True, seed=4).load_state_dict(state)


def test_batch_larger_than_dataset_is_refused(dataset):
    with pytest.raises(ValueError, match=f"batch_size=11 is larger than the dataset \\({N} prompts\\)"):
        make_dataloader(dataset, batch_size=11, shuffle=True, seed=0)


def test_worker_processes_give_the_same_batches(dataset):
    serial = indices(make_dataloader(dataset, batch_size=5, shuffle=True, seed=1))
    parallel = make_dataloader(dataset, batch_size=5, shuffle=True, seed=1, num_workers=2)
    batches = list(parallel)
    assert indices(batches) == serial
    assert np.array_equal(
        batches[0].batch["input_ids"].numpy(),
        torch.stack([dataset[i]["input_ids"] for i in serial[0]]).numpy(),
    )
